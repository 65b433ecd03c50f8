"""launch.sh of the production Triton repository (written by `export`): the container's entrypoint."""
from __future__ import annotations

import shlex


def launch_sh(container_path: str, model_name: str) -> str:
    """The container's entrypoint. It runs the tritonserver command TensorRT-LLM's
    triton_backend/scripts/launch_triton_server.py builds (get_cmd; stored versions 0a2e2c1f1268b34586393794045691b666ba28be
    and 0b06796b2c7895930fecff48a1e205ab14a19c51 build the same command: per rank `--model-repository`, the three
    ports, ranks > 0 `--model-control-mode=explicit --load-model=<model>`, `--disable-auto-complete-config`,
    `--backend-config=python,shm-region-prefix-name=prefix<rank>_`), but exec's it: that script ends in
    `subprocess.Popen(cmd, env=env)` without waiting, so as a container's main process it returns at once and the
    container (and the server with it) stops. World size 1 exec's tritonserver itself (the script's `--no-mpi`
    command); a larger WORLD_SIZE exec's `mpirun -n 1 ... : -n 1 ...` in the foreground."""
    repo = shlex.quote(container_path)
    name = shlex.quote(model_name)
    return f"""#!/usr/bin/env bash
# Runs INSIDE a tritonserver:<yy.mm>-trtllm-python-py3 container with this directory mounted at {container_path}
# (or at $SPECPIPE_REPO). The container ships the LLM-API model code; this assembles a serving copy of the
# repository with it (the mount stays read-only), then REPLACES ITSELF with the server (exec): the container's
# main process is tritonserver (mpirun for WORLD_SIZE > 1) and lives exactly as long as the server.
# The flags are those of the container's /app/scripts/launch_triton_server.py; that script is not used because it
# starts the server in the background (subprocess.Popen) and returns, which would end the container at once.
# Environment: HTTP_PORT / GRPC_PORT / METRICS_PORT (8000 / 8001 / 8002), WORLD_SIZE (1; model.yaml's
# tensor_parallel_size > 1 runs its own workers, so 1 is right unless you want one Triton rank per GPU),
# TRITONSERVER, SERVE_REPO. Extra arguments go to tritonserver (every rank).
set -euo pipefail
SRC="${{LLMAPI_MODEL_DIR:-/app/all_models/llmapi/tensorrt_llm/1}}"
REPO="${{SPECPIPE_REPO:-{repo}}}"
SERVE="${{SERVE_REPO:-/tmp/specpipe_model_repo}}"
TRITONSERVER="${{TRITONSERVER:-/opt/tritonserver/bin/tritonserver}}"
WORLD_SIZE="${{WORLD_SIZE:-1}}"
[ -f "$SRC/model.py" ] || {{ echo "no $SRC/model.py: is this a *-trtllm-python-py3 image?" >&2; exit 1; }}
[ -f "$REPO"/{name}/config.pbtxt ] || {{ echo "no $REPO/{name}/config.pbtxt: mount the exported triton/ there" >&2; exit 2; }}
[[ "$WORLD_SIZE" =~ ^[1-9][0-9]*$ ]] || {{ echo "WORLD_SIZE must be a positive integer, not '$WORLD_SIZE'" >&2; exit 2; }}
mkdir -p "$SERVE"/{name}/1
ln -sf "$REPO"/{name}/config.pbtxt "$SERVE"/{name}/config.pbtxt
ln -sf "$REPO"/{name}/1/model.yaml "$SERVE"/{name}/1/model.yaml
cp "$SRC/model.py" "$SRC/helpers.py" "$SERVE"/{name}/1/
rank_args() {{   # launch_triton_server.py's flags for rank $1
  ARGS=("--model-repository=$SERVE" "--grpc-port=${{GRPC_PORT:-8001}}" "--http-port=${{HTTP_PORT:-8000}}"
        "--metrics-port=${{METRICS_PORT:-8002}}")
  [ "$1" = 0 ] || ARGS+=(--model-control-mode=explicit --load-model={name})
  ARGS+=(--disable-auto-complete-config "--backend-config=python,shm-region-prefix-name=prefix$1_")
}}
if [ "$WORLD_SIZE" = 1 ]; then
  rank_args 0
  exec "$TRITONSERVER" "${{ARGS[@]}}" "$@"
fi
CMD=(mpirun --allow-run-as-root)
for ((r = 0; r < WORLD_SIZE; r++)); do
  [ "$r" = 0 ] || CMD+=(:)
  rank_args "$r"
  CMD+=(-n 1 "$TRITONSERVER" "${{ARGS[@]}}" "$@")
done
exec "${{CMD[@]}}"
"""
