"""The explicit, ordered stage registry: the one place the pipeline core learns about concrete stages."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from pipeline import codehash

SHARED_SECTIONS: tuple[str, ...] = ("run", "hardware", "vllm")   # config sections no stage owns (pipeline/config.py)
# Order is execution order. A stage may only consume stages listed before it.
STAGE_MODULES: tuple[str, ...] = (
    "stages.target",
    "stages.data",
    "stages.train_draft",
    "stages.quantize",
    "stages.validate",
    "stages.tune",
    "stages.build",
    "stages.export",
)


@dataclass(frozen=True)
class StageSpec:
    name: str
    module: ModuleType
    consumes: tuple[str, ...]
    uses: tuple[str, ...]          # shared config sections (e.g. "hardware") that enter the fingerprint
    packages: tuple[str, ...]
    version: str
    code: dict[str, str]           # {file: sha256} of the stage module and the runtime code it reaches (codehash.py)
    required: bool                 # the section must appear in the config file
    check: Callable | None
    report: Callable | None
    fingerprint_extra: Callable | None
    resolved: Callable | None = None   # what the section resolves to on this machine (auto dtypes), fingerprinted
    execution_only_code: tuple[str, ...] = ()   # dotted modules its code fingerprint does not follow (codehash.py)

    @property
    def file(self) -> Path:
        return Path(self.module.__file__).resolve()


@lru_cache(maxsize=1)
def stages() -> tuple[StageSpec, ...]:
    out: list[StageSpec] = []
    seen: set[str] = set()
    reads = codehash.Reads()       # the stages' closures share most files: each is read and hashed once
    for modname in STAGE_MODULES:
        m = importlib.import_module(modname)
        for attr in ("NAME", "CONSUMES", "VERSION", "PACKAGES", "Config", "run"):
            if not hasattr(m, attr):
                raise RuntimeError(f"{modname} does not follow the stage contract: missing {attr}")
        for dep in m.CONSUMES:
            if dep not in seen:
                raise RuntimeError(f"{modname} consumes '{dep}', which is not registered before it")
        seen.add(m.NAME)
        exclude = tuple(sorted(getattr(m, "EXECUTION_ONLY_CODE", {})))
        code = codehash.code_digests(Path(m.__file__).resolve(), reads=reads, exclude=exclude)
        out.append(StageSpec(
            name=m.NAME, module=m, consumes=tuple(m.CONSUMES), uses=tuple(getattr(m, "USES", ())),
            packages=tuple(m.PACKAGES), version=str(m.VERSION), code=code,
            required=bool(getattr(m, "REQUIRED", False)), check=getattr(m, "check", None),
            report=getattr(m, "report", None), fingerprint_extra=getattr(m, "fingerprint_extra", None),
            resolved=getattr(m, "resolved", None), execution_only_code=exclude,
        ))
    return tuple(out)


ROOT_CONFIG = "stages.config"      # the declared root config class, PipelineConfig: one section per stage


@lru_cache(maxsize=1)
def root_config() -> type:
    """stages/config.py's `PipelineConfig`, checked against the registry: the shared sections, then exactly the
    registered stages' sections, in run order, each typed by its stage's `Config` and required only where the stage
    says so (REQUIRED)."""
    root = importlib.import_module(ROOT_CONFIG).PipelineConfig
    fields = root.model_fields
    want = [*SHARED_SECTIONS, *names()]
    if list(fields) != want:
        raise RuntimeError(f"{ROOT_CONFIG}.PipelineConfig declares sections {list(fields)}; the registry needs {want}")
    for st in stages():
        f = fields[st.name]
        if f.annotation is not st.module.Config or f.is_required() != st.required:
            raise RuntimeError(f"{ROOT_CONFIG}.PipelineConfig.{st.name} must be {st.module.__name__}.Config, "
                               f"{'required' if st.required else 'with its defaults'}")
    return root


def names() -> list[str]:
    return [s.name for s in stages()]


def get(name: str) -> StageSpec:
    for s in stages():
        if s.name == name:
            return s
    raise KeyError(name)
