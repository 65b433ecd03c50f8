"""launch.sh of the production Triton repository (written by `export`): the container's entrypoint.

What it does before the server starts, and how it starts it, from upstream source (NVIDIA/TensorRT-LLM unless named):
- The preflight. The LLM-API model (triton_backend/all_models/llmapi/tensorrt_llm/1/model.py, stored
  044a90d209e380c95e23e8ae42f3583fa05ada78) imports `tensorrt_llm` (LLM, SamplingParams), `tensorrt_llm.llmapi.llm`
  and `tensorrt_llm.llmapi.llm_utils` in `initialize`, i.e. only once Triton loads the model: a broken import shows
  up as a model that fails to load inside a running server. `tensorrt_llm/serve/responses_utils.py` (stored
  02238b67ef3a25ae4d8c50d5f1942ddee2f8f00b) imports `PartReasoningText` from
  `openai.types.responses.response_content_part_added_event`, which openai-python added in d296d85884ca ("feat(api):
  add reasoning_text", 2025-09-19), first released in v1.108.1 (v1.107.3 and v1.108.0 lack it; tags read in
  openai/openai-python). NVIDIA's 26.07 tutorial (triton-inference-server/tutorials
  Popular_Models_Guide/Qwen2.5-VL/qwen2_5_vl_trtllm_guide.md, stored 9511717dc28753922ce5125b36ea1ded031a7a3f)
  says the image's openai "is too old for `tensorrt_llm.serve`" and upgrades it before loading a model (which
  version the image ships is not stated there: unknown here). So launch.sh imports that name and the model's
  imports with the container's python first, and exits 3 naming the fix when one fails.
- trtllm-llmapi-launch. With one GPU the LLM API still runs its worker in another process: `GenerationExecutor.create`
  passes `mpi_session=None` for the single-GPU case and `ExecutorBindingsProxy.__init__`
  (tensorrt_llm/executor/proxy.py, stored 005bc848893f575ec14b45d6b13139360d67c790) then creates an
  `MpiPoolSession` (mpi4py's MPIPoolExecutor: MPI_Comm_spawn) unless TLLM_SPAWN_PROXY_PROCESS=1, in which case
  `create_mpi_comm_session` binds to already-running MPI processes. `trtllm-llmapi-launch`
  (tensorrt_llm/llmapi/trtllm-llmapi-launch, stored 020c89e64e49f24102f1b62be96a1a68283cdf7a) exports
  TLLM_SPAWN_PROXY_PROCESS=1 and its IPC address, runs the command on rank 0 with the MPI environment removed and
  `python3 -m tensorrt_llm.llmapi.mgmn_leader_node` beside it; ranks > 0 (under `mpirun -n N`) run
  `mgmn_worker_node`. So where the binary exists launch.sh starts `trtllm-llmapi-launch tritonserver ...`
  (tensor_parallel_size 1) or `mpirun -n TP trtllm-llmapi-launch tritonserver ...` (TP > 1), as the 26.07 tutorial
  does for one GPU; without it, plain tritonserver, and the spawn needs an MPI that supports MPI_Comm_spawn.
  WORLD_SIZE > 1 (one Triton rank per GPU, launch_triton_server.py's form) keeps mpirun with one tritonserver per
  rank: model.py then passes `MpiCommSession(COMM_WORLD)` itself (global_mpi_size() > 1), no spawn.
Not run here (no GPU, no TensorRT-LLM): tests/integration/test_triton_launch.py checks the commands, the preflight with
real pythons and a FAKE tensorrt_llm package, and the exec with the real (CPU) Triton server."""
from __future__ import annotations

import shlex

# openai-python's first release with openai.types.responses.response_content_part_added_event.PartReasoningText
OPENAI_MIN = "1.108.1"
OPENAI_NAME = ("openai.types.responses.response_content_part_added_event", "PartReasoningText")
# what the LLM-API model.py imports in initialize (stored 044a90d2)
MODEL_IMPORTS = ("tensorrt_llm", "tensorrt_llm.llmapi.llm", "tensorrt_llm.llmapi.llm_utils")


