"""Stage `data`: draft-training data, calibration data and per-domain evaluation prompts.

Sources (a closed set, `kind`): local JSONL in the two common shapes (`{"messages": [...]}` conversations,
`{"prompt": ...}` / `{"text": ...}`), Hugging Face `datasets` by name (split + column mapping), and, for the
tiny default, code cut from the bootstrap target's corpus (its held-out files feed only the eval domains).

Conversations are rendered with the target's chat template (or `data.chat_template`, a Jinja file, which then
also renders the eval prompts) and trained on the assistant's tokens only: every assistant turn's content and its
end-of-turn token, nothing of the system or user turns or the assistant header. Templates with `{% generation %}`
tags are used as tagged; any other template's assistant spans are derived from its own renderings and checked
for consistency (runtime/text/chat_template.py); a template that cannot give a trustworthy mask is refused, naming the
sample, the message and the text that differs.

Optionally the target regenerates the responses (what makes a draft match its target, the EAGLE recipe): from
prompt-only chats, or replacing a conversation's last assistant turn given the earlier ones. Regeneration runs the
project's own runtime (batched KV-cache decoding, prompts sorted by length into batches), stops at the target's
stop ids (`target.json["eos_token_ids"]`), and resumes from the answers journaled in the scratch dir after an
interruption. Artifact: see docs/architecture.md (data); what each check proves: docs/stages/data.md.

This module is the stage's contract and orchestration; how samples are read (runtime/data/sources.py), rendered and
masked (runtime/data/render.py), regenerated (regenerate.py) and split (splits.py) lives in runtime/data/.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator

from pipeline.artifacts import data as data_artifact
from pipeline.artifacts import target as target_artifact
from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection, Strict
from pipeline.store import fault_point
from runtime.data.sources import Malformed, Sample, jsonl_problem, read_bootstrap, read_hf, read_jsonl
from runtime.errors import RuntimeFailure

NAME = "data"
CONSUMES = ("target",)
VERSION = "2"   # 2: masks from any chat template, regeneration through the runtime, chat_template.jinja
PACKAGES = ("transformers", "tokenizers", "datasets", "torch")
# how and where a server engine is reached, not what it answers: a change keeps the answers journaled so far
EXECUTION_ONLY = tuple(f"regenerate.{k}" for k in ("endpoint", "api_key_env", "headers", "tls_verify", "ca_bundle", "concurrency",
                                                   "timeout_s", "max_attempts", "backoff_s", "max_failed_fraction"))
EXECUTION_ONLY_CODE = {"runtime.vllm.engine": "the vLLM server started to regenerate answers: how, not what (as `vllm`)"}

Format = Literal["auto", "messages", "prompt", "text"]


class BootstrapSource(Strict):
    """Code from the tiny target's corpus: its training files for `sources`, held-out files for `eval_domains`."""

    kind: Literal["bootstrap"]
    style: Literal["code", "prose", "any"] = Field("any", description="eval prompts ending inside code, or inside "
                                                                      "docstrings/comments")
    domain: str | None = None


class JsonlSource(Strict):
    kind: Literal["jsonl"]
    path: Path
    format: Format = "auto"
    chat: bool | None = Field(None, description="render prompt/text samples as a user turn (default: for prompt samples when a "
                                                "chat template exists)")
    domain: str | None = None
    max_samples: int | None = Field(None, ge=1)


class HFSource(Strict):
    kind: Literal["hf"]
    name: str = Field(description="hub dataset id or a local dataset directory")
    subset: str | None = None
    split: str = "train"
    revision: str | None = None
    columns: dict[Literal["messages", "prompt", "text"], str] = Field(default_factory=dict, description="our field -> dataset "
                                                                                                        "column")
    where: dict[str, str | int | bool] = Field(default_factory=dict, description="keep rows whose columns equal these values, "
                                                                                 "e.g. {category: coding}")
    format: Format = "auto"
    chat: bool | None = None
    domain: str | None = None
    max_samples: int | None = Field(None, ge=1)
    trust_remote_code: bool = False


Source = Annotated[BootstrapSource | JsonlSource | HFSource, Field(discriminator="kind")]


