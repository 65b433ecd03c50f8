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
# a serving copy with it, checks the model's imports (the preflight, exit 3 naming the fix) and starts Triton under
# trtllm-llmapi-launch where the image has it.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3
FROM ${TRITON_IMAGE}

# openai: TensorRT-LLM's serve path (tensorrt_llm/serve/responses_utils.py) imports
# openai.types.responses.response_content_part_added_event.PartReasoningText, first released in openai 1.108.1; NVIDIA's
# 26.07 tutorial (triton-inference-server/tutorials Popular_Models_Guide/Qwen2.5-VL) upgrades the image's openai before
# loading a model. The build fails here, not at model load, if the name is still missing (runtime/trtllm/triton_launch.py).
RUN python3 -m pip install --no-cache-dir 'openai>=1.108.1' \
 && python3 -c "from openai.types.responses.response_content_part_added_event import PartReasoningText"

ENV SPECPIPE_REPO=/opt/specpipe/triton
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s CMD curl -sf localhost:8000/v2/health/ready || exit 1
ENTRYPOINT ["bash", "/opt/specpipe/triton/launch.sh"]