def preflight_py() -> str:
    """The python the preflight runs: the openai name first (its own fix), then the model's imports."""
    mod, name = OPENAI_NAME
    return f"""import importlib, sys
try:
    getattr(importlib.import_module({mod!r}), {name!r})
except (ImportError, AttributeError) as e:
    try:
        import openai
        have = openai.__version__
    except ImportError:
        have = "not installed"
    sys.exit(f"preflight: openai ({{have}}) lacks {mod}.{name}, which TensorRT-LLM's serve path "
             f"(tensorrt_llm/serve/responses_utils.py) imports ({{type(e).__name__}}: {{e}}). Fix: "
             f"pip install 'openai>={OPENAI_MIN}' in the image (containers/serve.Dockerfile does), then restart")
for m in {MODEL_IMPORTS!r}:
    try:
        importlib.import_module(m)
    except Exception as e:
        sys.exit(f"preflight: the LLM-API model imports {{m}}, which fails: {{type(e).__name__}}: {{e}}. Fix the "
                 "image's python environment (the model would fail to load inside a running server)")
print("preflight: openai and the LLM-API model's imports load")
"""


def launch_sh(container_path: str, model_name: str, tensor_parallel_size: int = 1) -> str:
    """The container's entrypoint: the preflight, then the tritonserver command TensorRT-LLM's
    triton_backend/scripts/launch_triton_server.py builds (get_cmd; stored versions 0a2e2c1f1268b34586393794045691b666ba28be
    and 0b06796b2c7895930fecff48a1e205ab14a19c51 build the same command: per rank `--model-repository`, the three
    ports, ranks > 0 `--model-control-mode=explicit --load-model=<model>`, `--disable-auto-complete-config`,
    `--backend-config=python,shm-region-prefix-name=prefix<rank>_`), exec'd (that script ends in
    `subprocess.Popen(cmd, env=env)` without waiting, so as a container's main process it returns at once), under
    trtllm-llmapi-launch where the image has it (module docstring)."""
    subs = {"@CONTAINER_PATH@": container_path, "@REPO@": shlex.quote(container_path), "@NAME@": shlex.quote(model_name),
            "@TP@": str(int(tensor_parallel_size)), "@PREFLIGHT@": preflight_py()}
    out = _SCRIPT
    for k, v in subs.items():
        out = out.replace(k, v)
    return out


