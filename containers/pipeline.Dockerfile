# specpipe pipeline image: TensorRT-LLM (PyTorch backend, CUDA torch) + ModelOpt + specpipe.
#
#   docker build -f containers/pipeline.Dockerfile -t specpipe:trtllm-1.2.1 .
#   docker build -f containers/pipeline.Dockerfile --build-arg BASE_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc27 -t specpipe:trtllm-1.3 .
#   docker run --gpus all --ipc=host -v $PWD/runs:/workspace/runs -e HF_TOKEN specpipe:trtllm-1.2.1 \
#       build configs/llama70b_fp8_eagle3.yaml
#
# BASE_IMAGE must be a `tensorrt-llm/release` tag listed in runtime/trtllm/compat.py (tests check it); use the 1.3
# line for DFlash drafts. The base image's torch, TensorRT-LLM and CUDA stack are kept as they are.
ARG BASE_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:1.2.1
FROM ${BASE_IMAGE}

WORKDIR /opt/specpipe
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY stages ./stages
COPY runtime ./runtime
COPY configs ./configs

# specpipe needs ModelOpt 0.47's speculative-decoding export (EAGLE-3, DFlash); the release image may carry
# an older ModelOpt. --no-deps everywhere: nothing may replace the image's torch or TensorRT-LLM.
RUN python3 -m pip install --no-cache-dir --no-deps nvidia-modelopt==0.47.0 \
 && python3 -m pip install --no-cache-dir "click>=8.1" "pydantic>=2.7" "rich>=13" "psutil>=5.9" "pulp<4.0" omegaconf \
 && python3 -m pip install --no-cache-dir --no-deps -e . \
 && specpipe --version

ENV TOKENIZERS_PARALLELISM=false
WORKDIR /workspace
RUN ln -s /opt/specpipe/configs /workspace/configs
ENTRYPOINT ["specpipe"]
CMD ["--help"]
