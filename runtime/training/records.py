"""What a training run records: the worker's `result.json` (the run's figures, the curve, the acceptance estimate),
and from it the stage's `draft.json` (what the draft is and how it was trained), `curve.json` (the training curve
and the estimate) and metrics."""
from __future__ import annotations

from pathlib import Path

from runtime.algorithms.registry import get as get_algorithm
from runtime.records import DraftInfo
from runtime.training.budget import budget_metrics
from runtime.training.export import tensor_names
from runtime.training.job import capture_layer_ids


def result_record(job: dict, curve: list, step_times: list, step0: int, world: int, acc, eval_s: float, dump_info: dict) -> dict:
    """result.json: the run's figures, the curve and the acceptance estimate."""
    ts = step_times[1:] or step_times   # the first step pays one-time setup
    result = {
        "steps": job["train"]["steps"], "resumed_from_step": step0, "world_size": world,
        "final_loss": curve[-1]["loss"] if curve else None,
        "final_accuracy": curve[-1]["accuracy"] if curve else None,
        "step_ms_mean": round(1000 * sum(ts) / max(1, len(ts)), 2),
        "train_seconds": round(sum(step_times), 2), "eval_seconds": round(eval_s, 2),
        "curve": curve, "acceptance": acc, "d2t": job.get("d2t_stats"), **dump_info,
    }
    if job["train"].get("budget"):   # train_draft.max_minutes: the steps resolved on this machine (runtime.training.budget)
        result["budget"] = job["train"]["budget"]
    if job.get("_fsdp"):
        result["fsdp"] = job["_fsdp"]
    return result


def draft_record(job: dict, cfg: dict, draft_dir: Path, acc: dict, result: dict) -> DraftInfo:
    """draft.json's record: the exported draft (`cfg` its config.json), the acceptance estimate `acc`, which step was
    exported and why, and the reduced vocabulary's statistics (`result`: the worker's result.json)."""
    a = job["algorithm"]
    ev = result.get("evals") or {}
    return DraftInfo(
        algorithm=a["name"], num_layers=a["draft_layers"], capture_layers=capture_layer_ids(job),
        capture_field=get_algorithm(a["name"]).capture_field,
        vocab_size=job["target"]["vocab_size"], draft_vocab_size=cfg.get("draft_vocab_size", job["target"]["vocab_size"]),
        has_d2t="d2t" in tensor_names(draft_dir), block_size=a.get("block_size"), mask_token_id=a.get("mask_token_id"),
        trained_draft_len=a["trained_draft_len"], max_position_embeddings=cfg.get("max_position_embeddings"),
        objective=a.get("objective"),
        rope_scaling=cfg.get("rope_scaling"), serving_context=job["serving_context"], mode=job["mode"],
        acceptance_length=acc.get("acceptance_length"), eval_draft_len=acc.get("draft_len"),
        acceptance_estimator=acc.get("estimator"),
        exported_step=ev.get("exported_step", result.get("steps", job["train"]["steps"])),
        export_reason=ev.get("export_reason"), budget=result.get("budget"), draft_vocab=result.get("d2t"))


def curve_record(job: dict, result: dict, acc: dict) -> dict:
    """curve.json: the worker's curve points and the acceptance estimate."""
    a = job["algorithm"]
    return {"algorithm": a["name"], "steps": result.get("steps", job["train"]["steps"]), "log_every": job["train"]["log_every"],
            "accuracy_positions": 1 if get_algorithm(a["name"]).drafts_block else a["ttt_steps"],
            "accuracy_note": "EAGLE-3: one accuracy per training-time-test step (draft position); DFlash: ModelOpt "
                             "reports the mean over the block's drafted positions",
            "points": result["curve"], "acceptance": acc,
            "acceptance_points": (result.get("evals") or {}).get("points", []),
            "exported_step": (result.get("evals") or {}).get("exported_step"),
            "early_stop": (result.get("evals") or {}).get("early_stop")}


def stage_metrics(job: dict, result: dict, acc: dict, n_checks: int) -> dict:
    """The stage's metrics: the run's figures, the acceptance estimate, the dump's and FSDP's numbers when there."""
    return {
        "algorithm": job["algorithm"]["name"],
        "mode": job["mode"],
        "steps": result.get("steps", job["train"]["steps"]),   # under a budget: the steps done (torchrun's workers resolve)
        **budget_metrics(result),
        "world_size": result["world_size"],
        "resumed_from_step": result["resumed_from_step"],
        "final_loss": result["final_loss"],
        "final_accuracy": result["final_accuracy"],
        "step_ms_mean": result["step_ms_mean"],
        "train_seconds": result["train_seconds"],
        "acceptance_length": acc.get("acceptance_length"),
        "eval_draft_len": acc.get("draft_len"),
        "acceptance_estimator": acc.get("estimator"),
        "eval_seconds": result.get("eval_seconds"),
        "acceptance_by_domain": {d: v["acceptance_length"] for d, v in acc.get("domains", {}).items()},
        "export_checks_passed": n_checks,
        "exported_step": (result.get("evals") or {}).get("exported_step"),
        "eval_points": len((result.get("evals") or {}).get("points", [])),
        "early_stop_step": ((result.get("evals") or {}).get("early_stop") or {}).get("step"),
        **{f"draft_vocab_{k}": v for k, v in (result.get("d2t") or {}).items() if k in ("token_coverage", "heldout_oov_rate")},
        **{k: result[k] for k in ("dump_bytes", "dump_estimate_bytes", "dump_seconds") if k in result},
        **(
            {
                "fsdp_processes": result["fsdp"]["processes"],
                "target_layer_bytes": result["fsdp"]["target_layer_bytes"],
                "target_layer_bytes_per_process": result["fsdp"]["target_layer_bytes_per_process"],
            }
            if result.get("fsdp")
            else {}
        ),
    }


def eval_report(curve: dict, draft: dict) -> tuple[list, list, list]:
    """The train_draft report's part on the held-out eval points: (their rows, header, summary rows: the exported
    step and why, the early stop, the reduced draft vocabulary)."""
    pts = curve.get("acceptance_points") or []
    doms = sorted(pts[0]["al"]) if pts else []
    rows = [[p["step"], _cpu_min(p), *[p["al"].get(d) for d in doms], p["mean"],
             "exported" if p["step"] == curve.get("exported_step") else ""] for p in pts]
    summary = [["exported step", draft.get("exported_step")], ["why", draft.get("export_reason")],
               ["early stop", (curve.get("early_stop") or {}).get("reason", "no")]]
    dv = draft.get("draft_vocab") or {}
    if dv:
        summary += [["draft vocabulary", dv.get("draft_vocab_size")],
                    ["trained-on tokens covered by it", dv.get("token_coverage")],
                    ["held-out assistant tokens outside it", dv.get("heldout_oov_rate")]]
    return rows, ["eval point (step)", "training CPU-min", *[f"AL {d}" for d in doms], "mean AL", ""], summary


def _cpu_min(point: dict) -> float | None:
    """The training CPU-minutes up to an eval point (its `train_cpu_s`: the training process's CPU outside the eval
    points, all threads); None for points recorded before it was kept."""
    return round(point["train_cpu_s"] / 60, 1) if "train_cpu_s" in point else None
