"""TensorRT-LLM's LLM-API field names per version, and the check that every written key exists in them.

The field lists are packaged in `runtime/trtllm/schemas/*.json`, extracted from TensorRT-LLM's `llm_args.py`
(and, for Triton's LLM-API model, its `model.yaml`/`config.pbtxt` interface). `unknown_keys` is what the build
stage's `schema_keys` check and the export's model.yaml check run.
"""
from __future__ import annotations

import json
from functools import cache
from importlib import resources

from runtime.trtllm import compat


@cache
def load_schema(name: str) -> dict:
    """A packaged schema: 'trtllm-1.2', 'trtllm-1.3' or 'triton-llmapi-model'."""
    return json.loads(resources.files("runtime.trtllm").joinpath("schemas", f"{name}.json").read_text())


def _class_fields(schema: dict, cls: str) -> set[str]:
    c = schema["classes"][cls]
    names = set(c.get("all_field_names") or c["fields"])
    for f in c.get("fields", {}).values():
        names.update(f.get("aliases", []))
    return names


@cache
def allowed_fields(version: str) -> dict[str, set[str]]:
    """Field names per config class for `version`: 'top', 'kv_cache_config', 'cuda_graph_config',
    'decoding_types' and one entry per speculative decoding_type."""
    rel = compat.release(version)
    spec = load_schema(rel.schema)
    base = load_schema("trtllm-1.2")  # 1.3's extraction covers speculative classes only (see its "note")
    out = {
        "top": _class_fields(base, "TorchLlmArgs"),
        "kv_cache_config": _class_fields(base, "KvCacheConfig"),
        "cuda_graph_config": _class_fields(base, "CudaGraphConfig"),
        "decoding_types": set(spec["decoding_types"]),
    }
    aliases = {a for f in spec["classes"]["DecodingBaseConfig"]["fields"].values() for a in f.get("aliases", [])}
    if "SAEnhancerConfig" in spec["classes"]:
        out["sa_config"] = _class_fields(spec, "SAEnhancerConfig")
    for dtype, cls in spec["decoding_types"].items():
        if cls in spec["classes"]:
            out[f"speculative:{dtype}"] = _class_fields(spec, cls) | aliases | {"decoding_type"}
    return out


TRITON_CONFIG_KEYS = {"max_batch_size", "decoupled", "cancellation_check_period_ms"}


def unknown_keys(options: dict, version: str, *, model_yaml: bool = False) -> list[str]:
    """Dotted paths of keys `version` does not know (empty = every key exists in its schema).
    `model_yaml`: the body of Triton's model.yaml, which adds `triton_config`."""
    f = allowed_fields(version)
    bad: list[str] = []
    for k, v in options.items():
        if model_yaml and k == "triton_config":
            bad += [f"triton_config.{t}" for t in v if t not in TRITON_CONFIG_KEYS]
            continue
        if k not in f["top"]:
            bad.append(k)
            continue
        if k in ("kv_cache_config", "cuda_graph_config") and isinstance(v, dict):
            bad += [f"{k}.{t}" for t in v if t not in f[k]]
        if k == "speculative_config" and isinstance(v, dict):
            dtype = v.get("decoding_type")
            if dtype not in f["decoding_types"] or f"speculative:{dtype}" not in f:
                bad.append(f"speculative_config.decoding_type={dtype}")
            else:
                bad += [f"speculative_config.{t}" for t in v if t not in f[f"speculative:{dtype}"]]
                if isinstance(v.get("sa_config"), dict) and "sa_config" in f:
                    bad += [f"speculative_config.sa_config.{t}" for t in v["sa_config"] if t not in f["sa_config"]]
    return bad