_SCRIPT = r"""#!/usr/bin/env bash
# Runs INSIDE a tritonserver:<yy.mm>-trtllm-python-py3 container with this directory mounted at @CONTAINER_PATH@
# (or at $SPECPIPE_REPO). The container ships the LLM-API model code; this assembles a serving copy of the
# repository with it (the mount stays read-only), checks that the model's python imports load (the preflight:
# exit 3 naming the fix, before any server starts), then REPLACES ITSELF with the server (exec): the container's
# main process is the server's launcher and lives exactly as long as the server.
# The flags are those of the container's /app/scripts/launch_triton_server.py; that script is not used because it
# starts the server in the background (subprocess.Popen) and returns, which would end the container at once.
# Where trtllm-llmapi-launch exists the server runs under it (the LLM API then binds its worker to the launcher's MPI
# processes instead of spawning one with MPI_Comm_spawn); `mpirun -n TP_SIZE` around it for tensor_parallel_size > 1.
# Environment: HTTP_PORT / GRPC_PORT / METRICS_PORT (8000 / 8001 / 8002), WORLD_SIZE (1: one Triton rank; > 1: one
# Triton rank per GPU under mpirun, without trtllm-llmapi-launch), TP_SIZE (model.yaml's tensor_parallel_size,
# @TP@), LLMAPI_LAUNCH (trtllm-llmapi-launch; "none": plain tritonserver), PYTHON (python3),
# SPECPIPE_PREFLIGHT (off: skip the preflight), TRITONSERVER, SERVE_REPO. Extra arguments go to tritonserver.
set -euo pipefail
SRC="${LLMAPI_MODEL_DIR:-/app/all_models/llmapi/tensorrt_llm/1}"
REPO="${SPECPIPE_REPO:-@REPO@}"
SERVE="${SERVE_REPO:-/tmp/specpipe_model_repo}"
TRITONSERVER="${TRITONSERVER:-/opt/tritonserver/bin/tritonserver}"
WORLD_SIZE="${WORLD_SIZE:-1}"
TP_SIZE="${TP_SIZE:-@TP@}"
LLMAPI_LAUNCH="${LLMAPI_LAUNCH:-trtllm-llmapi-launch}"
[ -f "$SRC/model.py" ] || { echo "no $SRC/model.py: is this a *-trtllm-python-py3 image?" >&2; exit 1; }
[ -f "$REPO"/@NAME@/config.pbtxt ] || { echo "no $REPO/@NAME@/config.pbtxt: mount the exported triton/ there" >&2; exit 2; }
[[ "$WORLD_SIZE" =~ ^[1-9][0-9]*$ ]] || { echo "WORLD_SIZE must be a positive integer, not '$WORLD_SIZE'" >&2; exit 2; }
[[ "$TP_SIZE" =~ ^[1-9][0-9]*$ ]] || { echo "TP_SIZE must be a positive integer, not '$TP_SIZE'" >&2; exit 2; }
if [ "${SPECPIPE_PREFLIGHT:-on}" != off ]; then
  "${PYTHON:-python3}" - <<'PREFLIGHT' || { echo "launch.sh: preflight failed; tritonserver not started" >&2; exit 3; }
@PREFLIGHT@PREFLIGHT
fi
mkdir -p "$SERVE"/@NAME@/1
ln -sf "$REPO"/@NAME@/config.pbtxt "$SERVE"/@NAME@/config.pbtxt
ln -sf "$REPO"/@NAME@/1/model.yaml "$SERVE"/@NAME@/1/model.yaml
cp "$SRC/model.py" "$SRC/helpers.py" "$SERVE"/@NAME@/1/
rank_args() {   # launch_triton_server.py's flags for rank $1
  ARGS=("--model-repository=$SERVE" "--grpc-port=${GRPC_PORT:-8001}" "--http-port=${HTTP_PORT:-8000}"
        "--metrics-port=${METRICS_PORT:-8002}")
  [ "$1" = 0 ] || ARGS+=(--model-control-mode=explicit --load-model=@NAME@)
  ARGS+=(--disable-auto-complete-config "--backend-config=python,shm-region-prefix-name=prefix$1_")
}
if [ "$WORLD_SIZE" = 1 ]; then
  rank_args 0
  if [ "$LLMAPI_LAUNCH" != none ] && command -v "$LLMAPI_LAUNCH" >/dev/null; then
    [ "$TP_SIZE" = 1 ] && exec "$LLMAPI_LAUNCH" "$TRITONSERVER" "${ARGS[@]}" "$@"
    exec mpirun --allow-run-as-root -n "$TP_SIZE" "$LLMAPI_LAUNCH" "$TRITONSERVER" "${ARGS[@]}" "$@"
  fi
  [ "$LLMAPI_LAUNCH" = none ] || echo "launch.sh: no $LLMAPI_LAUNCH in this image: plain tritonserver (the LLM API" \
    "spawns its worker with MPI_Comm_spawn)" >&2
  exec "$TRITONSERVER" "${ARGS[@]}" "$@"
fi
CMD=(mpirun --allow-run-as-root)
for ((r = 0; r < WORLD_SIZE; r++)); do
  [ "$r" = 0 ] || CMD+=(:)
  rank_args "$r"
  CMD+=(-n 1 "$TRITONSERVER" "${ARGS[@]}" "$@")
done
exec "${CMD[@]}"
"""
