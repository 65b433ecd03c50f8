"""FAKE tensorrt_llm.llmapi (see the package docstring)."""
