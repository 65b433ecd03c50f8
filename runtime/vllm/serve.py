"""Serving the speculators draft with vLLM: the `vllm serve` argv and the README of speculators/."""
from __future__ import annotations

import json
import shlex

from runtime.vllm.speculators_config import SPECULATORS_VERSION
from runtime.vllm.speculators_format import SpeculatorsExport
from runtime.vllm.speculators_weights import WEIGHTS_FILE


def vllm_serve_command(spec: SpeculatorsExport, *, target: str, draft: str, max_model_len: int | None = None,
                       kv_cache_fp8: bool = False, tensor_parallel_size: int = 1, port: int = 8000) -> list[str]:
    """`vllm serve <target> --speculative-config {"model": <draft>, ...}` (argv, for shlex.join). `draft` is where
    the speculators directory lives once committed (the stage writes into a temporary directory first)."""
    sc = {"model": draft, "method": spec.algorithm, "num_speculative_tokens": spec.speculative_tokens}
    argv = ["vllm", "serve", target, "--host", "127.0.0.1", "--port", str(port),
            "--speculative-config", json.dumps(sc, separators=(",", ":"))]
    if max_model_len:
        argv += ["--max-model-len", str(int(max_model_len))]
    if kv_cache_fp8:
        argv += ["--kv-cache-dtype", "fp8"]
    if tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(int(tensor_parallel_size))]
    return argv


def readme(spec: SpeculatorsExport, argv: list[str], *, draft: str, source_draft: str,
           deployed_draft: str | None = None) -> str:
    cmd = shlex.join(argv)
    kind = "EAGLE-3" if spec.algorithm == "eagle3" else f"DFlash (block {spec.block_size})"
    vocab = (f"Reduced draft vocabulary: {spec.draft_vocab_size} of {spec.vocab_size} tokens (`d2t`, `t2d`)"
             if spec.has_d2t else f"Full vocabulary ({spec.vocab_size} tokens)")
    shared = ("The token embeddings are the verifier's: `embed_tokens.weight` is a bit-exact copy of the target's, "
              "which vLLM\nfinds equal to the target's and shares." if spec.algorithm == "eagle3" else
              "Embeddings and LM head are the verifier's and not in this directory: vLLM shares the target's, the "
              f"speculators\nlibrary loads them from `speculators_config.verifier.name_or_path` = `{spec.verifier}`.")
    fp8 = ("" if deployed_draft in (None, source_draft) else
           f"\nThe TensorRT-LLM deployment uses the FP8 draft `{deployed_draft}`; vLLM gets the BF16 draft it was "
           "quantized from (the speculators library cannot run ModelOpt FP8 weights, so nothing here verifies one).\n")
    notes = "".join(f"- {n}\n" for n in spec.notes) or "- none\n"
    return f"""# {kind} draft in the speculators {SPECULATORS_VERSION} format (for vLLM)

`config.json` + `{WEIGHTS_FILE}`: the draft from `{source_draft}` (ModelOpt's export) in the format of
vllm-project/speculators, which vLLM reads natively. {vocab}; capture layers
`{spec.aux_hidden_state_layer_ids}` in speculators/vLLM numbering (the decoder layer a hidden state enters; ModelOpt
and TensorRT-LLM number the same states `{spec.modelopt_layer_ids}`, the layer they leave).
{shared}
{fp8}
## Serve
```bash
{cmd}
```
or, since `config.json` names the verifier, `vllm serve {shlex.quote(draft)}` (vLLM then serves
`{spec.verifier}` with this draft; the path must exist where vLLM runs). `num_speculative_tokens` =
{spec.speculative_tokens} is the tuned draft length (`speculators_config.proposal_methods[0].speculative_tokens`);
vLLM uses one draft length at every batch size, TensorRT-LLM's per-batch schedule has no vLLM equivalent.

## Notes
{notes}
## Check
tests/test_speculators.py loads this format with the speculators library (in its own environment) and checks
that its draft's argmax on the same target hidden states equals specpipe's runtime at every position. vLLM
itself was not run.
"""
