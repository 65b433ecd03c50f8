"""The engines that regenerate training data (`data.regenerate.engine`): vLLM started for the job
(runtime/vllm/engine.py), any OpenAI-compatible completions endpoint (`vllm serve`, `trtllm-serve`, SGLang), or
specpipe's own runtime (runtime/data/regenerate.py), the fallback.

Every engine fills the same plan (prompts sorted by (length, key) into batches of `batch_size`) and appends to the
same answers journal (runtime/data/answers.py), so a rerun resumes whatever engine answered a prompt. The server
engines take token-id prompts (the chat template is applied once, by us, exactly as for the runtime), keep
`concurrency` requests in flight (default `batch_size`), fed as capacity frees, through the retrying client of
runtime/data/endpoint_client.py, sample as the runtime does (greedy, or seeded temperature/top_p: request i of batch b gets seed
`seed + b * batch_size + i`), stop at the same stop ids (`stop_token_ids`) and cut each answer after its first stop id.

Facts from vLLM v0.32.0 (vllm/entrypoints/openai/completion/protocol.py): `prompt` may be a list of token ids,
`return_token_ids: true` returns the generated ids in `choices[i].token_ids`, `stop_token_ids` and `seed` are
sampling extras of the same request; GET /v1/models lists the served ids in `data[i].id`.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.data.endpoint_client import ClientSettings, CompletionsPool, EndpointError
from runtime.data.regenerate import Decoding, RegenRun, regenerate
from runtime.data.server_engine import ServerJob, server_batches
from runtime.errors import RuntimeUsageError
from runtime.vllm import engine as E

# `auto` takes vLLM for a job of at least this many new tokens (max_new_tokens x prompts): below it the server start
# (~40-60 s for SmolLM2 on 2 busy cores) costs more than the runtime's ~40 tokens/s loses (docs/stages/data.md).
AUTO_MIN_NEW_TOKENS = 4096


class EngineConfigError(RuntimeUsageError):
    """A regeneration engine the config asks for cannot be used; `field` is the config field to change."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class EngineChoice:
    kind: str                    # vllm | endpoint | runtime
    why: str
    auto: bool = False           # chosen by engine: auto (a vLLM that fails falls back to the runtime)
    install: E.VllmInstall | None = None
    endpoint: str | None = None  # the endpoints, comma-separated (for people; the client holds the list)
    model: str | None = None
    client: ClientSettings | None = None      # a server engine's client settings (endpoint: with the endpoints)
    max_failed_fraction: float = 0.0


def endpoints_of(rc) -> tuple[str, ...]:
    """`data.regenerate.endpoint` as a tuple of base URLs (one URL or a list); EngineConfigError naming the entry."""
    raw = rc.endpoint
    many = isinstance(raw, (list, tuple))
    urls = []
    for i, u in enumerate(raw if many else [raw] if raw else []):
        u = (u or "").strip()
        name = f"data.regenerate.endpoint.{i}" if many else "data.regenerate.endpoint"
        if not u.startswith(("http://", "https://")):
            raise EngineConfigError(name, f"{u!r} is not an http(s) base URL (e.g. http://host:8000)")
        if "@" in u.split("/")[2]:
            raise EngineConfigError(name, "has credentials in the URL; give the key through data.regenerate.api_key_env (or "
                                    "headers), which are never logged")
        urls.append(u.rstrip("/"))
    if len(set(urls)) < len(urls):
        raise EngineConfigError("data.regenerate.endpoint", f"lists an endpoint twice ({urls})")
    return tuple(urls)


