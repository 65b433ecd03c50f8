"""validate's gates (acceptance.json `gates`, as runtime/records_validate.py's `Gates` of `GateRow`s) and their table,
and the lossless check in a few numbers (stage metrics): pure functions over the measurement dictionaries of
runtime/validate."""
from __future__ import annotations

from runtime.records_validate import GateRow, Gates


def evaluate_gates(res: dict, g) -> Gates:
    """The gate rows of a measurement `res` (acceptance.json's domains, overall, lossless, engines) against `g` (the
    `validate.gates` section: min_acceptance_length (one value or per domain), min_overall_acceptance_length,
    min_retention, require_lossless)."""
    rows = []
    per = g.min_acceptance_length
    for d, v in res["domains"].items():
        req = per.get(d) if isinstance(per, dict) else per
        if req is not None:
            m = v["fp8"]["acceptance_length"]
            rows.append(GateRow(d, "acceptance_length", m, req, m >= req))
        if g.min_retention is not None and v.get("retention") is not None:
            rows.append(GateRow(d, "retention", v["retention"], g.min_retention, v["retention"] >= g.min_retention))
    if g.min_overall_acceptance_length is not None:
        m = res["overall"]["fp8"]["acceptance_length"]
        rows.append(GateRow("overall", "acceptance_length", m, g.min_overall_acceptance_length,
                            m >= g.min_overall_acceptance_length))
    if g.min_retention is not None and res["overall"].get("retention") is not None:
        r = res["overall"]["retention"]
        rows.append(GateRow("overall", "retention", r, g.min_retention, r >= g.min_retention))
    if g.require_lossless:
        rows += [GateRow.from_json(r) for r in lossless_rows(res.get("lossless") or {})]
    rows += [GateRow.from_json(r) for r in ((res.get("engines") or {}).get("vllm") or {}).get("gate_rows", [])]
    return Gates.of(rows)


def lossless_summary(ll: dict) -> dict:
    """The lossless check in a few numbers, each part with what it measured and what it required (stage
    metrics, so `status --json` shows the statistic and its threshold)."""
    out: dict = {"passed": ll.get("passed")}
    if ex := ll.get("exact"):
        out["exact"] = {k: ex.get(k) for k in ("pair", "passed", "compared_prompts", "generated_tokens", "differ",
                                               "numerical_ties", "tie_margin")}
    if inv := ll.get("invariant"):
        out["invariant"] = {"passed": inv.get("passed"),
                            **{p: {k: v.get(k) for k in ("rows_checked", "forwards", "violations", "by_kind")}
                               for p, v in inv.get("pairs", {}).items()}}
    if st := ll.get("statistical"):
        out["statistical"] = {k: st.get(k) for k in ("pair", "statistic", "reference", "threshold", "test", "passed",
                                                     "p_value", "ratio", "alpha")}
        out["statistical"]["rate_speculative"] = st["speculative"]["rate_per_token"]
        out["statistical"]["rate_noise"] = st["noise"]["pooled"]["rate_per_token"]
        out["statistical"]["share_diverging_speculative"] = st["speculative"]["share_diverging"]
        out["statistical"]["share_diverging_noise"] = st["noise"]["pooled"]["share_diverging"]
    return out


