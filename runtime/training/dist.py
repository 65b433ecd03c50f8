"""This process of the training group: joining torchrun's process group, its rank, device and threads, barriers,
and where it reports progress (rank 0 only)."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any


def dist_group():
    """`torch.distributed` when a process group is initialized, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_world() -> tuple[int, int]:
    d = dist_group()
    return (d.get_rank(), d.get_world_size()) if d else (0, 1)


def barrier() -> None:
    if d := dist_group():
        d.barrier()


@dataclasses.dataclass
class Process:
    """This process of the training group (or the only one) and where it reports progress."""

    rank: int
    world: int
    local_rank: int
    device: Any
    emit_fn: Callable[[dict], None]

    def emit0(self, ev: dict) -> None:   # only rank 0 reports progress
        if self.rank == 0:
            self.emit_fn(ev)


def start_process(job: dict, emit: Callable[[dict], None] | None) -> Process:
    """Join the torchrun group (when WORLD_SIZE > 1), pick this process's device and thread count."""
    import torch

    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    device_kind = job["device"]
    if world_env > 1 and dist_group() is None:
        import torch.distributed as dist

        dist.init_process_group(backend="nccl" if device_kind == "cuda" else "gloo")
    rank, world = rank_world()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if device_kind == "cuda" else "cpu")
    if device_kind == "cuda":
        torch.cuda.set_device(device)
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    return Process(rank, world, local_rank, device, emit or (lambda ev: None))
