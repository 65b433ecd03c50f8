"""FAKE tensorrt_llm.llmapi.llm_utils (see the package docstring)."""


def update_llm_args_with_extra_dict(args, extra):
    raise NotImplementedError("FAKE tensorrt_llm")