def lossless_rows(ll: dict) -> list[dict]:
    """One gate row per part of the lossless check that ran."""
    rows = []
    ex = ll.get("exact")
    if ex and ex.get("passed") is not None:
        m = "identical" if ex.get("identical") else (f"{ex['differ']} differ" if ex["differ"] else
                                                     f"{ex['numerical_ties']} fp32 ties")
        rows.append({"domain": "unquantized", "metric": "lossless_exact", "measured": m,
                     "required": f"identical (ties < {ex['tie_margin']:g})", "passed": ex["passed"]})
    inv = ll.get("invariant")
    if inv and inv.get("pairs"):
        n = sum(v["violations"] for v in inv["pairs"].values())
        rows_checked = sum(v["rows_checked"] for v in inv["pairs"].values())
        rows.append({"domain": "all runs", "metric": "acceptance_rule", "measured": f"{n} of {rows_checked} rows",
                     "required": "0 violations", "passed": inv["passed"]})
    st = ll.get("statistical")
    if st and st.get("passed") is not None:
        rows.append({"domain": "deployed", "metric": "divergence_rate",
                     "measured": f"{st['speculative']['rate_per_token']:.4f} vs {st['noise']['pooled']['rate_per_token']:.4f} "
                                 f"noise, p={st['p_value']:.3g}",
                     "required": f"<= {st['ratio']:g}x noise at p>={st['alpha']:g}", "passed": st["passed"]})
    return rows


def gate_table(rows: tuple[GateRow, ...] | list[GateRow]) -> str:
    if not rows:
        return "  (no gates configured)"
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    wm = max([10] + [len(fmt(r.measured)) for r in rows])
    wq = max([10] + [len(fmt(r.required)) for r in rows])
    wd = max([12] + [len(r.domain) for r in rows])
    head = f"  {'domain':<{wd}} {'metric':<18} {'measured':>{wm}}  {'required':>{wq}}  result"
    lines = [head, "  " + "-" * (len(head) - 2)]
    for r in rows:
        lines.append(f"  {r.domain:<{wd}} {r.metric:<18} {fmt(r.measured):>{wm}}  {fmt(r.required):>{wq}}  "
                     f"{'pass' if r.passed else 'FAIL'}")
    return "\n".join(lines)


def lossless_tables(ll: dict) -> list[tuple[list[list], list[str]]]:
    """The lossless check's report tables as (rows, header): the parts, and the statistical check's arms."""
    out = []
    rows = []
    if ex := ll.get("exact"):
        rows.append(["exact", f"{ex['pair']} pair (unquantized)", ex["rule"],
                     f"{ex['compared_prompts']} prompts, {ex['generated_tokens']} tokens: {ex['differ']} differ, "
                     f"{ex['numerical_ties']} fp32 ties", ex["passed"]])
    if inv := ll.get("invariant"):
        for p, v in inv.get("pairs", {}).items():
            kinds = ", ".join(f"{k}: {n}" for k, n in v["by_kind"].items()) or "none"
            rows.append(["acceptance rule", f"{p} pair, every run",
                         "each emitted token = the rule's choice from the same verification forward's logits; "
                         "each step verifies the last emitted token; cache advances by accepted + 1",
                         f"{v['rows_checked']} rows in {v['forwards']} forwards of {v['generations']} runs: "
                         f"{v['violations']} violations ({kinds})", v["passed"]])
    if st := ll.get("statistical"):
        s, nz = st["speculative"], st["noise"]["pooled"]
        rows.append(["statistical", f"{st['pair']} pair (deployed)", st["statistic"] + "; " + st["test"],
                     f"speculative {s['rate_per_token']:.4f}/token ({s['diverging']}/{s['prompts']} prompts) vs noise "
                     f"{nz['rate_per_token']:.4f}/token ({nz['diverging']}/{nz['prompts']}); p = {st['p_value']:.3g}, "
                     f"required {st['threshold']}", st["passed"]])
    if rows:
        out.append((rows, ["part", "on", "checks", "measured", "passed"]))
    if st := ll.get("statistical"):
        arms = [["speculative: " + st["speculative_arm"], st["speculative"]]] + \
               [[k, v] for k, v in st["noise"].items()]
        out.append(([[name, v["prompts"], v["diverging"], v["share_diverging"], v["exposure"], v["rate_per_token"],
                      "" if v.get("mean_first_divergence") is None else v["mean_first_divergence"]] for name, v in arms],
                    ["arm (vs " + st["reference"] + ")", "prompts", "diverging", "share", "tokens compared",
                     "divergences / token", "mean first divergence"]))
    return out
