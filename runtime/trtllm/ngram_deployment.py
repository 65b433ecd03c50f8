"""TensorRT-LLM's n-gram (prompt-lookup) deployment: the LLM-API options of the target with an `NGramDecodingConfig`
speculative_config instead of the trained draft's (`build.ngram`).

Fields (TensorRT-LLM 1.2.1 `tensorrt_llm/llmapi/llm_args.py`, `NGramDecodingConfig` before the suffix-automaton
rework, as packaged in runtime/trtllm/schemas/ from ../shared/reference/schemas/): decoding_type "NGram",
max_draft_len, max_matching_ngram_size (TorchLlmArgs requires both > 0), is_keep_all, is_use_oldest, is_public_pool
(PyTorch backend only). The drafter (`tensorrt_llm/_torch/speculative/ngram.py`, commit
0249976575050d2c624a5f285683c66de311a3b7) matches pattern sizes max_matching_ngram_size down to 1, so specpipe's
max_n maps to max_matching_ngram_size and its min_n has no TensorRT-LLM field (1 there); is_public_pool: false
keeps each request's pool to its own context, which is what prompt lookup (and vLLM's ngram) does;
is_use_oldest: true proposes the earliest match, as vLLM's rule does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.algorithms import ngram
from runtime.trtllm.schema import unknown_keys

if TYPE_CHECKING:
    from runtime.records_validate import AcceptanceInfo


def ngram_speculative_config(k: int, max_n: int) -> dict:
    if probs := ngram.check_export({"k": k, "min_n": ngram.TRTLLM_MIN_N, "max_n": max_n}, "NGram speculative_config"):
        raise ValueError("; ".join(p.message for p in probs))
    return {"decoding_type": ngram.NGRAM.trtllm_decoding_type, "max_draft_len": k, "max_matching_ngram_size": max_n,
            "is_keep_all": True, "is_use_oldest": True, "is_public_pool": False}


def ngram_options(base: dict, k: int, max_n: int, version: str) -> dict:
    """`base` (the deployment's LLM-API options) with the n-gram speculative_config; ValueError naming any key
    `version` does not know."""
    opts = {key: v for key, v in base.items() if key != "speculative_config"}
    opts["speculative_config"] = ngram_speculative_config(k, max_n)
    if bad := unknown_keys(opts, version):
        raise ValueError(f"n-gram LLM-API options: keys TensorRT-LLM {version} does not know: {', '.join(bad)}")
    return opts


def resolve(want: dict, measured: dict | None, fallback_k: int) -> tuple[dict, str]:
    """The deployed n-gram settings {k, min_n, max_n}: `want`'s (build.ngram) where set, else what validate
    measured (acceptance.json "ngram"), else k = `fallback_k` and n 1..4. Returns (settings, where they came from)."""
    m = measured or {}
    out = {"k": want.get("k") or m.get("k") or fallback_k, "min_n": want.get("min_n") or m.get("min_n") or 1,
           "max_n": want.get("max_n") or m.get("max_n") or 4}
    src = "validate's measurement" if m else "defaults (validate did not measure n-gram drafting)"
    return out, ("build.ngram" if all(want.get(x) for x in out) else src)


def winners(comparison: dict | None) -> list[str]:
    """The domains on which validate measured n-gram drafting paying more than the trained draft (on AL)."""
    return sorted(d for d, c in (comparison or {}).items() if d != "overall" and c.get("pays_more") == "ngram")


def write_ngram(out, base_options: dict, version: str, target_dir, settings: dict, comparison: dict | None,
                vllm_python: str | None) -> dict:
    """deployment/ngram/: llm_api_options.yaml + serve_trtllm.sh (TensorRT-LLM), vllm_speculative_config.json +
    serve_vllm.sh (vLLM), README.md. Every key is checked (TensorRT-LLM: the version's field list; vLLM: the
    fields of vLLM 0.32.0's SpeculativeConfig, and the installed vLLM's when `vllm_python` is given).
    Returns the doc for deployment.json."""
    import json
    import shlex

    from runtime.trtllm import commands as C
    from runtime.trtllm.options import options_yaml
    from runtime.vllm import ngram_config as VN

    out.mkdir(parents=True, exist_ok=True)
    k, lo, hi = settings["k"], settings["min_n"], settings["max_n"]
    opts = ngram_options(base_options, k, hi, version)
    (out / "llm_api_options.yaml").write_text(options_yaml(opts, version))
    C.write_script(out / "serve_trtllm.sh", C.serve_command(target_dir))
    sc = VN.speculative_config(k, lo, hi)
    checked = VN.check_with_vllm(vllm_python, sc) if vllm_python else None
    if checked and (checked["unknown"] or not checked["ngram_method"]):
        raise ValueError(f"vLLM's SpeculativeConfig does not take {checked}")
    (out / "vllm_speculative_config.json").write_text(json.dumps(sc, indent=2) + "\n")
    C.write_script(out / "serve_vllm.sh", C._PREAMBLE + "exec vllm serve " + shlex.quote(str(target_dir))
                   + ' --speculative-config "$(cat "$HERE/vllm_speculative_config.json")" "$@"\n')
    wins = winners(comparison)
    doc = {"dir": "deployment/ngram", "settings": settings, "trtllm_speculative_config": opts["speculative_config"],
           "vllm_speculative_config": sc, "vllm_checked_against_installed": checked is not None,
           "ngram_pays_more_on": wins, "comparison": comparison}
    (out / "README.md").write_text(_readme(doc, version))
    return doc


def _readme(doc: dict, version: str) -> str:
    s = doc["settings"]
    lines = ["# n-gram (prompt-lookup) deployment of the target (no draft model), written by specpipe build\n",
             f"k = {s['k']} draft tokens per step, n-grams of {s['min_n']}..{s['max_n']} tokens.\n",
             f"- TensorRT-LLM {version}: `serve_trtllm.sh` (llm_api_options.yaml, NGramDecodingConfig: "
             f"max_matching_ngram_size = {s['max_n']}; TensorRT-LLM matches down to 1 token, it has no minimum)",
             "- vLLM: `serve_vllm.sh` (vllm_speculative_config.json, method ngram)\n",
             "validate measured, per domain, on the deployed target with the same prompts (AL = tokens per step):\n",
             "| domain | AL trained draft | AL n-gram | pays more |", "|---|---|---|---|"]
    for d, c in (doc["comparison"] or {}).items():
        lines.append(f"| {d} | {c['trained']['acceptance_length']} | {c['ngram']['acceptance_length']} | {c['pays_more']} |")
    if not doc["comparison"]:
        lines.append("| (not measured: validate.ngram.enabled was false) | | | |")
    lines.append("\nn-gram pays more on: " + (", ".join(doc["ngram_pays_more_on"]) or "no domain") + ".\n")
    return "\n".join(lines)


def deploy(out, base_options: dict, version: str, target_dir, want: dict, acceptance: AcceptanceInfo, fallback_k: int,
           log) -> dict:
    """What build runs for `build.ngram.enabled`: the settings (`resolve`), vLLM's environment when installed (its
    SpeculativeConfig checks the written keys), `write_ngram`. Returns the deployment.json entry."""
    from runtime.vllm import engine as E

    measured = acceptance.ngram
    settings, src = resolve(want, measured, fallback_k)
    try:
        py = E.find_vllm().python
    except E.VllmUnavailable:
        py = None
        log.info("ngram: vLLM is not installed here; its speculative_config is checked against vLLM 0.32.0's field "
                 "names only")
    doc = write_ngram(out, base_options, version, target_dir, settings, (measured or {}).get("comparison"),
                      str(py) if py else None)
    doc["settings_from"] = src
    log.info("ngram deployment (%s): k %d, n %d..%d; n-gram pays more than the trained draft on: %s", src,
             settings["k"], settings["min_n"], settings["max_n"], ", ".join(doc["ngram_pays_more_on"]) or "no domain")
    return doc
