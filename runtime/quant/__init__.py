"""FP8 quantization with ModelOpt and what the quantize stage checks and measures, as concepts of their own: the
recipes, calibration and alignment with the deployment (ptq.py), writing the checkpoint the deployment reads
(export.py), the EAGLE-3 draft's quantization and export (eagle_draft.py), where the quantized pieces of a model are
(modules.py), the named format checks of an exported ModelOpt FP8 checkpoint (checks.py), the per-layer BF16
exclusion search (exclusion.py) and the quality measurement of the exported checkpoint against the unquantized
target and ModelOpt's fake-quant model (quality.py). Failures are `runtime.errors.RuntimeFailure`."""
