"""One strict config: YAML file + `-o section.field=value` overrides -> validated `PipelineConfig`.

The root model is assembled from the stage registry (each stage owns its section's model) plus the shared
sections `run`, `hardware` and `vllm`; it is generated because pipeline/ learns about stages only through the
registry. Every section is always present (each has full defaults, or is required), so code reads
`cfg.<section>.<field>` directly (`ctx.config.build.eagle3_mode`), never `getattr(cfg, "<section>", None)` with a
fallback; tests build configs from a real config file (tests/support `real_config`), never from partial stand-ins.

Every problem is reported as `dotted.path: message`, the path spelled as the user wrote it (union tags and
validator names stripped), with the file line where it is known.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml
from pydantic import Field, ValidationError, field_validator

from pipeline.errors import ConfigError
from pipeline.sections import Strict


class RunConfig(Strict):
    """How to execute. Never part of a fingerprint: changing it does not invalidate artifacts."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where stages run models; auto = cuda when available; cuda where torch sees none: a config "
                            "error before any stage runs (resolved once, pipeline/device.py)")
    threads: int | None = Field(default=None, ge=1, description="torch intra-op threads; default: all cores")
    log_level: Literal["debug", "info", "warning"] = Field("info", description="console log level (stage logs in <workdir>/logs "
                                                                               "always keep info)")


class HardwareConfig(Strict):
    """The deployment GPU. Enters the fingerprints of the stages that list 'hardware' in USES."""

    gpu: str = Field("h200", description="deployment GPU from the built-in table (pipeline/hardware.py)")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs the target is split across when served")
    profile: Path | None = Field(default=None, description="a measured profile from `specpipe profile`")

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        from pipeline.hardware import GPUS

        key = v.lower()
        if key not in GPUS:
            raise ValueError(f"unknown GPU '{v}'; known: {', '.join(sorted(GPUS))}")
        return key


class VllmConfig(Strict):
    """vLLM as an engine specpipe drives (runtime/vllm/engine.py), in its own environment. Enters the fingerprint of
    the stages that list 'vllm' in USES (validate measures the deployed pair in vLLM when it is enabled)."""

    enabled: Literal["auto", "true", "false"] = Field(
        "auto", description="auto: use vLLM where it is installed, say so plainly where not; true: required; false: off")
    python: str | None = Field(default=None, description="python of the environment that has vllm; default: "
                                                         "$SPECPIPE_VLLM_PYTHON, <repo>/.venv-vllm, `vllm` on PATH")
    kv_cache_gib: float = Field(default=2.0, gt=0, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE, GiB)")
    ready_timeout_s: float = Field(default=600.0, gt=0, description="how long a server start may take")
    on_unavailable: Literal["skip", "fail"] = Field(
        "skip", description="when vLLM is missing or cannot run the pair: skip (recorded, with the reason) or fail")
    tolerance: float = Field(default=0.05, gt=0, lt=1, description="validate's engine-agreement gate: |vLLM AL - "
                                                                  "validate AL| / validate AL at most this")

    try_fp8: bool = Field(default=False, description="on CPU, try the deployed FP8 target in vLLM (0.32 does not "
                                                     "serve specpipe's FP8 targets on CPU; default: run the BF16 target)")

    @field_validator("enabled", mode="before")
    @classmethod
    def _bool_words(cls, v):
        return {True: "true", False: "false"}.get(v, v) if isinstance(v, bool) else v


class PipelineConfig(Protocol):
    """The whole validated config as a stage reads it (`StageContext.config`): the shared sections, typed here, and
    one section per stage (`cfg.<stage>`, an instance of that stage module's `Config`). The class itself is declared
    in stages/config.py (`PipelineConfig`, checked against the registry by `root_model`), above pipeline/ in the
    layers: this protocol is what pipeline/ can name of it."""

    run: RunConfig
    hardware: HardwareConfig
    vllm: VllmConfig

    def __getattr__(self, section: str) -> Any: ...   # a stage's section: stages/config.py declares its type


