"""What the quantize stage checks and measures on an FP8 model, as concepts of their own: where the quantized
pieces of a model are (modules.py), the named format checks of an exported ModelOpt FP8 checkpoint (checks.py),
the per-layer BF16 exclusion search (exclusion.py) and the quality measurement of the exported checkpoint against
the unquantized target and ModelOpt's fake-quant model (quality.py). Failures are `runtime.errors.RuntimeFailure`."""
