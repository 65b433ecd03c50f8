"""The algorithms by name (`get`), the one an export's config.json declares (`of_config`), and `check_export` for an
export whose algorithm its config.json declares."""
from __future__ import annotations

from runtime.algorithms.base import Algorithm
from runtime.algorithms.dflash import DFLASH
from runtime.algorithms.eagle3 import EAGLE3
from runtime.algorithms.export import Export, Problem, TargetShape, read_export
from runtime.algorithms.ngram import NGRAM

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (EAGLE3, DFLASH, NGRAM)}
# the algorithms with an exported draft, found by config.json's architecture
EXPORTED = tuple(a for a in ALGORITHMS.values() if a.architecture)


class UnknownAlgorithm(ValueError):
    """A name no algorithm answers to; the message lists the known ones."""


def get(name: str | Algorithm) -> Algorithm:
    """The algorithm called `name` (case-insensitive; an `Algorithm` is returned as is). Raises UnknownAlgorithm."""
    if isinstance(name, Algorithm):
        return name
    algo = ALGORITHMS.get(str(name).lower())
    if algo is None:
        raise UnknownAlgorithm(f"unknown speculative-decoding algorithm {name!r}: expected one of {', '.join(ALGORITHMS)}")
    return algo


class Named:
    """Mixin of a config section whose `kind` names the algorithm: `.traits` is that `Algorithm`."""

    @property
    def traits(self) -> Algorithm:
        return get(self.kind)


def of_config(cfg: dict) -> Algorithm | None:
    """The algorithm an export's config.json `architectures` declares (None when none)."""
    archs = cfg.get("architectures") or []
    return next((a for a in EXPORTED if a.architecture in archs), None)


def algorithm_of(cfg: dict) -> str | None:
    """The name of the algorithm config.json declares (None when none)."""
    algo = of_config(cfg)
    return algo.name if algo else None


def check_export(src, cfg: dict | None = None, *, target: TargetShape | None = None, where: str | None = None,
                 algorithm: str | Algorithm | None = None) -> list[Problem]:
    """Every problem of an export (a directory, or `cfg` + tensors) as its algorithm defines them; `algorithm`
    defaults to the one config.json declares."""
    ex = src if isinstance(src, Export) else read_export(src, cfg, where)
    algo = get(algorithm) if algorithm else of_config(ex.cfg)
    if algo is None:
        archs = ex.cfg.get("architectures")
        return [Problem("config", f"{ex.where}: architectures {archs} is none of "
                                  f"{', '.join(a.architecture for a in EXPORTED)}; export the draft with ModelOpt's "
                                  "export_speculative_decoding")]
    return algo.check_export(ex, target=target)
