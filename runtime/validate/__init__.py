"""What the validate stage measures on a target + draft pair, as concepts of their own: the settings and the
batched, invariant-checked decoding every measurement goes through (decode.py), the acceptance per domain on
specpipe's reference runtime (reference.py), the exact and statistical parts of the lossless check with the
speed figures measured on the same runs (lossless_arms.py; the primitives are runtime/engine/lossless.py), and the
same acceptance measured through TensorRT-LLM's LLM API (trtllm.py). Failures are `runtime.errors.RuntimeFailure`."""
