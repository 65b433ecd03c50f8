"""The built-in tiny target (`target.bootstrap: tiny`): its corpus of standard-library sources and byte-level BPE
tokenizer with a chat template (corpus.py), and the small Llama pretrained on that corpus, resumable (tiny.py).
Failures are `runtime.errors.RuntimeFailure`."""
