"""The trtllm-serve / trtllm-bench command files of a deployment and trtllm-bench's dataset.

serve.sh and bench.sh name the checkpoints by shell-quoted absolute path and find llm_api_options.yaml beside
themselves; bench_dataset.jsonl is in trtllm-bench's request format.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

_PREAMBLE = ('#!/usr/bin/env bash\n# Written by specpipe build. Paths are shell-quoted; this file can be run from anywhere.\n'
             'set -euo pipefail\nHERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n')


def serve_command(target_dir: Path) -> str:
    return (_PREAMBLE + 'exec trtllm-serve ' + shlex.quote(str(target_dir)) + ' \\\n'
            '  --backend pytorch --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" \\\n'
            '  --extra_llm_api_options "$HERE/llm_api_options.yaml" "$@"\n')


def bench_command(model_name: str, target_dir: Path, concurrency: int) -> str:
    return (_PREAMBLE + 'exec trtllm-bench --model ' + shlex.quote(model_name) + ' --model_path '
            + shlex.quote(str(target_dir)) + ' \\\n'
            '  throughput --backend pytorch --dataset "$HERE/bench_dataset.jsonl" \\\n'
            '  --extra_llm_api_options "$HERE/llm_api_options.yaml" \\\n'
            f'  --concurrency {int(concurrency)} --report_json "${{REPORT:-$HERE/bench_report.json}}" "$@"\n')


def write_script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def bench_model_name(tcfg: dict, workdir: Path) -> str:
    """trtllm-bench wants a model *name* (it rejects paths; the checkpoint goes to --model_path)."""
    name = tcfg.get("_name_or_path") or ""
    return name if name and not Path(name).exists() and "/" in name else f"specpipe/{Path(workdir).resolve().name}-target"


def write_bench_dataset(prompts: list, path: Path, output_tokens: int, min_requests: int) -> tuple[int, int]:
    """trtllm-bench's dataset format (tensorrt_llm/bench/dataclasses/general.py InferenceRequest): every eval
    prompt, then the prompts again in order until the dataset holds `min_requests` requests (bench.rounds x the
    concurrency measured: a run with fewer requests than its concurrency never reaches that batch size).
    `prompts`: (eval prompt with `.prompt` and `.prompt_ids`, its domain) pairs. Returns (distinct prompts, requests)."""
    n = max(len(prompts), int(min_requests))
    with open(path, "w") as f:
        for i in range(n):
            p, cat = prompts[i % len(prompts)]
            f.write(json.dumps({"task_id": i, "prompt": p.prompt, "input_ids": p.prompt_ids,
                                "output_tokens": output_tokens, "category": cat}) + "\n")
    return len(prompts), n
