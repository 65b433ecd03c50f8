"""vLLM's n-gram (prompt-lookup) speculative_config, as `build.ngram` writes it, and its check against vLLM's
source. vLLM 0.32.0 `vllm/config/speculative.py`: `SpeculativeConfig` fields method ("ngram" among
`SpeculativeMethod`), num_speculative_tokens, prompt_lookup_min, prompt_lookup_max (both >= 1, min <= max; when
only one is given the other takes its value); the proposer is `vllm/v1/spec_decode/ngram_proposer.py`, whose rule
runtime/engine/ngram_drafter.py ports (validate measures it)."""
from __future__ import annotations

import json
import subprocess

from runtime.algorithms.ngram import NGRAM

FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")

# Run in vLLM's environment: the fields exist on SpeculativeConfig, "ngram" is a method, and the config validates
_CHECK = """
import json, sys, typing
from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod
sc = json.loads(sys.argv[1])
fields = set(SpeculativeConfig.__dataclass_fields__ if hasattr(SpeculativeConfig, "__dataclass_fields__")
             else SpeculativeConfig.model_fields)
methods = set(typing.get_args(SpeculativeMethod))
print(json.dumps({"unknown": sorted(set(sc) - fields), "ngram_method": sc["method"] in methods}))
"""


def speculative_config(k: int, min_n: int, max_n: int) -> dict:
    if not 1 <= min_n <= max_n or k < 1:
        raise ValueError(f"vLLM ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max and k >= 1, got {min_n}, {max_n}, {k}")
    return {"method": NGRAM.vllm_method, "num_speculative_tokens": k, "prompt_lookup_min": min_n, "prompt_lookup_max": max_n}


def check_with_vllm(python: str, sc: dict, timeout: float = 300) -> dict:
    """The config's keys against the installed vLLM's SpeculativeConfig ({"unknown": [...], "ngram_method": bool})."""
    r = subprocess.run([python, "-c", _CHECK, json.dumps(sc)], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"vLLM's SpeculativeConfig could not be read: {r.stderr[-800:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def serve_command(target_dir: str, sc: dict) -> str:
    return f"vllm serve {target_dir} --speculative-config '{json.dumps(sc)}'"
