"""The engines that regenerate training data (`data.regenerate.engine`): vLLM started for the job
(runtime/vllm/engine.py), any OpenAI-compatible completions endpoint (`vllm serve`, `trtllm-serve`, SGLang), or
specpipe's own runtime (runtime/data/regenerate.py), the fallback.

Every engine fills the same plan (prompts sorted by (length, key) into batches of `batch_size`) and writes the same
scratch files (`batch-<b>.json`), so a rerun resumes whatever engine finished a batch. The server engines take
token-id prompts (the chat template is applied once, by us, exactly as for the runtime), keep `batch_size` requests
in flight, sample as the runtime does (greedy, or seeded temperature/top_p: request i of batch b gets seed
`seed + b * batch_size + i`), stop at the same stop ids (`stop_token_ids`) and cut each answer after its first stop id.

Facts from vLLM v0.32.0 (vllm/entrypoints/openai/completion/protocol.py): `prompt` may be a list of token ids,
`return_token_ids: true` returns the generated ids in `choices[i].token_ids`, `stop_token_ids` and `seed` are
sampling extras of the same request; GET /v1/models lists the served ids in `data[i].id`.
"""
from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from runtime.data.regenerate import Decoding, RegenRun, regenerate, write_batch
from runtime.errors import RuntimeFailure, RuntimeUsageError
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


class EndpointError(RuntimeFailure):
    """The completions server failed a request or answered something this client cannot read."""


@dataclass(frozen=True)
class EngineChoice:
    kind: str                    # vllm | endpoint | runtime
    why: str
    auto: bool = False           # chosen by engine: auto (a vLLM that fails falls back to the runtime)
    install: E.VllmInstall | None = None
    endpoint: str | None = None
    model: str | None = None


def choose_engine(rc, vllm_cfg=None, find=E.find_vllm, *, model_dir: Path | None = None,
                  new_tokens: int | None = None) -> EngineChoice:
    """The engine `rc` (the data.regenerate section) asks for. auto: the endpoint when one is set, else vLLM where
    installed (and not switched off by `vllm.enabled: false`), the target runs there (`model_dir`: a head_dim vLLM's
    CPU attention has a kernel for) and the job (`new_tokens` at most) outweighs a server start, else the runtime.
    Raises EngineConfigError for an explicit engine that cannot run (vllm missing or disabled, endpoint without URL)."""
    kind, url = rc.engine, (rc.endpoint or "").strip() or None
    if url and not url.startswith(("http://", "https://")):
        raise EngineConfigError("data.regenerate.endpoint", f"{url!r} is not an http(s) base URL (e.g. http://host:8000)")
    if kind == "endpoint" or (kind == "auto" and url):
        if not url:
            raise EngineConfigError("data.regenerate.endpoint", "engine: endpoint needs the base URL of an OpenAI-compatible "
                                    "completions server (`vllm serve`, `trtllm-serve`, SGLang), e.g. http://host:8000; "
                                    "set it, or choose engine: auto | vllm | runtime")
        return EngineChoice("endpoint", f"data.regenerate.endpoint {url}" + (" (engine: auto)" if kind == "auto" else ""),
                            auto=kind == "auto", endpoint=url.rstrip("/"), model=rc.endpoint_model)
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
                                f"{inst.python}", auto=kind == "auto", install=inst)


def _auto_declines(inst: E.VllmInstall, model_dir: Path | None, new_tokens: int | None) -> str | None:
    """Why `auto` leaves an installed vLLM aside (None: it does not)."""
    if new_tokens is not None and new_tokens < AUTO_MIN_NEW_TOKENS:
        return (f"at most {new_tokens} new tokens, fewer than the {AUTO_MIN_NEW_TOKENS} a vLLM start pays for, "
                f"the runtime (vLLM {inst.version} is installed)")
    if inst.device == "cpu" and model_dir is not None and (model_dir / "config.json").is_file():
        from runtime.validate.vllm_arm import CPU_HEAD_SIZES, head_dim

        hd = head_dim(model_dir)
        if hd not in CPU_HEAD_SIZES:
            return f"vLLM's CPU attention has no kernel for the target's head_dim {hd} (cpu_attn.py, v0.32.0), the runtime"
    return None


# ------------------------------------------------------------------------------------------ completions client


