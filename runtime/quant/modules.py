"""Where the quantized pieces of a model are: its decoder layers, its ModelOpt-quantized linears, the groups
TensorRT-LLM fuses into one GEMM, and the `exclude_modules` pattern rule."""
from __future__ import annotations

import fnmatch

from runtime.errors import RuntimeFailure


def quantized_linears(model) -> dict:
    """{name: module} of every module whose ModelOpt weight quantizer is enabled."""
    return {n: m for n, m in model.named_modules()
            if getattr(m, "weight_quantizer", None) is not None and getattr(m.weight_quantizer, "is_enabled", False)
            and hasattr(m, "weight")}


def fused_groups(names) -> list[list[str]]:
    """TensorRT-LLM's fused GEMMs among `names`: q/k/v and gate/up of one block (runtime.engine.fp8.FUSED_GROUPS)."""
    from runtime.engine.fp8 import FUSED_GROUPS

    names = set(names)
    groups = []
    for parent in sorted({n.rpartition(".")[0] for n in names}):
        for g in FUSED_GROUPS:
            members = [f"{parent}.{leaf}" if parent else leaf for leaf in g]
            if all(m in names for m in members):
                groups.append(members)
    return groups


def decoder_layers(model) -> tuple[str, list]:
    """(module path, layers) of the model's decoder-layer list (`model.layers` for Llama-family models)."""
    from torch import nn

    n_layers = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n_layers and name.endswith("layers"):
            return name, list(mod)
    raise RuntimeFailure("cannot find the model's decoder layers (a ModuleList named '*layers' with "
                         f"num_hidden_layers={n_layers} entries)")


def matches(name: str, patterns) -> bool:
    """Whether module `name` is named by one of `patterns` (fnmatch, as in `exclude_modules`; a pattern also names
    everything under it)."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") or name.startswith(p + ".")
               for p in patterns)
