"""FAKE TensorRT-LLM LLM-API Triton model (TensorRT-LLM cannot be installed here): stands in for the container's
/app/all_models/llmapi/tensorrt_llm/1/model.py in tests/integration/test_triton_launch.py, which checks how launch.sh starts the
real Triton server, not what the model computes. Like the real model it reads model.yaml next to it (the symlink
launch.sh makes) in initialize and answers through the decoupled response sender; it echoes text_input."""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml


class TritonPythonModel:
    def initialize(self, args):
        with open(os.path.join(os.path.dirname(__file__), "model.yaml")) as f:
            self.options = yaml.safe_load(f)
        if "model" not in self.options or "triton_config" not in self.options:
            raise pb_utils.TritonModelException("model.yaml has no model / triton_config")
        self.config = json.loads(args["model_config"])

    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            out = pb_utils.Tensor("text_output", np.asarray([b"FAKE-TRTLLM:" + text], dtype=np.object_))
            request.get_response_sender().send(pb_utils.InferenceResponse(output_tensors=[out]),
                                               flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
