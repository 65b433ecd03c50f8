"""Training the draft (in-process or as a torchrun worker) and the named checks of its export.

Stage side: `job` (the job dict the stage writes), `algorithm` (capture layers, options against the target's
shape), `launch` (torchrun), `progress` (the worker's events and the stage's bars), `draft_checks` (the named
export checks). Worker side: `draft_training` (the entry point, `python -m runtime.training.draft_training --job
job.json`), `dist`, `samples`, `model` (ModelOpt convert), `fsdp`, `offline` (hidden-state dump), `loop`,
`checkpoint`, `acceptance`. Both: `export` (ModelOpt's export, then its completion) and `records` (result.json,
draft.json, curve.json, metrics)."""
