"""Serving the CPU repository: the text-in/text-out adapter over the engine, continuous batching, the
Triton server process and the Python-backend model file export copies."""