class RegenerateConfig(Strict):
    enabled: bool = Field(False, description="replace responses by the target's own: prompt-only chats get one, a chat's last "
                                             "assistant turn is rewritten")
    mode: Literal["greedy", "sample"] = Field("greedy", description="greedy decoding, or sampling with temperature/top_p (seeded "
                                                                    "by data.seed)")
    temperature: float = Field(0.8, gt=0, description="sampling temperature (mode: sample)")
    top_p: float = Field(0.95, gt=0, le=1, description="nucleus sampling mass (mode: sample)")
    max_new_tokens: int = Field(128, ge=1, description="tokens generated per response at most; prompts longer than "
                                                       "data.max_length minus this are skipped")
    batch_size: int = Field(16, ge=1, description="prompts decoded together (sorted by length to limit padding); through a "
                                                  "server: the seed numbering, and requests in flight unless concurrency")
    engine: Literal["auto", "vllm", "endpoint", "runtime"] = Field(
        "auto", description="auto: the endpoint when set, else vLLM where installed (the `vllm` section), else specpipe's "
                            "runtime (runtime/data/regen_engines.py)")
    endpoint: str | list[str] | None = Field(None, description="base URL of an OpenAI-compatible completions server (vllm "
                                                               "serve, trtllm-serve, SGLang), or a list of them sharing the load")
    endpoint_model: str | None = Field(None, description="model name at the endpoint (default: the first id of GET /v1/models)")
    api_key_env: str | None = Field(None, description="environment variable holding the endpoint's API key (sent as Bearer)")
    headers: dict[str, str] = Field(default_factory=dict, description="extra HTTP headers to the endpoint (values never logged)")
    tls_verify: bool = Field(True, description="verify the endpoint's TLS certificate (https)")
    ca_bundle: Path | None = Field(None, description="PEM file of the CA certificates that sign the endpoint's certificate")
    concurrency: int | None = Field(None, ge=1, description="requests in flight to a server engine (default: batch_size)")
    timeout_s: float = Field(600.0, gt=0, description="per request: connect, send and each read (socket timeouts)")
    max_attempts: int = Field(6, ge=1, description="attempts per request on 429, 408, 5xx, dropped connections and timeouts")
    backoff_s: float = Field(0.5, ge=0, description="first retry delay, doubling (<= 30 s, half random), or a longer Retry-After")
    max_failed_fraction: float = Field(0.0, ge=0, lt=1, description="share of prompts allowed to fail every attempt (left out, "
                                                                    "counted in stats.json)")
    cut_loops: bool = Field(False, description="end a response that falls into a loop after two copies of the repeated "
                                               "segment (small targets' greedy answers loop; the loop is not trained on)")
    turns: Literal["last", "first"] = Field("last", description="chats: rewrite the last assistant turn (last), or answer the "
                                                            "first user turn alone (first: more single-turn prompts fit)")


def _default_sources():
    return [BootstrapSource(kind="bootstrap")]


def _default_domains():
    return {"code": BootstrapSource(kind="bootstrap", style="code"), "prose": BootstrapSource(kind="bootstrap", style="prose")}


class Config(StageSection):
    sources: list[Source] = Field(default_factory=_default_sources, min_length=1, description="training data sources (kind: "
                                                                                              "bootstrap | jsonl | hf)")
    eval_domains: dict[str, Source] = Field(default_factory=_default_domains, min_length=1, description="domain name -> prompt "
                                                                                                        "source; acceptance is "
                                                                                                        "measured and gated per "
                                                                                                        "domain")
    max_samples: int = Field(2000, ge=1, description="training samples kept after dedup (a deterministic subset)")
    max_length: int = Field(256, ge=16, description="tokens per training sample (longer ones are truncated)")
    min_length: int = Field(16, ge=1, description="shorter samples are dropped")
    eval_fraction: float = Field(0.05, ge=0, lt=0.5, description="share of samples held out for quality measurement")
    calib_samples: int = Field(64, ge=1, description="size of the calibration split (FP8 scales)")
    eval_prompts: int = Field(32, ge=1, description="prompts per evaluation domain")
    max_prompt_tokens: int = Field(128, ge=8, description="eval prompts keep their last N tokens")
    dedup: bool = Field(True, description="drop exact duplicate samples")
    max_malformed: int = Field(0, ge=0, description="malformed input lines tolerated before the stage fails")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig, description="replace responses by the target's own "
                                                                                       "generations")
    chat_template: Path | None = Field(None, description="a Jinja chat template file used instead of the target's own for "
                                                         "training samples and eval prompts; deploy with the same template")
    seed: int = Field(0, description="split and subsample seed")

    @field_validator("eval_domains")
    @classmethod
    def _names(cls, v: dict) -> dict:
        for name in v:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ValueError(f"domain name '{name}' must use letters, digits, '_', '-', '.' only (it names a file)")
        return v