def root_model():
    """The declared root config class (stages/config.py's PipelineConfig, checked against the registry)."""
    from pipeline.registry import root_config

    return root_config()


# ---------------------------------------------------------------- YAML with line numbers and no duplicates


class _Loader(yaml.SafeLoader):
    pass


class _CLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """libyaml's parser (~15 ms less than the pure-Python one on a config); a file it refuses is read again by `_Loader`,
    whose messages the errors keep."""


def _no_duplicates(loader: _Loader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{key}' (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)
_CLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def _parse(text: str, loader_cls) -> Any:
    loader = loader_cls(text)          # a SafeLoader that also refuses duplicate keys
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _line_map(text: str) -> dict[str, int]:
    """dotted path -> 1-based line of its key in the YAML text."""
    out: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                path = f"{prefix}.{k.value}" if prefix else str(k.value)
                out[path] = k.start_mark.line + 1
                walk(v, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                path = f"{prefix}.{i}"
                out[path] = v.start_mark.line + 1
                walk(v, path)

    with contextlib.suppress(yaml.YAMLError):
        walk(yaml.compose(text, Loader=yaml.SafeLoader), "")
    return out


class _Lines(Mapping):
    """`_line_map(text)`, composed on first use: only an error message reads it (a second YAML pass costs ~5 ms)."""

    def __init__(self, text: str) -> None:
        self._text, self._map = text, None

    def _lines(self) -> dict[str, int]:
        if self._map is None:
            self._map = _line_map(self._text)
        return self._map

    def __getitem__(self, key: str) -> int:
        return self._lines()[key]

    def __iter__(self):
        return iter(self._lines())

    def __len__(self) -> int:
        return len(self._lines())


def read_yaml(path: Path) -> tuple[dict, Mapping[str, int]]:
    path = Path(path)
    if not path.exists():
        raise ConfigError([("", f"{path}: config file not found")])
    if path.is_dir():
        raise ConfigError([("", f"{path}: is a directory, expected a YAML config file")])
    text = path.read_text()
    try:
        try:
            data = _parse(text, _CLoader)
        except yaml.YAMLError:
            data = _parse(text, _Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError([("", f"{where}: YAML syntax error: {e.problem or e.context}")]) from None
    except yaml.YAMLError as e:
        raise ConfigError([("", f"{path}: YAML error: {e}")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"{path}: the top level must be a mapping of sections, found {type(data).__name__}")])
    return data, _Lines(text)


# ---------------------------------------------------------------- overrides


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError([(f"-o {item}", "expected section.field=value")])
    key, _, raw = item.partition("=")
    parts = key.strip().split(".")
    if not key.strip() or any(not p for p in parts):
        raise ConfigError([(f"-o {item}", "expected section.field=value with a dotted path")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> set[str]:
    applied: set[str] = set()
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p) if isinstance(node, dict) else None
            if nxt is None:
                nxt = {}
                node[p] = nxt
            elif not isinstance(nxt, dict):
                raise ConfigError([(".".join(parts[: i + 1]), f"is a {type(nxt).__name__}, cannot set '{parts[i + 1]}' in it (-o "
                                                              f"{item})")])
            node = nxt
        node[parts[-1]] = value
        applied.add(".".join(parts))
    return applied


# ---------------------------------------------------------------- error formatting


def _user_path(loc: tuple, raw: Any) -> list[str]:
    """Map a pydantic error location onto the keys the user wrote, dropping union tags and validator names."""
    out: list[str] = []
    node = raw
    for el in loc:
        if (isinstance(node, dict) and el in node) or (isinstance(node, list) and isinstance(el, int) and 0 <= el < len(node)):
            out.append(str(el))
            node = node[el]
        elif isinstance(node, dict) and isinstance(el, str) and not any(c in el for c in "[]()") and el not in _tag_values(node):
            # a missing required field or an unknown key below this node
            out.append(el)
            node = None
        # else: a discriminated-union tag or a validator name: not something the user wrote
    return out


def _tag_values(node: dict) -> set:
    return {v for v in node.values() if isinstance(v, str)}


def _known_fields(model, parts: list[str], raw: Any) -> list[str] | None:
    """Field names of the model at `parts` (best effort, following discriminated unions through raw data)."""

    from pydantic import BaseModel

    node = raw
    cur = model
    for p in parts:
        if cur is None or not (isinstance(cur, type) and issubclass(cur, BaseModel)):
            return None
        f = cur.model_fields.get(p)
        if f is None:
            return None
        node = node.get(p) if isinstance(node, dict) else None
        cur = _resolve(f.annotation, node)
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        return list(cur.model_fields)
    return None


def _resolve(ann, node):
    import typing

    from pydantic import BaseModel

    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _resolve(typing.get_args(ann)[0], node)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for a in typing.get_args(ann):
            r = _resolve(a, node)
            if isinstance(r, type) and issubclass(r, BaseModel):
                tags = {getattr(fi, "default", None) for fi in r.model_fields.values()}
                if isinstance(node, dict) and tags & set(v for v in node.values() if isinstance(v, str)):
                    return r
        for a in typing.get_args(ann):
            r = _resolve(a, node)
            if isinstance(r, type) and issubclass(r, BaseModel):
                return r
        return None
    return ann


def _format(err: ValidationError, raw: dict, lines: dict[str, int], source: str | None, overridden: set[str]) -> ConfigError:
    problems: list[tuple[str, str]] = []
    model = root_model()
    for e in err.errors(include_url=False):
        parts = _user_path(tuple(e["loc"]), raw)
        path = ".".join(parts)
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if e["type"] == "extra_forbidden":
            known = _known_fields(model, parts[:-1], raw)
            msg = "unknown field" + (f"; known fields here: {', '.join(known)}" if known else "")
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            disc = str(e.get("ctx", {}).get("discriminator", "")).strip("'")
            if disc:
                parts = [*parts, disc]
                path = ".".join(parts)
            if e["type"] == "union_tag_not_found":
                msg = "required field is missing (it selects the variant)"
            else:
                msg = f"value '{e['ctx'].get('tag')}' is not one of: {e['ctx'].get('expected_tags', '').replace(chr(39), '')}"
        elif e["type"] in ("literal_error", "enum"):
            msg = msg.replace("Input tag", "value").replace("Input should be", "expected")
        if path in overridden or any(path.startswith(o + ".") for o in overridden):
            msg += " (from -o)"
        elif path in lines and source:
            msg += f" ({source}, line {lines[path]})"
        problems.append((path, msg))
    return ConfigError(problems, source)


# ---------------------------------------------------------------- entry point


def load_config(path: str | Path, overrides: list[str] | None = None):
    """Read, override, validate. Raises ConfigError with every problem found."""
    data, lines = read_yaml(Path(path))
    overridden = apply_overrides(data, list(overrides or []))
    return validate(data, source=str(path), lines=lines, overridden=overridden)


def validate(data: dict, source: str | None = None, lines: dict[str, int] | None = None, overridden: set[str] | None = None):
    from pipeline.registry import stages

    model = root_model()
    try:
        cfg = model.model_validate(data)
    except ValidationError as e:
        raise _format(e, data, lines or {}, source, overridden or set()) from None
    # Cross-section checks that each stage declares (e.g. a mask token that must exist in the target vocab).
    problems: list[tuple[str, str]] = []
    enabled = {st.name for st in stages() if getattr(cfg, st.name).enabled}
    for st in stages():
        if st.name not in enabled:
            continue
        for dep in st.consumes:
            if dep not in enabled:
                problems.append((f"{dep}.enabled", f"stage '{st.name}' consumes '{dep}', which is disabled; enable it or disable "
                                                   f"'{st.name}'"))
        if st.check is not None:
            problems.extend(st.check(cfg))
    if problems:
        raise ConfigError([(p, m + (f" ({source}, line "
                                    f"{lines[p]})" if lines and p in lines and source else "")) for p, m in problems], source)
    return cfg


def section_dict(cfg, name: str) -> dict:
    return getattr(cfg, name).model_dump(mode="json")
