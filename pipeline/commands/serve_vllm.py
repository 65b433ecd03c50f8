"""`specpipe serve --engine vllm`: the run's exported pair (target + artifacts/export/speculators, the tuned draft
length) served OpenAI-compatible by vLLM on 127.0.0.1 through runtime/vllm/engine.VllmServer."""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts import export as export_artifact
from pipeline.errors import StageError, UsageError


@dataclass
class VllmPair:
    workdir: Path
    target: Path
    target_kind: str                  # "bf16" (artifacts/target/model) or "fp8" (the deployment's FP8 target)
    draft: Path | None
    speculative_config: dict | None   # as the export wrote it, the draft path made this run's
    max_model_len: int | None
    kv_cache_dtype: str | None
    why: str                          # which target and why (printed)


def _export_doc(wd: Path) -> dict:
    ex = wd / "artifacts" / "export" / "export.json"
    if not (wd / "artifacts" / "export" / "manifest.json").exists() or not ex.exists():
        raise UsageError(f"{wd}: no committed export; run `specpipe build <config>` first")
    try:
        doc = export_artifact.read_export(wd / "artifacts" / "export").speculators
    except StageError as e:
        raise UsageError(f"{wd}: {e}") from None
    if not doc or not (wd / "artifacts" / "export" / "speculators" / "config.json").exists():
        raise UsageError(f"{wd}: the export has no speculators/ draft for vLLM (export.speculators: true, and a "
                         "deployment that speculates, write it)")
    return doc


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else None


def find_pair(workdir: str | None, *, target: str = "auto", device: str = "cpu", draft_len: int | None = None) -> VllmPair:
    """What `vllm serve` gets for the run: the exported command (export.json `speculators.vllm_serve`) with this
    run's paths. `target` auto: the FP8 deployment target on CUDA, the BF16 target on CPU (vLLM's CPU FP8 kernel
    rejects shapes such as the tiny target's 688 input features, and the SmolLM2 FP8 checkpoint never produced a token)."""
    wd = Path(workdir) if workdir else None
    if wd is None:
        runs = sorted(Path("runs").glob("*/artifacts/export/speculators")) if Path("runs").exists() else []
        if len(runs) != 1:
            raise UsageError("give --workdir (default only when exactly one run under ./runs has a speculators export)")
        wd = runs[0].parents[2]
    doc = _export_doc(wd)
    argv = shlex.split(doc["vllm_serve"])
    kind = target if target != "auto" else ("fp8" if device == "cuda" else "bf16")
    if kind == "fp8":
        tgt, why = Path(argv[2]), "the FP8 target the deployment serves"
        kv = _flag(argv, "--kv-cache-dtype")
    else:
        tgt, kv = wd / "artifacts" / "target" / "model", None
        why = ("the BF16 target (vLLM on CPU cannot run the FP8 deployment target; --target fp8 tries it)"
               if device == "cpu" else "the BF16 target (--target bf16)")
    if not (tgt / "config.json").exists():
        raise UsageError(f"{tgt}: no model there (config.json missing) for --target {kind}")
    draft = (wd / "artifacts" / "export" / "speculators").resolve()
    sc = json.loads(_flag(argv, "--speculative-config") or "{}")
    if draft_len is not None:   # a constant k instead of the tuned one; 0: the target alone
        sc = {"model": sc.get("model"), "method": sc.get("method"), "num_speculative_tokens": draft_len}
    sc = {**sc, "model": str(draft)} if sc.get("num_speculative_tokens") else None
    mml = _flag(argv, "--max-model-len")
    return VllmPair(wd, tgt.resolve(), kind, draft if sc else None, sc, int(mml) if mml else None, kv, why)


def find_install(python: str | None):
    """The vLLM installation (runtime.vllm.engine.find_vllm); not installed: a UsageError with the install line."""
    from runtime.vllm import engine as E

    try:
        return E.find_vllm(python)
    except E.VllmUnavailable as e:
        raise UsageError(f"--engine vllm: {e}") from None


def start(install, pair: VllmPair, *, port: int | None, ready_timeout: float, kv_cache_gib: float,
          log_path: Path | None = None):
    """VllmServer on the pair, started and healthy (VllmUnavailable with the log tail when it does not start). The
    log goes to `log_path`, else a temporary file (the run's directory is not written)."""
    from runtime.vllm import engine as E

    extra = ["--speculative-config", json.dumps(pair.speculative_config, separators=(",", ":"))] \
        if pair.speculative_config else []
    args = E.ServeArgs(str(pair.target), max_model_len=pair.max_model_len, kv_cache_dtype=pair.kv_cache_dtype,
                       extra_args=tuple(extra), served_model_name=pair.workdir.resolve().name)
    srv = E.VllmServer(install, args, port=port or 0, log_path=log_path, kv_cache_gib=kv_cache_gib,
                       ready_timeout=ready_timeout)
    return srv.start()


def ready_message(srv, pair: VllmPair) -> str:
    sc = pair.speculative_config
    spec = (f"draft {pair.draft} ({sc['method']}, num_speculative_tokens {sc['num_speculative_tokens']}"
            + (f", per batch size {sc['num_speculative_tokens_per_batch_size']}"
               if sc.get("num_speculative_tokens_per_batch_size") else "") + ")") if sc else "no draft (target alone)"
    body = json.dumps({"model": srv.served_model_name, "messages": [{"role": "user", "content": "def add(a, b):"}],
                       "max_tokens": 32, "temperature": 0})
    return (f"vLLM {srv.install.version} ({srv.install.device}) ready (pid {srv.process.pid})\n"
            f"  target   {pair.target}: {pair.why}\n  {spec}\n"
            f"  OpenAI   {srv.url}/v1  model \"{srv.served_model_name}\"\n  metrics  {srv.url}/metrics\n"
            f"  try: curl -s {srv.url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'\n"
            f"  log: {srv.log_path}\nCtrl-C stops it.")


def exported_draft_len(wd: Path) -> int:
    """The draft length vLLM runs at batch 1 with the exported command (its per-batch schedule's first k, else
    num_speculative_tokens): the monitor's baseline for a vLLM endpoint."""
    sc = json.loads(_flag(shlex.split(_export_doc(Path(wd))["vllm_serve"]), "--speculative-config") or "{}")
    per = sc.get("num_speculative_tokens_per_batch_size")
    k = int(per[0][2]) if per else int(sc.get("num_speculative_tokens") or 0)
    if k < 1:
        raise UsageError(f"{wd}: the exported vLLM command drafts nothing at batch 1: give --draft-len")
    return k