def check(cfg) -> list[tuple[str, str]]:
    problems = []
    sec: Config = cfg.data
    boot = cfg.target.bootstrap is not None
    for i, s in enumerate(sec.sources):
        if s.kind == "bootstrap" and not boot:
            problems.append((f"data.sources.{i}.kind", "'bootstrap' needs target.bootstrap: tiny (there is no corpus otherwise)"))
        if s.kind == "jsonl" and not Path(s.path).expanduser().is_file():
            problems.append((f"data.sources.{i}.path", f"file not found: {s.path}"))
        elif s.kind == "jsonl" and (why := jsonl_problem(s.path)):
            problems.append((f"data.sources.{i}.path", why))
    for name, s in sec.eval_domains.items():
        if s.kind == "bootstrap" and not boot:
            problems.append((f"data.eval_domains.{name}.kind", "'bootstrap' needs target.bootstrap: tiny"))
        if s.kind == "jsonl" and not Path(s.path).expanduser().is_file():
            problems.append((f"data.eval_domains.{name}.path", f"file not found: {s.path}"))
        elif s.kind == "jsonl" and (why := jsonl_problem(s.path)):
            problems.append((f"data.eval_domains.{name}.path", why))
    if sec.chat_template is not None:
        p = Path(sec.chat_template).expanduser()
        if not p.is_file():
            problems.append(("data.chat_template", f"file not found: {sec.chat_template}"))
        else:
            from runtime.text.chat_template import check_template_syntax

            try:
                text = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                problems.append(("data.chat_template", f"{sec.chat_template} is not a readable UTF-8 text file ({e})"))
            else:
                err = check_template_syntax(text) if text.strip() else "the file is empty"
                if err:
                    problems.append(("data.chat_template", f"{sec.chat_template} is not a valid Jinja chat template: {err}"))
    if sec.regenerate.enabled and sec.regenerate.max_new_tokens >= sec.max_length:
        problems.append(("data.regenerate.max_new_tokens", f"{sec.regenerate.max_new_tokens} leaves no room for a prompt within "
                         f"data.max_length={sec.max_length}; lower it or raise data.max_length"))
    rc = sec.regenerate
    if rc.enabled and (rc.engine != "auto" or rc.endpoint):     # auto without an endpoint is decided when it runs
        from runtime.data.regen_engines import EngineConfigError, choose_engine

        try:
            choose_engine(rc, cfg.vllm)
        except EngineConfigError as e:
            problems.append((e.field, e.message))
    return problems


def fingerprint_extra(section: Config) -> dict | None:
    files = {}
    paths = [s.path for s in [*section.sources, *section.eval_domains.values()] if s.kind == "jsonl"]
    for path in paths + ([section.chat_template] if section.chat_template is not None else []):
        p = Path(path).expanduser()
        if p.is_file():
            st = p.stat()
            files[str(path)] = [st.st_size, int(st.st_mtime)]
    return files or None


# ---------------------------------------------------------------------------------------------- run


def _check_malformed(bad: Malformed, sec: Config, log, shown: int) -> int:
    for item in bad.items[shown:20]:
        log.warning("malformed: %s", item)
    if len(bad.items) > sec.max_malformed:
        raise StageError(f"data: {len(bad.items)} malformed input lines (limit data.max_malformed={sec.max_malformed}); first: "
                         + "; ".join(bad.items[:5]))
    return len(bad.items)


def run(ctx: StageContext) -> dict:
    """Read the sources, write the eval prompts, split, encode (or regenerate) and write the splits and stats.json.
    runtime.data's failures (`RuntimeFailure`) read as the stage's: StageError("data: <message>")."""
    try:
        return _run(ctx)
    except RuntimeFailure as e:
        raise StageError(f"data: {e}") from None


