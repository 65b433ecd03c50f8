"""Executing the target and draft: FP8 checkpoints as TensorRT-LLM computes them (fp8/), placement on devices, the
layers, fused GEMMs and compute modes the runtime runs, loading exported drafts (drafts/), the speculative-decoding
engine and the lossless check."""
