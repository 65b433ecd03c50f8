"""FAKE tensorrt_llm.llmapi.llm (see the package docstring)."""
RequestOutput = None