class Completions:
    """POST {url}/v1/completions with token-id prompts (stdlib HTTP). `complete` returns (generated ids or None
    where the server does not return them, text, finish_reason)."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0):
        self.url, self.timeout, self.token_ids = url.rstrip("/"), timeout, True
        self.model = model or self.models()[0]

    def _call(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method="POST" if body is not None else "GET",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:  # noqa: S310 - the configured endpoint
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise EndpointError(f"{self.url}{path} answered HTTP {e.code}: {e.read().decode(errors='replace')[:1000]}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError) as e:
            raise EndpointError(f"{self.url}{path}: no usable answer ({e})") from None

    def models(self) -> list[str]:
        out = self._call("/v1/models")
        ids = [m.get("id") for m in out.get("data") or [] if isinstance(m, dict) and m.get("id")]
        if not ids:
            raise EndpointError(f"{self.url}/v1/models lists no model ({str(out)[:300]}); set data.regenerate.endpoint_model")
        return ids

    def complete(self, prompt: list[int], *, max_tokens: int, temperature: float, top_p: float, seed: int | None,
                 stop_ids: list[int]) -> tuple[list[int] | None, str, str | None]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": float(temperature),
                "top_p": float(top_p), "stop_token_ids": list(stop_ids)}
        if temperature > 0 and seed is not None:
            body["seed"] = int(seed)
        if self.token_ids:
            body["return_token_ids"] = True
        try:
            out = self._call("/v1/completions", body)
        except EndpointError as e:
            if not (self.token_ids and "return_token_ids" in str(e) and "HTTP 4" in str(e)):
                raise
            self.token_ids = False        # a server that refuses vLLM's extra: text answers, re-tokenized
            return self.complete(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                 stop_ids=stop_ids)
        try:
            c = out["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise EndpointError(f"{self.url}/v1/completions: no choices in {str(out)[:300]}") from None
        ids = c.get("token_ids")
        return ([int(t) for t in ids] if ids is not None else None), c.get("text") or "", c.get("finish_reason")


def cut_at_stop(ids: list[int], stop_ids) -> list[int]:
    """`ids` up to and including the first stop id."""
    stop = set(stop_ids)
    for i, t in enumerate(ids):
        if t in stop:
            return ids[: i + 1]
    return list(ids)


@dataclass
class ServerJob:
    """What a server engine needs beside the plan: the client, the concurrency, and how to re-tokenize a text answer
    (`tok`, `end_id`: the id a text answer that stopped at a stop id gets back)."""

    client: Completions
    batch_size: int
    tok: object = None
    end_id: int | None = None
    kind: str = "endpoint"
    detail: str = ""


def _answer(job: ServerJob, prompt: list[int], seed: int, sampling: dict, stop_ids: list[int]) -> tuple[list[int], bool]:
    ids, text, reason = job.client.complete(prompt, seed=seed, stop_ids=stop_ids, **sampling)
    if ids is not None:
        return cut_at_stop(ids, stop_ids), False
    if job.tok is None:
        raise EndpointError(f"{job.client.url} returned text without token ids and no tokenizer was given")
    ids = job.tok(text, add_special_tokens=False)["input_ids"]
    if reason == "stop" and job.end_id is not None:
        ids.append(job.end_id)
    return cut_at_stop(ids, stop_ids), True


def server_batches(job: ServerJob, prompts: list[list[int]], keys: list[str], todo: list, results: list, *, resumed: int,
                   decoding: Decoding, run: RegenRun) -> dict:
    """`regenerate`'s batch driver for a completions server: every prompt of `todo` submitted in plan order with
    `job.batch_size` requests in flight; a batch is written to `run.scratch` as soon as all its answers are in."""
    d, scratch, progress, on_batch = decoding, run.scratch, run.progress, run.on_batch
    stop_ids, seed = d.stop_ids, d.seed
    sampling = {"max_tokens": d.max_new_tokens, "temperature": d.temperature, "top_p": d.top_p}
    left = {b: len(idx) for b, idx in todo}
    plan = dict(todo)
    new_tokens = retok = done = generated = 0
    bars = progress(total=len(prompts), desc=f"regenerate through {job.kind}") if progress else contextlib.nullcontext()
    t0 = time.perf_counter()
    with bars as bar, ThreadPoolExecutor(max_workers=max(1, job.batch_size)) as pool:
        if resumed and progress:
            bar.update(resumed)
        futs = {pool.submit(_answer, job, prompts[j], seed + b * job.batch_size + i, sampling, stop_ids): (b, j)
                for b, idx in todo for i, j in enumerate(idx)}
        try:
            for f in as_completed(futs):
                b, j = futs[f]
                results[j], r = f.result()
                new_tokens, retok, generated, left[b] = new_tokens + len(results[j]), retok + r, generated + 1, left[b] - 1
                if progress:
                    bar.update(1, tok_s=f"{new_tokens / (time.perf_counter() - t0):.1f}")
                if left[b] == 0:
                    write_batch(scratch, b, [keys[k] for k in plan[b]], [results[k] for k in plan[b]], time.perf_counter() - t0)
                    done += 1
                    if on_batch is not None:
                        on_batch(done)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return {"load_s": 0.0, "gen_s": time.perf_counter() - t0, "new_tokens": new_tokens, "padded": 0, "generated": generated,
            "retokenized": retok, "engine": job.kind, "detail": job.detail}


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


def _vllm_batches(choice: EngineChoice, vllm_cfg, target: RegenTarget, batch_size: int, log_dir: Path):
    """A batch driver that starts vLLM for the job (target, its dtype, no draft), drives it, and stops it."""
    model_dir, dtype, max_model_len = target.model_dir, target.dtype, target.max_model_len

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
            kw["run"].log.info("regeneration: vLLM %s serves %s (dtype %s, max-model-len %d) after %.1fs; log %s",
                           choice.install.version, model_dir, dtype, max_model_len, load_s, srv.log_path)
            job = ServerJob(Completions(srv.url, srv.served_model_name), batch_size, kind="vllm",
                            detail=f"vLLM {choice.install.version} ({choice.install.device}), dtype {dtype}, started for the job")
            try:
                out = server_batches(job, prompts, keys, todo, results, **kw)
            except EndpointError as e:
                raise E.VllmError(f"{e}; the server is {'running' if srv.alive() else 'not running'}; its log "
                                  f"({srv.log_path}):\n{srv.log_tail(20)}") from None
        return {**out, "load_s": load_s}
    return run


def run_regeneration(choice: EngineChoice, *, vllm_cfg, target: RegenTarget, prompts: list[list[int]], keys: list[str],
                     batch_size: int, decoding: Decoding, run: RegenRun) -> tuple[list[list[int]], dict]:
    """`regenerate` through the chosen engine; a vLLM chosen by `auto` that fails to start or serve hands over to the
    runtime, which continues from the batches already finished. The stats carry engine, why and `retokenized`."""
    common = dict(batch_size=batch_size, decoding=decoding, run=run)
    model_dir, log = target.model_dir, run.log
    why, fallback = choice.why, None
    log.info("regeneration engine: %s (%s)", choice.kind, choice.why)
    if choice.kind == "runtime":
        gens, st = regenerate(model_dir, prompts, keys, **common)
    elif choice.kind == "endpoint":
        job = ServerJob(Completions(choice.endpoint, choice.model), batch_size, tok=target.tok, end_id=target.end_id,
                        detail=f"{choice.endpoint}")
        job.detail = f"{choice.endpoint} model {job.client.model}"
        gens, st = regenerate(model_dir, prompts, keys, generate_batches=lambda *a, **k: server_batches(job, *a, **k),
                              **common)
    else:
        try:
            gens, st = regenerate(model_dir, prompts, keys, generate_batches=_vllm_batches(
                choice, vllm_cfg, target, batch_size, run.scratch.parent / "vllm"), **common)
        except (E.VllmUnavailable, E.VllmError) as e:
            if not choice.auto:
                raise
            fallback = str(e)[:4000]
            log.warning("regeneration: vLLM failed (%s); specpipe's runtime continues from the finished batches", fallback)
            why = f"engine: auto, vLLM failed ({fallback.splitlines()[0][:300]}): the runtime"
            gens, st = regenerate(model_dir, prompts, keys, **common)
    st.update(engine_why=why, fallback=fallback)
    log.info("regeneration engine: %s (%s): %s new tokens/s, %d answers re-tokenized from text", st["engine"], why,
             st["new_tokens_per_s"], st["retokenized"])
    return gens, st
