"""What TensorRT-LLM reads: the container/version table, LLM-API options checked against packaged field
lists (schemas/), the draft-length schedule, and the RoPE fields of exported config.json files."""
