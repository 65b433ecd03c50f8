"""Regeneration of the responses by the target (`data.regenerate`, the EAGLE recipe: a draft learns what its target
writes): what the target continues for each sample (a conversation without its last assistant turn, a prompt, the
first half of a text), batched decoding through specpipe's runtime (`runtime.engine.speculative`, draft_len 0) with
every answer journaled as it arrives (runtime/data/answers.py), the rows of prompt + generated ids (loss on the
generated ones), and the check that the chat template renders exactly those rows."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.data.answers import AnswerLog
from runtime.data.render import need_template, render_prompt, template_error
from runtime.data.sources import Malformed, Sample

RUNTIME_DETAIL = "runtime.engine.speculative (autoregressive, KV cache, draft_len 0)"


@dataclass(frozen=True)
class Decoding:
    """How the target continues every prompt: at most `max_new_tokens` new tokens, sampled at `temperature`/`top_p`
    (0.0: greedy) with the seed of its batch (`seed + b`; a server engine's request i: `seed + b * batch_size + i`),
    each answer cut after its first stop id."""

    max_new_tokens: int
    temperature: float
    top_p: float
    stop_ids: list[int]
    seed: int


@dataclass(frozen=True)
class RegenRun:
    """Where a regeneration keeps its answers journal (`scratch`, None: nowhere, nothing resumed), its log, its
    progress bars (`progress(total=, desc=)`, none when None) and `on_batch(n)`, called after the n-th batch this run
    completed (the stage's fault points)."""

    scratch: Path | None
    log: object
    progress: object = None
    on_batch: object = None
    answers: AnswerLog | None = None     # the journal every answer is appended to (regenerate opens it)


@dataclass
class RegenJob:
    """One prompt for the target to continue, and the sample it came from."""

    sample: Sample
    prompt: list[int]
    context: list[dict] | None      # the messages the prompt renders (chat prompts): the template consistency check


def _regen_job(r, tok, s: Sample, max_length: int) -> RegenJob:
    """What the target continues: the conversation without its last assistant turn (earlier turns stay as context),
    a prompt as a user turn (or raw), the first half of a text sample."""
    if s.fmt == "messages":
        need_template(r, s)
        msgs = list(s.content)
        if msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        if not msgs:
            raise ValueError("a conversation of one assistant message has no prompt to regenerate from")
    elif s.fmt == "prompt" and s.chat or s.fmt == "text" and s.chat:
        need_template(r, s)
        text = s.content if s.fmt == "prompt" else render_prompt(None, tok, Sample("text", s.content, s.domain, s.origin))
        msgs = [{"role": "user", "content": text}]
    elif s.fmt == "prompt":
        return RegenJob(s, tok(s.content, add_special_tokens=False)["input_ids"], None)
    else:
        ids = tok(s.content, add_special_tokens=False)["input_ids"]
        return RegenJob(s, ids[: max(4, min(len(ids) // 2, max_length // 2))], None)
    return RegenJob(s, r.prompt_ids(msgs), msgs)


def first_turn(s: Sample) -> Sample:
    """A chat cut after its first user turn (a leading system message kept): what data.regenerate.turns: first answers.
    Other samples unchanged."""
    if s.fmt != "messages":
        return s
    msgs = list(s.content)
    i = next((k for k, m in enumerate(msgs) if m["role"] == "user"), None)
    return s if i is None or i + 1 == len(msgs) else Sample("messages", msgs[: i + 1], s.domain, s.origin, chat=s.chat)


def select_jobs(r, tok, candidates: list[Sample], limit: int, budget: int, max_length: int, bad: Malformed,
                info: dict) -> tuple[list[RegenJob], int]:
    """Up to `limit` jobs from `candidates` in order; prompts longer than `budget` tokens are skipped (counted)."""
    import jinja2

    from runtime.text.chat_template import ChatTemplateError

    jobs, skipped = [], 0
    for s in candidates:
        if len(jobs) >= limit:
            break
        try:
            job = _regen_job(r, tok, s, max_length)
        except ChatTemplateError as e:
            if e.kind == "template":
                raise template_error(s, e, info) from None
            bad.add(s.origin, f"regeneration prompt: {e}")
            continue
        except (ValueError, jinja2.TemplateError) as e:
            bad.add(s.origin, f"regeneration prompt: {e}")
            continue
        if not job.prompt:
            bad.add(s.origin, "regeneration prompt: empty")
        elif len(job.prompt) > budget:
            skipped += 1
        else:
            jobs.append(job)
    return jobs, skipped


def regenerate(model_dir: Path, prompts: list[list[int]], keys: list[str], *, batch_size: int, decoding: Decoding,
               run: RegenRun, generate_batches=None) -> tuple[list[list[int] | None], dict]:
    """The target's continuation of every prompt, through specpipe's runtime (`runtime.engine.speculative`: batched
    KV-cache decoding, draft_len 0) or `generate_batches` (an engine of runtime/data/regen_engines.py, same
    signature as `_generate_batches` without `model_dir`). Prompts are sorted by (length, key) into batches of
    `batch_size`; batch b is decoded with seed `decoding.seed + b`; every answer is appended to the journal
    `run.scratch/answers.jsonl` (runtime/data/answers.py) as it arrives, and a rerun asks only for the prompts it does
    not hold, whatever engine wrote it (an interrupted regeneration continues where it stopped). Returns (generated
    ids per prompt, cut after the first stop id, None for a prompt a server engine failed within its allowed
    failures; and statistics)."""
    d, scratch, log = decoding, run.scratch, run.log
    n = len(prompts)
    order = sorted(range(n), key=lambda j: (len(prompts[j]), keys[j]))
    batches = [order[i: i + batch_size] for i in range(0, n, batch_size)]
    results: list[list[int] | None] = [None] * n
    answers = AnswerLog(scratch / ANSWERS if scratch is not None else None, keys)
    resumed = answers.load(results)
    todo = [(b, idx) for b, idx in enumerate(batches) if any(results[j] is None for j in idx)]
    if resumed or any(answers.loaded[k] for k in ("torn_bytes", "stale", "repeated", "unreadable")):
        log.info("regeneration: resumed %d answers from %s (%d prompts left; journal: %s)", resumed, answers.path,
                 n - resumed, ", ".join(f"{k} {v}" for k, v in answers.loaded.items() if k != "answers"))
    gen = generate_batches or functools.partial(_generate_batches, model_dir)
    with answers:
        counts = gen(prompts, keys, todo, results, resumed=resumed, decoding=d, run=dataclasses.replace(run, answers=answers))
    stop = set(d.stop_ids)
    outs = [t for t in results if t is not None]
    ended = sum(1 for t in outs if t and t[-1] in stop)
    gen_s, new_tokens, generated = counts["gen_s"], counts["new_tokens"], counts["generated"]
    stats = {
        "engine": counts.get("engine", "runtime"), "engine_detail": counts.get("detail", RUNTIME_DETAIL),
        **({"engine_dtype": counts["dtype"], "engine_dtype_why": counts.get("dtype_why")} if "dtype" in counts else {}),
        "retokenized": counts.get("retokenized", 0),
        "prompts": n, "batches": len(batches), "batch_size": batch_size, "resumed_prompts": resumed,
        "resumed_batches": len(batches) - len(todo), "generated_prompts": generated, "max_new_tokens": d.max_new_tokens,
        "temperature": d.temperature, "top_p": d.top_p, "stop_ids": list(d.stop_ids),
        "load_seconds": round(counts["load_s"], 3), "seconds": round(gen_s, 3),
        "new_tokens": new_tokens,
        "prompts_per_s": round(generated / gen_s, 4) if gen_s else None,
        "new_tokens_per_s": round(new_tokens / gen_s, 3) if gen_s else None,
        "mean_new_tokens": round(sum(len(t) for t in outs) / len(outs), 2) if outs else 0.0,
        "ended_at_stop": ended,
        "hit_max_new_tokens": sum(1 for t in outs if len(t) >= d.max_new_tokens and not (t and t[-1] in stop)),
        "prefill_padding_fraction": round(counts["padded"] / max(1, counts["padded"] + sum(len(prompts[j]) for _, idx in todo
                                                                                     for j in idx)), 4),
        "journal": {k: v for k, v in answers.loaded.items() if k != "answers"},
        **{k: counts[k] for k in SERVER_COUNTS if k in counts},
    }
    return results, stats


ANSWERS = "answers.jsonl"
# what a server engine counts beside the common statistics (runtime/data/regen_engines.py), passed on to stats.json
SERVER_COUNTS = ("failed_prompts", "failed_fraction", "max_failed_fraction", "failed_examples", "last_error",
                 "retried_requests", "concurrency", "endpoints")


def _generate_batches(model_dir: Path, prompts: list[list[int]], keys: list[str], todo: list, results: list, *,
                      resumed: int, decoding: Decoding, run: RegenRun) -> dict:
    """Decode the prompts of `todo` not yet answered into `results` (the target is loaded at the first batch), each
    batch's answers appended to `run.answers` when it is finished. Returns the counters {"load_s", "gen_s", "new_tokens",
    "padded", "generated"}."""
    from runtime.engine.sampling import Sampling

    d, log, progress, on_batch, answers = decoding, run.log, run.progress, run.on_batch, run.answers
    engine, load_s, gen_s, new_tokens, padded, done, generated = None, 0.0, 0.0, 0, 0, 0, 0
    bars = progress(total=len(prompts), desc="regenerate with target") if progress else contextlib.nullcontext()
    with bars as bar:
        if resumed and progress:
            bar.update(resumed)
        for b, full in todo:
            idx = [j for j in full if results[j] is None]
            if engine is None:
                from runtime.engine.speculative import SpeculativeEngine
                from runtime.engine.target import load_target

                t0 = time.perf_counter()
                engine = SpeculativeEngine(load_target(model_dir))
                load_s = time.perf_counter() - t0
                log.info("regeneration: target loaded through runtime.engine.speculative in %.1fs", load_s)
            batch = [prompts[j] for j in idx]
            t0 = time.perf_counter()
            g = engine.generate(batch, max_new_tokens=d.max_new_tokens, draft_len=0, eos_token_id=d.stop_ids,
                                sampling=Sampling(d.temperature, d.top_p, d.seed + b))
            dt = time.perf_counter() - t0
            for j, t in zip(idx, g.tokens, strict=True):
                results[j] = t
                answers.append(j, t)
            gen_s += dt
            generated += len(idx)
            new_tokens += sum(len(t) for t in g.tokens)
            width = max(len(p) for p in batch)
            padded += sum(width - len(p) for p in batch)
            done += 1
            if progress:
                bar.update(len(idx), tok_s=f"{new_tokens / gen_s:.1f}" if gen_s else "-")
            if on_batch is not None:
                on_batch(done)
    return {"load_s": load_s, "gen_s": gen_s, "new_tokens": new_tokens, "padded": padded, "generated": generated}


LOOP_MIN_SPAN = 12      # tokens a repeat must cover to count as a loop (indentation or a short ruler is not one)
LOOP_MAX_PERIOD = 32    # longest repeated segment looked for, in tokens


def loop_onset(ids: list[int]) -> int | None:
    """Where a response falls into a loop, the way small targets' greedy answers do ("The film was nominated for the
    award. The film was nominated for the award. ..."): the end of the second copy of the first segment of at most
    LOOP_MAX_PERIOD tokens that repeats back to back at least 3 times over at least LOOP_MIN_SPAN tokens; None when
    the response never loops."""
    for i in range(3, len(ids) + 1):
        for p in range(1, min(LOOP_MAX_PERIOD, i // 3) + 1):
            if ids[i - 1] != ids[i - 1 - p]:
                continue
            c = max(3, -(-LOOP_MIN_SPAN // p))
            if c * p <= i and all(ids[i - (j + 1) * p: i - j * p] == ids[i - p: i] for j in range(1, c)):
                return i - (c - 2) * p       # the loop's start + two copies of its segment
    return None


def regenerated_rows(jobs: list[RegenJob], gens: list[list[int]], cut_loops: bool = False
                     ) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """prompt ids + generated ids exactly as the target produced them; loss on the generated ids (end of turn
    included). With `cut_loops` a response that loops ends after two copies of its repeated segment (`loop_onset`).
    Returns (rows, {"looping": responses that loop, "loop_tokens_cut": tokens dropped})."""
    rows, looping, cut = [], 0, 0
    for j, g in zip(jobs, gens, strict=True):
        end = loop_onset(g)
        looping += end is not None
        if cut_loops and end is not None:
            cut += len(g) - end
            g = g[:end]
        rows.append((j.prompt + g, [0] * len(j.prompt) + [1] * len(g)))
    return rows, {"looping": looping, "loop_tokens_cut": cut}


def template_consistency(r, tok, jobs: list[RegenJob], gens: list[list[int]], eot_id: int | None) -> dict:
    """For responses that ended at the template's end of turn: does the template, rendering the conversation with
    the decoded response as the assistant turn, give exactly this sample (ids and mask, up to the end of turn)?
    A mismatch is not an error (a model may emit a non-canonical tokenization); it is counted and shown."""
    from runtime.text.chat_template import ChatTemplateError

    checked, same, first = 0, 0, None
    for j, g in zip(jobs, gens, strict=True):
        if j.context is None or eot_id is None or not g or g[-1] != eot_id:
            continue
        checked += 1
        content = tok.decode(g[:-1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        row = j.prompt + g
        try:
            ids, mask = r.encode([*j.context, {"role": "assistant", "content": content}])
            ok = ids[: len(row)] == row and mask[: len(row)] == [0] * len(j.prompt) + [1] * len(g)
        except ChatTemplateError:
            ok = False
        same += ok
        if not ok and first is None:
            first = j.sample.origin
    return {"checked": checked, "consistent": same, "first_inconsistent": first}


def log_outcome(log, rs: dict) -> None:
    """The data stage's log lines on a finished regeneration (`rs`: its statistics, with the template consistency and
    the loops): throughput, how responses ended, template consistency, loops."""
    log.info("regeneration: %d prompts, %d resumed from scratch, %d generated in %.1fs: %s prompts/s, %s new tokens/s; "
             "mean %.1f new tokens per response; %d ended at a stop id, %d hit max_new_tokens=%d; prefill padding %.1f%%",
             rs["prompts"], rs["resumed_prompts"], rs["generated_prompts"], rs["seconds"], rs["prompts_per_s"],
             rs["new_tokens_per_s"], rs["mean_new_tokens"], rs["ended_at_stop"], rs["hit_max_new_tokens"],
             rs["max_new_tokens"], 100 * rs["prefill_padding_fraction"])
    if (t := rs.get("template")) and t["checked"]:
        (log.info if t["consistent"] == t["checked"] else log.warning)(
            "regeneration: %d of %d responses that ended at the end of turn are exactly what the chat template renders for "
            "that assistant turn%s", t["consistent"], t["checked"],
            "" if t["consistent"] == t["checked"] else
            f" (first that is not: {t['first_inconsistent']}; the sample keeps the target's own tokens)")
    log.info("regeneration: %d of %d responses fall into a loop (a segment of <= %d tokens repeated 3+ times back to back)%s",
             rs["looping"], rs["prompts"], LOOP_MAX_PERIOD,
             f"; cut after its second copy: {rs['loop_tokens_cut']} tokens dropped" if rs["cut_loops"] else
             "; kept (data.regenerate.cut_loops: false)")


def answered_only(train_jobs: list, held_jobs: list, gens: list) -> tuple[list, list, list]:
    """The train and held-out jobs and answers without the prompts a server engine failed (answer None, allowed by
    data.regenerate.max_failed_fraction)."""
    if all(g is not None for g in gens):
        return train_jobs, held_jobs, gens
    nt = len(train_jobs)
    keep = [g is not None for g in gens]
    return ([j for j, k in zip(train_jobs, keep[:nt], strict=True) if k],
            [j for j, k in zip(held_jobs, keep[nt:], strict=True) if k], [g for g in gens if g is not None])


def report_rows(g: dict) -> list[list]:
    """The report's regeneration table (stats.json["regeneration"] `g`): engine, throughput, how answers ended, and for
    the server engines the endpoints, retries and failures."""
    rows = [["engine", f"{g['engine']} ({g.get('engine_why', '')})"],
            *([["vLLM's dtype", f"{g['engine_dtype']} ({g.get('engine_dtype_why')})"]] if "engine_dtype" in g else []),
            ["prompts (resumed)", f"{g['prompts']} ({g['resumed_prompts']})"], ["seconds", g["seconds"]],
            ["prompts/s", g["prompts_per_s"]], ["new tokens/s", g["new_tokens_per_s"]],
            ["mean new tokens", g["mean_new_tokens"]], ["ended at a stop id", g["ended_at_stop"]],
            ["hit max_new_tokens", f"{g['hit_max_new_tokens']} (max {g['max_new_tokens']})"],
            ["long prompts skipped", g.get("skipped_long_prompts")], ["responses that loop", g.get("looping")]]
    if g.get("endpoints"):
        rows += [["endpoints", ", ".join(f"{u} ({c['answered']} answered, {c['failed_attempts']} failed attempts)"
                                         for u, c in g["endpoints"].items())],
                 ["requests in flight", g.get("concurrency")], ["retried requests", g.get("retried_requests")],
                 ["failed prompts (left out)", f"{g.get('failed_prompts')} (allowed: max_failed_fraction "
                                               f"{g.get('max_failed_fraction')})"]]
        if g.get("failed_prompts"):
            rows.append(["last error", g.get("last_error")])
    if g.get("template"):
        rows.append(["equal to the template's rendering", f"{g['template']['consistent']} of {g['template']['checked']}"])
    return rows
