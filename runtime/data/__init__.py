"""How the data stage builds its samples, as concepts of their own: where samples come from (sources.py), how a
sample becomes tokens and an assistant-only loss mask through a chat template (render.py), the regeneration of
responses by the target through specpipe's runtime (regenerate.py), and the eval-prompt choice, dedup, train /
held-out split, row rule and split statistics (splits.py). The data artifact's row rule as its readers check it is
rows.py (the draft-training worker reads it too). Failures are `runtime.errors.RuntimeFailure`."""
