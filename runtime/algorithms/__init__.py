"""One module per speculative-decoding algorithm, each the one place that says what its draft is.

`eagle3` (ModelOpt's EAGLE-3 export, `LlamaForCausalLMEagle3`), `dflash` (ModelOpt's DFlash export,
`DFlashDraftModel`) and `ngram` (prompt-lookup drafting: no draft model) each own their facts: the export's required
and optional tensors, the `d2t` rule, the capture layers, the config.json keys, the draft-length cap, and ONE
`check_export` that training, the engine's loader, quantize, the TensorRT-LLM checks and the vLLM conversion all
call. `export` holds what the algorithms share (reading an export, `Problem`, `DraftExportError`, `TargetShape`),
`registry` the algorithms by name and `check_export` dispatching on config.json's architecture; `schedule` the
version-free draft length per batch size (`DraftSchedule`).

Nothing here imports the engine, TensorRT-LLM's or vLLM's packages: they import this (tests/unit/test_architecture.py)."""
