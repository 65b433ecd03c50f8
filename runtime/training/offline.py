"""Offline mode: the target's hidden states for every training sample dumped into `<scratch>/hidden/` (one file per
sample in ModelOpt's offline format, written atomically, so an interrupted dump resumes where it stopped) after a
disk-space preflight, and ModelOpt's dataset and collator over those records."""
from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from runtime.training.dist import Process, barrier, rank_world
from runtime.training.fsdp import fsdp_active, load_target_skeleton, shard_target_layers
from runtime.training.job import JobError, capture_layer_ids, torch_dtype
from runtime.training.model import load_full_target
from runtime.training.samples import Data

HIDDEN = "hidden"


def estimate_dump_bytes(n_samples: int, tokens_per_sample: float, n_capture_layers: int, hidden: int, dtype_bytes: int) -> int:
    """Hidden states of the final layer plus each captured layer, per token, plus ids and mask (int64)."""
    return int(n_samples * tokens_per_sample * ((1 + n_capture_layers) * hidden * dtype_bytes + 16))


def dump_preflight(need_bytes: int, where: Path, max_bytes: int | None = None) -> dict:
    """Refuse an offline dump that the disk (or the configured budget) cannot hold. Returns the numbers."""
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    gib = 2**30
    if max_bytes is not None and need_bytes > max_bytes:
        raise JobError(f"offline hidden-state dump needs about {need_bytes / gib:.2f} GiB, over the budget "
                       f"train_draft.offline.max_dump_gb={max_bytes / gib:.4g}; raise the budget, train fewer samples "
                       "or a shorter seq_len, or use train_draft.mode: online")
    if need_bytes * 1.05 > free:
        raise JobError(f"offline hidden-state dump needs about {need_bytes / gib:.2f} GiB but {where} has only "
                       f"{free / gib:.2f} GiB free; free space there, point the workdir at a larger disk, "
                       "or use train_draft.mode: online (no dump)")
    return {"dump_estimate_bytes": need_bytes, "disk_free_bytes": free}


def dump_hidden_states(job: dict, samples, device, emit: Callable[[dict], None]) -> list[Path]:
    """Write `<scratch>/hidden/<i>.pt` for each sample (this rank's share), skipping files that exist.
    Keys follow ModelOpt's offline format: input_ids, hidden_states (last layer), aux_hidden_states
    (captured layers concatenated), loss_mask."""
    import torch

    rank, world = rank_world()
    out = Path(job["scratch_dir"]) / HIDDEN
    out.mkdir(parents=True, exist_ok=True)
    files = [out / f"{i:07d}.pt" for i in range(len(samples))]
    todo = [i for i in range(rank, len(samples), world) if not files[i].exists()]
    done_before = len(samples) - sum(1 for f in files if not f.exists())
    fsdp = fsdp_active(job)
    rounds = len(todo)
    if fsdp:   # every process runs the same number of forwards: each one all-gathers every layer
        import torch.distributed as dist

        n = torch.tensor([rounds])
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        rounds = int(n)
    if rounds:
        dtype = torch_dtype(job["train_dtype"])
        if fsdp:
            model = load_target_skeleton(job, device, dtype)
            job.setdefault("_fsdp", shard_target_layers(model, device, job["target_dir"]))
        else:
            model = load_full_target(job, device, dtype)
        model.eval()
        layers = capture_layer_ids(job)
        seq = job["train"]["seq_len"]
        emit({"event": "dump_start", "total": len(samples), "done": done_before})
        with torch.no_grad():
            for j in range(rounds):
                if j >= len(todo):   # this process is done: keep the others' collectives company
                    model(input_ids=torch.tensor([samples[0][0][:8]], device=device))
                    continue
                i = todo[j]
                ids, mask = samples[i]
                x = torch.tensor([ids[:seq]], device=device)
                hs = model(input_ids=x, output_hidden_states=True).hidden_states
                rec = {"input_ids": x[0].cpu(), "hidden_states": hs[-1][0].cpu(),
                       "aux_hidden_states": torch.cat([hs[lid + 1][0].cpu() for lid in layers], dim=-1),
                       "loss_mask": torch.tensor(mask[:seq], dtype=torch.long)}
                tmp = files[i].with_suffix(f".tmp{rank}")
                torch.save(rec, tmp)
                os.replace(tmp, files[i])
                emit({"event": "dump", "n": 1})
        del model
    barrier()
    return files


def dump_offline(job: dict, data: Data, scratch: Path, proc: Process) -> None:
    """Offline mode: the disk preflight (rank 0, on what is not dumped yet), the hidden-state dump, and ModelOpt's
    dataset and collator over the records, set on `data` with the dump's numbers."""
    import torch

    t, samples = job["train"], data.samples
    tps = sum(min(len(a), t["seq_len"]) for a, _ in samples) / len(samples)
    itemsize = torch.finfo(torch_dtype(job["train_dtype"])).bits // 8
    need = estimate_dump_bytes(len(samples), tps, len(capture_layer_ids(job)), job["target"]["hidden_size"], itemsize)
    existing = sum(f.stat().st_size for f in (scratch / HIDDEN).glob("*.pt")) if (scratch / HIDDEN).exists() else 0
    if proc.rank == 0:
        max_b = int(job["max_dump_gb"] * 2**30) if job.get("max_dump_gb") else None
        data.dump_info = dump_preflight(max(0, need - existing), scratch, max_b)
        data.dump_info["dump_estimate_bytes"] = need
    barrier()
    t0 = time.monotonic()
    files = dump_hidden_states(job, samples, proc.device, proc.emit0)
    data.dump_info["dump_seconds"] = round(time.monotonic() - t0, 2)
    data.dump_info["dump_bytes"] = sum(f.stat().st_size for f in files)
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    data.dataset = OfflineSupervisedDataset([str(f) for f in files], answer_only_loss=True)
    data.collator = EagleOfflineDataCollator(t["seq_len"])