def client_settings(rc, endpoints: tuple[str, ...] = (), env=os.environ) -> ClientSettings:
    """The client settings `rc` (data.regenerate) asks for; the API key read from the variable `api_key_env` names.
    EngineConfigError naming the field when that variable is unset or the CA bundle is missing."""
    key = None
    if rc.api_key_env:
        key = env.get(rc.api_key_env)
        if not key:
            raise EngineConfigError("data.regenerate.api_key_env", f"the environment variable {rc.api_key_env} is not set "
                                    "or empty; export it with the endpoint's API key (the key never goes in the config)")
    verify: bool | str = bool(rc.tls_verify)
    if rc.ca_bundle is not None:
        p = Path(rc.ca_bundle).expanduser()
        if not p.is_file():
            raise EngineConfigError("data.regenerate.ca_bundle", f"file not found: {rc.ca_bundle} (a PEM file of the CA "
                                    "certificates that sign the endpoint's certificate)")
        if not rc.tls_verify:
            raise EngineConfigError("data.regenerate.ca_bundle", "set with tls_verify: false; drop one of them")
        verify = str(p)
    return ClientSettings(endpoints, model=rc.endpoint_model, api_key=key, headers=tuple(sorted((rc.headers or {}).items())),
                          verify=verify, timeout_s=float(rc.timeout_s), max_attempts=int(rc.max_attempts),
                          backoff_s=float(rc.backoff_s), concurrency=int(rc.concurrency or rc.batch_size))


def choose_engine(rc, vllm_cfg=None, find=E.find_vllm, *, model_dir: Path | None = None,
                  new_tokens: int | None = None) -> EngineChoice:
    """The engine `rc` (the data.regenerate section) asks for. auto: the endpoint when one is set, else vLLM where
    installed (and not switched off by `vllm.enabled: false`), the target runs there (`model_dir`: a head_dim vLLM's
    CPU attention has a kernel for) and the job (`new_tokens` at most) outweighs a server start, else the runtime.
    Raises EngineConfigError for an explicit engine that cannot run (vllm missing or disabled, endpoint without URL,
    an API key variable that is not set, a CA bundle that is missing)."""
    kind, urls = rc.engine, endpoints_of(rc)
    if kind == "endpoint" or (kind == "auto" and urls):
        if not urls:
            raise EngineConfigError("data.regenerate.endpoint", "engine: endpoint needs the base URL of an OpenAI-compatible "
                                    "completions server (`vllm serve`, `trtllm-serve`, SGLang), e.g. http://host:8000, "
                                    "or a list of them; set it, or choose engine: auto | vllm | runtime")
        shown = ", ".join(urls)
        return EngineChoice("endpoint", f"data.regenerate.endpoint {shown}" + (" (engine: auto)" if kind == "auto" else ""),
                            auto=kind == "auto", endpoint=shown, model=rc.endpoint_model, client=client_settings(rc, urls),
                            max_failed_fraction=rc.max_failed_fraction)
    if kind == "runtime":
        return EngineChoice("runtime", "data.regenerate.engine: runtime")
    enabled = getattr(vllm_cfg, "enabled", "auto")
    if enabled == "false":
        if kind == "vllm":
            raise EngineConfigError("data.regenerate.engine", "engine: vllm, but vllm.enabled: false; enable vLLM or "
                                    "choose engine: auto | runtime")
        return EngineChoice("runtime", "engine: auto and vllm.enabled: false", auto=True)
    try:
        inst = find(getattr(vllm_cfg, "python", None))
    except E.VllmUnavailable as e:
        if kind == "vllm":
            raise EngineConfigError("data.regenerate.engine", f"engine: vllm, but {e}; or choose engine: auto (the runtime "
                                    "where vLLM is missing) | runtime") from None
        return EngineChoice("runtime", f"engine: auto and vLLM is not installed ({str(e)[:300]})", auto=True)
    if kind == "auto" and (why := _auto_declines(inst, model_dir, new_tokens)):
        return EngineChoice("runtime", f"engine: auto: {why}", auto=True)
    return EngineChoice("vllm", f"{'engine: auto, ' if kind == 'auto' else ''}vLLM {inst.version} ({inst.device}) at "
                                f"{inst.python}", auto=kind == "auto", install=inst,
                        client=ClientSettings((), timeout_s=float(rc.timeout_s), max_attempts=int(rc.max_attempts),
                                              backoff_s=float(rc.backoff_s), concurrency=int(rc.concurrency or rc.batch_size)),
                        max_failed_fraction=rc.max_failed_fraction)


