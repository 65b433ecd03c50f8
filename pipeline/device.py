"""`run.device`, resolved once: the runner calls `resolve_device(cfg.run)` before the first stage runs and puts the
result on every `StageContext` (`ctx.device`); `specpipe profile` calls it too. Nothing else reads `run.device`.

auto = cuda when torch sees a CUDA device, else cpu; cuda on a machine without one is a config error (exit 2)
before any stage runs. `run.device` is not part of any fingerprint; what a stage resolves on the device it runs on
(train_draft's auto dtypes) is, through the stage's `resolved` hook, which asks `plan_device_type`.
"""
from __future__ import annotations

import os
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


# device nodes without which torch sees no GPU (NVIDIA's driver; WSL2's; ROCm's)
GPU_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def plan_device_type(run_cfg) -> str:
    """The device type the stages will run on, as a plan needs it for fingerprints: cpu or cuda as configured, and
    auto without importing torch on a machine with no GPU device node (0.3 s of a no-op rebuild otherwise go to
    importing torch); elsewhere as `resolve_device` decides (a bad value: decided there, when a stage runs)."""
    want = run_cfg.device
    if want in ("cpu", "cuda"):
        return want
    if want == "auto" and not any(os.path.exists(p) for p in GPU_NODES):
        return "cpu"
    try:
        return resolve_device(run_cfg).type
    except ConfigError:
        return "cpu"
