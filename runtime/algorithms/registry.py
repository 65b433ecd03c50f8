"""The algorithms by name, and `check_export` for an export whose algorithm its config.json declares."""
from __future__ import annotations

from runtime.algorithms import dflash, eagle3
from runtime.algorithms.export import Export, Problem, TargetShape, read_export

ALGORITHMS = {"eagle3": eagle3, "dflash": dflash}


def algorithm_of(cfg: dict) -> str | None:
    """The algorithm config.json's `architectures` declares (None when neither)."""
    archs = cfg.get("architectures") or []
    return "eagle3" if eagle3.ARCHITECTURE in archs else "dflash" if dflash.ARCHITECTURE in archs else None


def check_export(src, cfg: dict | None = None, *, target: TargetShape | None = None, where: str | None = None,
                 algorithm: str | None = None) -> list[Problem]:
    """Every problem of an export (a directory, or `cfg` + tensors) as its algorithm defines them; `algorithm`
    defaults to the one config.json declares."""
    ex = src if isinstance(src, Export) else read_export(src, cfg, where)
    algo = algorithm or algorithm_of(ex.cfg)
    if algo is None:
        archs = ex.cfg.get("architectures")
        return [Problem("config", f"{ex.where}: architectures {archs} is neither {eagle3.ARCHITECTURE} nor "
                                  f"{dflash.ARCHITECTURE}; export the draft with ModelOpt's export_speculative_decoding")]
    return ALGORITHMS[algo].check_export(ex, target=target)