def _run(ctx: StageContext) -> dict:
    import datasets
    from transformers import AutoTokenizer

    from runtime.data.render import encode_samples, has_assistant, load_renderer
    from runtime.data.splits import dedup_and_split, rows_problem, split_stats, token_rows

    datasets.disable_progress_bars()

    sec: Config = ctx.section
    target = ctx.input("target")
    model_dir = target_artifact.model_dir(target.path)
    tinfo = target_artifact.read_info(target.path)
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=ctx.config.target.trust_remote_code)
    renderer, tmpl_info = load_renderer(tok, sec.chat_template)
    if renderer is not None:
        ctx.log.info("chat template: %s; loss masks by %s; end of turn %s; assistant header %r", tmpl_info["source"],
                     tmpl_info["mask_method"], tmpl_info["end_of_turn"], tmpl_info["generation_prompt"])
    bad = Malformed(sec.max_malformed)

    train, evals = _load_sources(ctx, sec, target.path, bad)
    shown = _check_malformed(bad, sec, ctx.log, 0)
    domain_stats, chosen_keys = _write_eval_prompts(ctx, sec, renderer, tok, evals)
    train, heldout, split_counts = dedup_and_split(train, chosen_keys, dedup=sec.dedup, seed=sec.seed,
                                                   eval_fraction=sec.eval_fraction)
    if sec.regenerate.enabled:
        train, encoded, heldout, held_enc, regen_stats, shown = _regenerate_splits(
            ctx, renderer, tok, tmpl_info, train, heldout, bad, shown)
    else:
        train = train[: sec.max_samples]
        regen_stats = None
        no_response = [s for s in train if s.fmt == "prompt" or (s.fmt == "messages" and not has_assistant(s))]
        if no_response:
            raise StageError(f"data: {len(no_response)} training samples have no response to train on (prompts, or conversations "
                             f"without an assistant turn; e.g. {no_response[0].origin}); enable data.regenerate to let the "
                             "target "
                             "write the responses, or give text/messages samples with responses")
        eos_id = tinfo.eos_token_id if tinfo.eos_token_id is not None else tok.eos_token_id
        encoded = encode_samples(renderer, tok, train, sec.max_length, eos_id, bad, tmpl_info)
        held_enc = encode_samples(renderer, tok, heldout, sec.max_length, eos_id, bad, tmpl_info)
        shown = _check_malformed(bad, sec, ctx.log, shown)

    train_rows = token_rows(train, encoded, sec.min_length)
    if not train_rows["input_ids"]:
        raise StageError("data: no training sample is kept: " + rows_problem(train, encoded, sec.min_length)
                         + " (no token to train on: a conversation whose assistant turns lie beyond data.max_length)")
    splits = _write_splits(ctx, sec, renderer, train_rows, token_rows(heldout, held_enc, sec.min_length))
    stats = {
        "splits": {name: split_stats(r) for name, r in splits.items()},
        "domains": domain_stats,
        **split_counts, "subsampled_to": sec.max_samples,
        "malformed": len(bad.items), "malformed_examples": bad.items[:20],
        "regenerated": sec.regenerate.enabled, "regeneration": regen_stats, "chat_template": tmpl_info,
    }
    (ctx.out_dir / "stats.json").write_text(json.dumps(stats, indent=2))
    ctx.log.info("train %d samples / %d tokens (%d trained on), heldout %d, calib %d; eval domains: %s",
                 stats["splits"]["train"]["samples"], stats["splits"]["train"]["tokens"], stats["splits"]["train"]["loss_tokens"],
                 stats["splits"]["heldout"]["samples"], stats["splits"]["calib"]["samples"],
                 ", ".join(f"{k} ({v['prompts']})" for k, v in domain_stats.items()))
    return _metrics(stats, tmpl_info)


def _load_sources(ctx: StageContext, sec: Config, target_path: Path, bad: Malformed):
    """The training samples of every source (in order) and the candidate prompts of every eval domain."""
    max_chars = sec.max_length * 4
    train: list[Sample] = []
    for i, src in enumerate(sec.sources):
        domain = src.domain or ("code" if src.kind == "bootstrap" else f"source{i}")
        if src.kind == "bootstrap":
            got = read_bootstrap(target_path, src, domain, "train", max_chars)
        elif src.kind == "jsonl":
            got = read_jsonl(src, domain, bad)
        else:
            got = read_hf(src, domain, bad)
        ctx.log.info("source %d (%s): %d samples", i, src.kind, len(got))
        train += got
    evals: dict[str, list[Sample]] = {}
    for name, src in sec.eval_domains.items():
        if src.kind == "bootstrap":
            evals[name] = read_bootstrap(target_path, src, name, "heldout", min(max_chars, sec.max_prompt_tokens * 4))
        elif src.kind == "jsonl":
            evals[name] = read_jsonl(src, name, bad)
        else:
            evals[name] = read_hf(src, name, bad)
        ctx.log.info("eval domain %s (%s): %d candidate prompts", name, src.kind, len(evals[name]))
    return train, evals


