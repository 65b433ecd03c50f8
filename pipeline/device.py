"""`run.device`, resolved once: the runner calls `resolve_device(cfg.run)` before the first stage runs and puts the
result on every `StageContext` (`ctx.device`); `specpipe profile` calls it too. Nothing else reads `run.device`.

auto = cuda when torch sees a CUDA device, else cpu; cuda on a machine without one is a config error (exit 2)
before any stage runs. `run.device` is not part of any fingerprint: the same artifact is expected on either.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import ConfigError

CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ResolvedDevice:
    requested: str   # run.device as configured: auto | cpu | cuda
    type: str        # what the stages run on: cpu | cuda

    @property
    def torch(self):
        """As a `torch.device`."""
        import torch

        return torch.device(self.type)

    def __str__(self) -> str:
        return self.type


def resolve_device(run_cfg) -> ResolvedDevice:
    """The `run` section's device with auto resolved; ConfigError naming `run.device` for a value outside
    auto/cpu/cuda or cuda where torch sees no CUDA device. cpu resolves without importing torch."""
    want = run_cfg.device
    if want not in CHOICES:
        raise ConfigError([("run.device", f"{want!r}: expected one of {', '.join(CHOICES)}")])
    if want == "cpu":
        return ResolvedDevice(want, "cpu")
    import torch

    has_cuda = torch.cuda.is_available()
    if want == "cuda" and not has_cuda:
        raise ConfigError([("run.device", "cuda, but torch sees no CUDA device here; set run.device: auto or cpu")])
    return ResolvedDevice(want, "cuda" if has_cuda else "cpu")
