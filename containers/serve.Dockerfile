# specpipe serving image: Triton Inference Server with the TensorRT-LLM backend, serving an exported
# repository (`runs/<run>/artifacts/export/triton`, FP8 target + draft + LLM-API options) mounted read-only.
#
#   docker build -f containers/serve.Dockerfile -t specpipe-serve:26.07 .
#   docker run --gpus all --ipc=host -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#       -v $PWD/runs/llama70b_fp8_eagle3/artifacts/export/triton:/opt/specpipe/triton:ro specpipe-serve:26.07
#
# TRITON_IMAGE must be a `tritonserver:<yy.mm>-trtllm-python-py3` tag listed in runtime/trtllm/compat.py whose
# TensorRT-LLM version is the one the repository was built for (`build.trtllm_version`); tests check it.
# The image provides the LLM-API model code (/app/all_models/llmapi); the repository's launch.sh assembles
# a serving copy with it and starts Triton.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3
FROM ${TRITON_IMAGE}

ENV SPECPIPE_REPO=/opt/specpipe/triton
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s CMD curl -sf localhost:8000/v2/health/ready || exit 1
ENTRYPOINT ["bash", "/opt/specpipe/triton/launch.sh"]