def _write_eval_prompts(ctx: StageContext, sec: Config, renderer, tok, evals: dict[str, list[Sample]]):
    """eval/<domain>.jsonl (rendered, cut to the last max_prompt_tokens, at least 4 tokens each). Returns the
    per-domain stats and the keys of every sample looked at, which never train the draft."""
    from runtime.data.splits import eval_prompts

    (ctx.out_dir / data_artifact.EVAL_DIR).mkdir()
    domain_stats = {}
    chosen_keys: set[str] = set()
    for name, samples in evals.items():
        prompts = [data_artifact.EvalPrompt(**p) for p in eval_prompts(
            name, samples, renderer, tok, limit=sec.eval_prompts, max_prompt_tokens=sec.max_prompt_tokens, seed=sec.seed,
            chosen_keys=chosen_keys)]
        if not prompts:
            raise StageError(f"data.eval_domains.{name}: no usable prompts (need at least 4 tokens each)")
        data_artifact.write_eval(ctx.out_dir, name, prompts)
        domain_stats[name] = {"prompts": len(prompts),
                              "mean_prompt_tokens": round(sum(len(p.prompt_ids) for p in prompts) / len(prompts), 1)}
    return domain_stats, chosen_keys


def _regenerate_splits(ctx: StageContext, renderer, tok, tmpl_info: dict, train: list[Sample], heldout: list[Sample],
                       bad: Malformed, shown: int):
    """The target writes the responses (data.regenerate): (train, its rows, heldout, its rows, stats, shown)."""
    from runtime.data import regenerate as G
    from runtime.data.regen_engines import RegenTarget, choose_engine, run_regeneration

    sec: Config = ctx.section
    target = ctx.input("target")
    model_dir, tinfo = target_artifact.model_dir(target.path), target_artifact.read_info(target.path)
    rc = sec.regenerate
    budget = sec.max_length - rc.max_new_tokens
    train, heldout = ([G.first_turn(s) for s in x] for x in (train, heldout)) if rc.turns == "first" else (train, heldout)
    train_jobs, skip_t = G.select_jobs(renderer, tok, train, sec.max_samples, budget, sec.max_length, bad, tmpl_info)
    n_held = math.ceil(len(train_jobs) * sec.eval_fraction / (1 - sec.eval_fraction)) if sec.eval_fraction else 0
    held_jobs, skip_h = G.select_jobs(renderer, tok, heldout, n_held, budget, sec.max_length, bad, tmpl_info)
    shown = _check_malformed(bad, sec, ctx.log, shown)
    if not train_jobs:
        raise StageError(f"data: no training prompt fits data.max_length - data.regenerate.max_new_tokens = {budget} tokens "
                         f"({skip_t} were longer); raise data.max_length or lower data.regenerate.max_new_tokens")
    if skip_t or skip_h:
        ctx.log.info("regeneration: %d prompts longer than %d tokens (data.max_length %d - max_new_tokens %d) skipped",
                     skip_t + skip_h, budget, sec.max_length, rc.max_new_tokens)
    eot = tmpl_info["end_of_turn_id"] if renderer is not None else None     # data.chat_template's end of turn
    stop_ids = list(tinfo.stop_ids) + ([eot] if eot is not None and eot not in tinfo.stop_ids else [])
    greedy = rc.mode == "greedy"
    ctx.log.info("regeneration: %d train + %d held-out prompts, batches of %d sorted by length, up to %d new tokens, %s, "
                 "stop ids %s", len(train_jobs), len(held_jobs), rc.batch_size, rc.max_new_tokens,
                 "greedy" if greedy else f"sampling T={rc.temperature} top_p={rc.top_p} seed={sec.seed}",
                 [f"{i} ({tok.convert_ids_to_tokens(i)})" for i in stop_ids])
    jobs = train_jobs + held_jobs
    vllm_cfg = ctx.config.vllm     # where/how vLLM runs; what it generates: data.regenerate.engine
    gens, rs = run_regeneration(
        choose_engine(rc, vllm_cfg, model_dir=model_dir, new_tokens=len(jobs) * rc.max_new_tokens), vllm_cfg=vllm_cfg,
        target=RegenTarget(model_dir, tinfo.dtype, sec.max_length + 8, tok,
                           tmpl_info.get("end_of_turn_id") or (stop_ids or [None])[0], tinfo.vocab_size),
        prompts=[j.prompt for j in jobs], keys=[j.sample.key for j in jobs], batch_size=rc.batch_size,
        decoding=G.Decoding(rc.max_new_tokens, 0.0 if greedy else rc.temperature, 1.0 if greedy else rc.top_p, stop_ids,
                          sec.seed),
        run=G.RegenRun(ctx.scratch_dir / "regenerate", ctx.log, ctx.progress,
                     lambda n: fault_point(NAME, f"regenerate-batch-{n}")))
    rs.update(skipped_long_prompts=skip_t + skip_h, prompt_budget=budget, mode=rc.mode, turns=rc.turns)
    train_jobs, held_jobs, gens = G.answered_only(train_jobs, held_jobs, gens)    # failed within max_failed_fraction
    jobs = train_jobs + held_jobs
    rs["template"] = (G.template_consistency(renderer, tok, jobs, gens, tmpl_info.get("end_of_turn_id"))
                      if renderer is not None else None)
    rows_all, loops = G.regenerated_rows(jobs, gens, cut_loops=rc.cut_loops)
    rs.update(loops, cut_loops=rc.cut_loops)
    G.log_outcome(ctx.log, rs)
    return ([j.sample for j in train_jobs], rows_all[: len(train_jobs)], [j.sample for j in held_jobs],
            rows_all[len(train_jobs):], rs, shown)


