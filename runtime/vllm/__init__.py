"""The exported draft in the speculators format that vLLM loads."""
