"""RoPE settings in an exported HF `config.json`, written so that every TensorRT-LLM line specpipe targets reads them.

transformers 5 writes RoPE as `rope_parameters` ({"rope_type", "rope_theta", scaling fields}) and drops the
top-level `rope_theta`; ModelOpt's EAGLE-3 export writes `rope_theta` plus a `rope_scaling` dict that may be
{"rope_type": "default", "rope_theta": ...}. The readers differ (runtime/trtllm/compat.py, SOURCES "transformers_1_2",
"rope_1_2"):

- TensorRT-LLM 1.2 pins transformers 4.57.1 and reads `config.rope_theta` (default 10000 when absent: SmolLM2's
  1e5 would be lost) and `config.rope_scaling`, whose type goes through `RotaryScalingType.from_string`, which
  has no "default" (a default-type `rope_scaling` raises at load);
- TensorRT-LLM 1.3 runs transformers 5, which builds `rope_parameters` from either form.

`normalize` therefore writes all three, consistently: `rope_theta`; `rope_scaling` = null for unscaled RoPE,
else the scaling fields with `rope_type` (no theta inside, the transformers 4 form); `rope_parameters` = the
transformers 5 form. `problems` is what `build` checks for the targeted version.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

_PER_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "linear_attention"}


@dataclass(frozen=True)
class Rope:
    theta: float
    rope_type: str = "default"                           # "default" = unscaled
    scaling: dict = field(default_factory=dict)          # factor, original_max_position_embeddings, ... (no theta, no type)

    def legacy_scaling(self) -> dict | None:
        return None if self.rope_type == "default" else {"rope_type": self.rope_type, **self.scaling}

    def parameters(self) -> dict:
        return {"rope_type": self.rope_type, "rope_theta": self.theta, **self.scaling}


class RopeError(ValueError):
    pass


def _type(d: dict | None) -> str | None:
    if not isinstance(d, dict):
        return None
    return d.get("rope_type") or d.get("type")


def read(cfg: dict) -> Rope | None:
    """The RoPE settings a config.json states, whatever form it uses; None where it states no theta at all.
    Conflicting values between the forms are a RopeError naming them."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and set(params) <= _PER_LAYER_TYPES:
        raise RopeError("per-layer-type rope_parameters (" + ", ".join(sorted(params)) + ") are not normalized")
    legacy = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else None
    thetas = {name: float(v) for name, v in (("rope_parameters.rope_theta", (params or {}).get("rope_theta")),
                                             ("rope_theta", cfg.get("rope_theta")),
                                             ("rope_scaling.rope_theta", (legacy or {}).get("rope_theta")))
              if v is not None}
    if len(set(thetas.values())) > 1:
        raise RopeError("config.json states different RoPE thetas: "
                        + ", ".join(f"{k} = {v:g}" for k, v in thetas.items()))
    if not thetas:
        return None
    theta = next(iter(thetas.values()))
    # scaling: rope_parameters wins (transformers 5 wrote it from the model); else the legacy dict
    kinds = {n: t for n, t in (("rope_parameters", _type(params)), ("rope_scaling", _type(legacy))) if t}
    if len(set(kinds.values())) > 1:
        raise RopeError("config.json states different RoPE scalings: "
                        + ", ".join(f"{k} type {v}" for k, v in kinds.items()))
    scaled = {n: t for n, t in kinds.items() if t != "default"}
    src = params if scaled.get("rope_parameters") else (legacy if scaled.get("rope_scaling") else None)
    if src is None:
        return Rope(theta)
    extra = {k: v for k, v in src.items() if k not in ("rope_type", "type", "rope_theta")}
    return Rope(theta, src.get("rope_type") or src.get("type"), extra)


def normalize(cfg: dict) -> dict:
    """`cfg` with `rope_theta`, `rope_scaling` and `rope_parameters` all stating the same RoPE (see module doc);
    unchanged when it states no theta."""
    rope = read(cfg)
    if rope is None:
        return dict(cfg)
    out = dict(cfg)
    out["rope_theta"] = rope.theta
    out["rope_scaling"] = rope.legacy_scaling()
    out["rope_parameters"] = rope.parameters()
    return out


def normalize_file(path: Path) -> Rope | None:
    """Normalize a config.json in place (keeping its other keys and their order); the RoPE it states."""
    path = Path(path)
    cfg = json.loads(path.read_text())
    new = normalize(cfg)
    if new != cfg:
        path.write_text(json.dumps(new, indent=2))
    return read(new)


def problems(cfg: dict, form: str, *, expected_theta: float | None = None) -> list[str]:
    """Why TensorRT-LLM reading this config through `form` ("legacy": transformers 4.57, "rope_parameters":
    transformers 5) would not get the intended RoPE; empty when it would."""
    try:
        rope = read(cfg)
    except RopeError as e:
        return [str(e)]
    if rope is None:
        return ["config.json states no RoPE theta: TensorRT-LLM would use 10000"]
    out = []
    if form == "legacy":
        if cfg.get("rope_theta") is None:
            out.append(f"no top-level rope_theta (transformers 4.57 would use 10000, not {rope.theta:g}); "
                       "only rope_parameters states it")
        if _type(cfg.get("rope_scaling")) == "default":
            out.append("rope_scaling has rope_type 'default', which TensorRT-LLM 1.2's RotaryScalingType rejects; "
                       "unscaled RoPE must be rope_scaling: null")
        elif rope.rope_type != "default" and _type(cfg.get("rope_scaling")) != rope.rope_type:
            out.append(f"rope_scaling does not state the {rope.rope_type} scaling that rope_parameters has")
    elif cfg.get("rope_theta") is None and (cfg.get("rope_parameters") or {}).get("rope_theta") is None:
        out.append("neither rope_parameters.rope_theta nor rope_theta is set")
    if expected_theta is not None and abs(rope.theta - float(expected_theta)) > 1e-6 * max(1.0, abs(expected_theta)):
        out.append(f"RoPE theta {rope.theta:g} differs from the model's {float(expected_theta):g}")
    return out


def theta_of(config_path: Path) -> float | None:
    """The RoPE theta a model's config.json states (None when unreadable or absent)."""
    try:
        rope = read(json.loads(Path(config_path).read_text()))
    except (OSError, ValueError):
        return None
    return rope.theta if rope else None