def _auto_declines(inst: E.VllmInstall, model_dir: Path | None, new_tokens: int | None) -> str | None:
    """Why `auto` leaves an installed vLLM aside (None: it does not)."""
    if new_tokens is not None and new_tokens < AUTO_MIN_NEW_TOKENS:
        return (f"at most {new_tokens} new tokens, fewer than the {AUTO_MIN_NEW_TOKENS} a vLLM start pays for, "
                f"the runtime (vLLM {inst.version} is installed)")
    if inst.device == "cpu" and model_dir is not None and (model_dir / "config.json").is_file():
        from runtime.engine_support import VLLM_CPU_HEAD_SIZES, head_dim

        hd = head_dim(model_dir)
        if hd not in VLLM_CPU_HEAD_SIZES:
            return f"vLLM's CPU attention has no kernel for the target's head_dim {hd} (cpu_attn.py, v0.32.0), the runtime"
    return None


@dataclass(frozen=True)
class RegenTarget:
    """The target a regeneration runs: its checkpoint, the dtype a started vLLM serves it in (None: vLLM's choice), the
    longest sequence it is asked for, and, for a server that answers with text only, the tokenizer and the id that
    stands for the end of turn a `stop` finish reason reports."""

    model_dir: Path
    dtype: str | None = None
    max_model_len: int = 0
    tok: object = None
    end_id: int | None = None
    vocab_size: int | None = None     # answers with an id outside 0..vocab_size-1 are refused


def vllm_dtype(install: E.VllmInstall, target_dtype: str | None) -> tuple[str | None, str]:
    """The `--dtype` a started vLLM serves the target in, and why: the target's dtype, except a bf16 or fp16 target on a
    CPU without fast bf16 GEMMs, which vLLM-CPU is asked to serve in float32 (`E.cpu_dtype`: the decision of
    runtime/engine/precision.py, the one validate's vLLM arm takes; emulated bf16 is 7-40x slower there, docs/benchmarks.md
    "Precision by machine"). The answers' numerics follow the dtype: it is recorded in the regeneration's stats."""
    if install.device == "cpu" and target_dtype in (None, "auto", "bfloat16", "float16") and (slow := E.cpu_dtype(install)):
        return slow, f"the target's {target_dtype or 'checkpoint dtype'} -> {slow}: bf16 GEMMs are not fast on this CPU"
    return target_dtype, "the target's dtype" if target_dtype else "vLLM's choice (the checkpoint's)"


