"""FAKE tensorrt_llm (TensorRT-LLM cannot be installed here): only the module names the LLM-API Triton model imports
(triton_backend/all_models/llmapi/tensorrt_llm/1/model.py, stored 044a90d2), so that launch.sh's preflight can be run
for real in tests/integration/test_triton_launch.py. Nothing here computes anything."""
FAKE = True
LLM = None
SamplingParams = None
