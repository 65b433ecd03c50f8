"""deployment/README.md of the build stage: what was deployed for which TensorRT-LLM version and container,
the draft length per batch size, the checks, how to run it; written from deployment.json and the options."""
from __future__ import annotations

import shlex

from runtime.algorithms.schedule import DraftSchedule
from runtime.trtllm import compat
from runtime.trtllm.options import dump_yaml


def readme(doc: dict, options: dict) -> str:
    rows = "\n".join(f"| `{c['name']}` | {'ok' if c['ok'] else 'FAILED'} | {c['message']} |" for c in doc["checks"])
    spec = _deployment_lines(doc)
    bench = (f"{doc['bench_requests']} requests ({doc['bench_prompts']} eval prompts, repeated) at concurrency "
             f"{doc['bench_concurrency']}")
    return f"""# TensorRT-LLM deployment (written by specpipe build)

- TensorRT-LLM **{doc['trtllm_version']}**, PyTorch backend (LLM API); container: `{doc['serving_image']}`
{spec}
- loaded here: {'yes' if doc['load']['loaded'] else 'no — ' + doc['load']['reason']}

There is no engine build for EAGLE-3/DFlash: `LLM(...)` loads the checkpoint pair with these options and
captures CUDA graphs / autotunes kernels at startup.

## Run
```bash
./serve.sh                      # OpenAI-compatible server on ${{HOST:-127.0.0.1}}:${{PORT:-8000}}
./bench.sh                      # trtllm-bench throughput: {bench}
```
The bench dataset repeats the evaluation prompts so that it holds at least `build.bench.rounds` x the
concurrency; with KV block reuse on, a repeated prompt's prefill is served from cached blocks (decode
throughput and acceptance are unaffected).

In the container, mount the run directory at the same absolute path (the scripts and the options name the
checkpoints by absolute path):
```bash
docker run --gpus all --rm -it --ipc=host -p 8000:8000 -e HOST=0.0.0.0 \\
  -v {shlex.quote(doc['workdir'])}:{shlex.quote(doc['workdir'])} {doc['serving_image']} \\
  {shlex.quote(doc['workdir'] + '/artifacts/build/deployment/serve.sh')}
```
`trtllm-bench` prints a `DECODING STATISTICS` block (acceptance length `[AL]`, draft acceptance rate `[DAR]`).

## llm_api_options.yaml
```yaml
{dump_yaml(options).rstrip()}
```

## Consistency checks
| check | result | detail |
|---|---|---|
{rows}
"""


def _deployment_lines(doc: dict) -> str:
    """The README's lines on what is deployed: the speculative pair and its draft length per batch size, or the
    target alone and why."""
    if not doc["speculation"]:
        return f"""- **no speculative decoding**: `tune` predicted no speedup from any draft length at any batch size
  ({doc['schedule_note'] or 'see tuning.json'}), so the FP8 target is deployed alone and no draft is loaded.
- FP8 target: `{doc['target_dir']}`"""
    runs = DraftSchedule.from_json(doc["draft_schedule"]).bounded(doc["max_batch_size"])
    table = "\n".join(f"| {lo}-{hi} | {k if k else '0 (speculation off)'} |" for lo, hi, k in runs)
    mode = doc['mode'].replace('_', '-')
    copy = (' (a copy of `' + doc['draft_dir'] + '` with ' + str(doc['draft_weight_names']['renamed'])
            + ' tensors renamed `layers.<i>.*` -> `midlayer.*`: TensorRT-LLM ' + doc['trtllm_version']
            + "'s EAGLE-3 loader reads only the module's own names)") if doc['draft_weight_names'] else ''
    capture = ('- `eagle3_layers_to_capture`: ' + str(doc['eagle3_layers_to_capture'])
               + " (the target layers the draft was trained on; TensorRT-LLM does not read them from the draft's "
               "config)") if doc['eagle3_layers_to_capture'] else ''
    guard = ('Acceptance guard: `' + str(doc['acceptance_guard']) + '`.') if doc['acceptance_guard'] \
        else (doc['acceptance_guard_note'] or '')
    return f"""- speculative decoding: `{doc['decoding_type']}` ({mode}), max_draft_len {doc['max_draft_len']}
- FP8 target: `{doc['target_dir']}`
- draft TensorRT-LLM loads: `{doc['trtllm_draft_dir']}`{copy}
{capture}

### Draft length per batch size (what TensorRT-LLM {doc['trtllm_version']} runs with these options)
{_schedule_support(doc)}

| batch size | draft tokens per step |
|---|---|
{table}

{doc['schedule_note'] or ''}
{guard}"""


def _schedule_support(doc: dict) -> str:
    rel = compat.release(doc["trtllm_version"])
    mode = doc["mode"]
    if mode not in rel.per_batch_draft_len:
        return (f"TensorRT-LLM {doc['trtllm_version']} in {mode.replace('_', '-')} mode uses one draft length at every "
                "batch size: it applies draft_len_schedule / max_concurrency only with a two-model drafter "
                "(build.eagle3_mode: two_model), so none is written.")
    zero = "" if mode in rel.zero_draft_len_ok else (" A draft length of 0 is never written in one-engine mode "
                                                      "(TensorRT-LLM PR #16888: acceptance collapses after speculation resumes).")
    return (f"TensorRT-LLM {doc['trtllm_version']} in {mode.replace('_', '-')} mode applies the draft length per batch "
            f"size ({rel.schedule_semantics.replace('_', ' ')} schedule keys).{zero}")
