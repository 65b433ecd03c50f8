"""The exported draft in the speculators format that vLLM loads: its config.json, its tensors, and the
`vllm serve` command and README."""
