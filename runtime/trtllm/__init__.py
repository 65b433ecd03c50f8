"""What TensorRT-LLM reads: the container/version table, LLM-API options checked against packaged field
lists (schemas/) and by named consistency checks, the draft-length schedule, the draft's tensor names, the
RoPE fields of exported config.json files, and the deployment's command files, README and load."""