def _vllm_batches(choice: EngineChoice, vllm_cfg, target: RegenTarget, batch_size: int, log_dir: Path):
    """A batch driver that starts vLLM for the job (target, its dtype as `vllm_dtype` resolves it, no draft), drives it,
    and stops it."""
    model_dir, max_model_len = target.model_dir, target.max_model_len
    dtype, why = vllm_dtype(choice.install, target.dtype)

    def run(prompts, keys, todo, results, **kw):
        if not todo:
            return {"load_s": 0.0, "gen_s": 0.0, "new_tokens": 0, "padded": 0, "generated": 0, "engine": "vllm",
                    "detail": "vLLM (not started: every batch resumed)"}
        log_dir.mkdir(parents=True, exist_ok=True)
        srv = E.VllmServer(choice.install, E.ServeArgs(str(model_dir), max_model_len=max_model_len, dtype=dtype),
                           kv_cache_gib=getattr(vllm_cfg, "kv_cache_gib", 2.0),
                           ready_timeout=getattr(vllm_cfg, "ready_timeout_s", 600.0), log_path=log_dir / "vllm.log")
        t0 = time.perf_counter()
        with srv:
            load_s = time.perf_counter() - t0
            kw["run"].log.info("regeneration: vLLM %s serves %s (dtype %s: %s; max-model-len %d) after %.1fs; log %s",
                           choice.install.version, model_dir, srv.dtype, why, max_model_len, load_s, srv.log_path)
            try:
                pool = CompletionsPool(dataclasses.replace(choice.client or ClientSettings(()), endpoints=(srv.url,),
                                                           model=srv.served_model_name, vocab_size=target.vocab_size))
                job = ServerJob(pool, batch_size, kind="vllm", max_failed_fraction=choice.max_failed_fraction,
                                detail=f"vLLM {choice.install.version} ({choice.install.device}), dtype {dtype}, started for "
                                       "the job")
                try:
                    out = server_batches(job, prompts, keys, todo, results, **kw)
                finally:
                    pool.close()
            except EndpointError as e:
                raise E.VllmError(f"{e}; the server is {'running' if srv.alive() else 'not running'}; its log "
                                  f"({srv.log_path}):\n{srv.log_tail(20)}") from None
        return {**out, "load_s": load_s, "dtype": srv.dtype, "dtype_why": why}
    return run


def run_regeneration(choice: EngineChoice, *, vllm_cfg, target: RegenTarget, prompts: list[list[int]], keys: list[str],
                     batch_size: int, decoding: Decoding, run: RegenRun) -> tuple[list[list[int] | None], dict]:
    """`regenerate` through the chosen engine; a vLLM chosen by `auto` that fails to start or serve hands over to the
    runtime, which continues from the answers already journaled. The stats carry engine, why and `retokenized`."""
    common = dict(batch_size=batch_size, decoding=decoding, run=run)
    model_dir, log = target.model_dir, run.log
    why, fallback = choice.why, None
    log.info("regeneration engine: %s (%s)", choice.kind, choice.why)
    if choice.kind == "runtime":
        gens, st = regenerate(model_dir, prompts, keys, **common)
    elif choice.kind == "endpoint":
        pool = CompletionsPool(dataclasses.replace(choice.client, vocab_size=target.vocab_size))
        job = ServerJob(pool, batch_size, tok=target.tok, end_id=target.end_id, max_failed_fraction=choice.max_failed_fraction,
                        detail=f"{choice.endpoint} model {pool.model}")
        log.info("regeneration: %d endpoint(s), model %s, %d requests in flight, timeout %gs, %d attempts a request%s%s",
                 len(pool.endpoints), pool.model, pool.s.concurrency, pool.s.timeout_s, pool.s.max_attempts,
                 ", an API key (Authorization: Bearer, not shown)" if pool.s.api_key else "",
                 f", headers {[k for k, _ in pool.s.headers]}" if pool.s.headers else "")
        try:
            gens, st = regenerate(model_dir, prompts, keys, generate_batches=lambda *a, **k: server_batches(job, *a, **k),
                                  **common)
        finally:
            pool.close()
    else:
        try:
            gens, st = regenerate(model_dir, prompts, keys, generate_batches=_vllm_batches(
                choice, vllm_cfg, target, batch_size, run.scratch.parent / "vllm"), **common)
        except (E.VllmUnavailable, E.VllmError) as e:
            if not choice.auto:
                raise
            fallback = str(e)[:4000]
            log.warning("regeneration: vLLM failed (%s); specpipe's runtime continues from the answers so far", fallback)
            why = f"engine: auto, vLLM failed ({fallback.splitlines()[0][:300]}): the runtime"
            gens, st = regenerate(model_dir, prompts, keys, **common)
    st.update(engine_why=why, fallback=fallback)
    log.info("regeneration engine: %s (%s): %s new tokens/s, %d answers re-tokenized from text", st["engine"], why,
             st["new_tokens_per_s"], st["retokenized"])
    return gens, st
