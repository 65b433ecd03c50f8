"""Executing the target and draft: FP8 checkpoints as TensorRT-LLM computes them, placement on devices,
loading exported drafts, the speculative-decoding engine and the lossless check."""