def _write_splits(ctx: StageContext, sec: Config, renderer, train_rows: dict, held_rows: dict) -> dict[str, dict]:
    from datasets import Dataset

    splits = {"train": train_rows, "heldout": held_rows,
              "calib": {k: v[: sec.calib_samples] for k, v in train_rows.items()}}
    for name, r in splits.items():
        Dataset.from_dict(r).to_parquet(str(data_artifact.split_path(ctx.out_dir, name)))
    if renderer is not None:
        (ctx.out_dir / data_artifact.CHAT_TEMPLATE).write_text(renderer.template)
    return splits


def _metrics(stats: dict, tmpl_info: dict) -> dict:
    sp, regen = stats["splits"], stats["regeneration"]
    metrics = {
        "train_samples": sp["train"]["samples"], "train_tokens": sp["train"]["tokens"],
        "train_loss_tokens": sp["train"]["loss_tokens"], "heldout_samples": sp["heldout"]["samples"],
        "calib_samples": sp["calib"]["samples"], "malformed": stats["malformed"],
        "eval_domains": {k: v["prompts"] for k, v in stats["domains"].items()}, "regenerated": stats["regenerated"],
        "mask_method": tmpl_info.get("mask_method"),
    }
    if regen:
        metrics["regeneration"] = {k: regen.get(k) for k in ("engine", "prompts", "resumed_prompts", "seconds", "prompts_per_s",
                                                             "new_tokens_per_s", "mean_new_tokens", "ended_at_stop",
                                                             "hit_max_new_tokens", "retokenized", "failed_prompts")}
    return metrics


def report(artifact) -> str:
    from pipeline.report import esc, table

    s = artifact.read_json("stats.json")
    rows = [[k, v["samples"], v["tokens"], v["loss_tokens"], v["mean_len"], v["max_len"]] for k, v in s["splits"].items()]
    out = table(rows, ["split", "samples", "tokens", "loss tokens", "mean length", "max length"])
    out += table([[k, v["prompts"], v["mean_prompt_tokens"]] for k, v in s["domains"].items()], ["eval domain", "prompts",
                                                                                                 "mean prompt tokens"])
    t = s.get("chat_template") or {}
    if t.get("source"):
        out += table([["template", t["source"]], ["loss masks", t["mask_method"]], ["end of turn", t["end_of_turn"]],
                      ["assistant header", repr(t["generation_prompt"])]], ["chat template", ""])
    g = s.get("regeneration")
    if g:
        from runtime.data.regenerate import report_rows

        out += table(report_rows(g), ["regeneration", ""])
    if s.get("malformed"):
        out += "<p>malformed lines: " + esc(", ".join(s["malformed_examples"][:5])) + "</p>"
    return out
