"""The one compatibility table: container image -> TensorRT-LLM version -> what that version can deploy.

Used by `stages/build.py` (which fields to write and what they mean), `stages/export.py` (which container
serves the production repository) and the Dockerfiles. Facts from `../shared/reference/trtllm-triton.md`
§1, §2, §6 and the field lists in `runtime/schemas/`.

Two things change between the TensorRT-LLM lines specpipe targets, and both silently change behaviour if a
generator gets them wrong:
- `draft_len_schedule`: 1.2 keys are LOWER bounds ({1: 4, 4: 2, 8: 0}: batch >= 4 uses 2; key 1 must equal
  max_draft_len); 1.3 keys are UPPER bounds ({3: 4, 7: 2}: batch 1-3 uses 4, 4-7 uses 2, above 7 none; the
  smallest key's value must equal max_draft_len), and 1.3 rejects `max_concurrency` together with a schedule.
- the acceptance guard: 1.2 `acceptance_window` + `acceptance_length_threshold` (a length, >= 0, over completed
  requests); 1.3 `acceptance_rate_window_size` + `acceptance_rate_threshold` (a rate in [0, 1], over iterations).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Semantics = Literal["lower_bound", "upper_bound"]


@dataclass(frozen=True)
class Release:
    line: str                      # "1.2" / "1.3"
    schema: str                    # runtime/schemas/<schema>.json
    algorithms: frozenset[str]     # specpipe draft algorithms this version's PyTorch backend serves
    decoding_types: dict           # specpipe algorithm -> speculative_config.decoding_type
    schedule_semantics: Semantics
    schedule_with_max_concurrency: bool   # both may be given together
    acceptance_window_key: str
    acceptance_threshold_key: str
    acceptance_threshold_kind: Literal["length", "rate"]
    eagle3_two_model: bool         # eagle3_one_model: false is honoured (1.3 resets it to true)
    emits_eagle3_one_model: bool   # the field exists in this line's docs


RELEASES: dict[str, Release] = {
    "1.2": Release(
        line="1.2", schema="trtllm-1.2", algorithms=frozenset({"eagle3"}), decoding_types={"eagle3": "Eagle3"},
        schedule_semantics="lower_bound", schedule_with_max_concurrency=True,
        acceptance_window_key="acceptance_window", acceptance_threshold_key="acceptance_length_threshold",
        acceptance_threshold_kind="length", eagle3_two_model=True, emits_eagle3_one_model=True),
    "1.3": Release(
        line="1.3", schema="trtllm-1.3", algorithms=frozenset({"eagle3", "dflash"}),
        decoding_types={"eagle3": "Eagle3", "dflash": "DFlash"},
        schedule_semantics="upper_bound", schedule_with_max_concurrency=False,
        acceptance_window_key="acceptance_rate_window_size", acceptance_threshold_key="acceptance_rate_threshold",
        acceptance_threshold_kind="rate", eagle3_two_model=False, emits_eagle3_one_model=False),
}


@dataclass(frozen=True)
class Container:
    image: str
    trtllm_version: str
    kind: Literal["triton", "trtllm"]   # Triton with the TensorRT-LLM backend, or TensorRT-LLM's own release image


# §6 of the reference. Triton images pin one TensorRT-LLM version each; the 1.1 line is listed for lookups but
# specpipe has no field lists for it, so `build` refuses it.
CONTAINERS: tuple[Container, ...] = (
    *(Container(f"nvcr.io/nvidia/tritonserver:{t}-trtllm-python-py3", "1.2.1", "triton")
      for t in ("26.04", "26.05", "26.06", "26.07")),
    Container("nvcr.io/nvidia/tritonserver:26.03-trtllm-python-py3", "1.2.0", "triton"),
    *(Container(f"nvcr.io/nvidia/tritonserver:{t}-trtllm-python-py3", "1.1.0", "triton")
      for t in ("25.12", "26.01", "26.02")),
    Container("nvcr.io/nvidia/tensorrt-llm/release:1.2.1", "1.2.1", "trtllm"),
    Container("nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc27", "1.3.0rc27", "trtllm"),
)

# The Triton image specpipe ships its production repository for (newest in the table), and the version it pins.
SHIPPED_TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
DEFAULT_TRTLLM_VERSION = "1.2.1"
# The 1.3 release candidate whose documentation the 1.3 field lists were cross-checked with.
REFERENCE_1_3 = "1.3.0rc27"

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(rc\d+)?$")


def line_of(version: str) -> str:
    m = _VERSION.match(version.strip())
    if not m:
        raise ValueError(f"'{version}' is not a TensorRT-LLM version (expected e.g. 1.2.1 or 1.3.0rc27)")
    return f"{m.group(1)}.{m.group(2)}"


def normalize_version(v) -> str:
    """A version as configs write it: YAML reads `1.3` as a number, and a bare line means its reference release."""
    v = str(v).strip()
    if re.fullmatch(r"\d+\.\d+", v):
        v = {"1.2": DEFAULT_TRTLLM_VERSION, "1.3": REFERENCE_1_3}.get(v, v + ".0")
    release(v)
    return v


def release(version: str) -> Release:
    """The Release for a version string; ValueError (with the supported versions) when specpipe has no field lists."""
    line = line_of(version)
    if line not in RELEASES:
        raise ValueError(f"TensorRT-LLM {version} is not supported: specpipe has field lists for the 1.2 and 1.3 "
                         f"lines only (e.g. {DEFAULT_TRTLLM_VERSION}, {REFERENCE_1_3})")
    return RELEASES[line]


def containers_for(version: str) -> list[Container]:
    """Images that ship exactly this version (Triton images first)."""
    return sorted((c for c in CONTAINERS if c.trtllm_version == version), key=lambda c: (c.kind != "triton", c.image))


def triton_image_for(version: str) -> str | None:
    """The newest Triton image pinning this version, or None (no Triton image ships it yet)."""
    imgs = [c.image for c in CONTAINERS if c.trtllm_version == version and c.kind == "triton"]
    return max(imgs) if imgs else None


def serving_image_for(version: str) -> str:
    """Where to run this version: a Triton image if one pins it, else TensorRT-LLM's own release image."""
    return triton_image_for(version) or f"nvcr.io/nvidia/tensorrt-llm/release:{version}"


def supported_versions_for(algorithm: str) -> list[str]:
    return sorted({c.trtllm_version for c in CONTAINERS if _supports(c.trtllm_version, algorithm)})


def _supports(version: str, algorithm: str) -> bool:
    try:
        return algorithm in release(version).algorithms
    except ValueError:
        return False


def algorithm_problem(version: str, algorithm: str) -> str | None:
    """Why `version` cannot deploy `algorithm` (naming a version/container that can), or None."""
    rel = release(version)
    if algorithm in rel.algorithms:
        return None
    if algorithm == "dflash":
        return (f"DFlash needs TensorRT-LLM 1.3 or newer (DFlashDecodingConfig is absent from {version}; "
                f"no Triton image ships 1.3 yet): set build.trtllm_version: {REFERENCE_1_3} and serve with "
                f"trtllm-serve in nvcr.io/nvidia/tensorrt-llm/release:{REFERENCE_1_3}, or build a custom Triton image "
                f"on it; {SHIPPED_TRITON_IMAGE} pins {DEFAULT_TRTLLM_VERSION}")
    return f"TensorRT-LLM {version} has no decoding type for '{algorithm}'"
