"""train_draft against a shipped config's own budgets, from the config alone (no training): what
tests/unit/stages/test_train_draft_budgets.py checks on every shipped config, and test_train_draft_real.py on the ones that
read the real model's prepared inputs."""
from __future__ import annotations

from pathlib import Path

# The hub targets of the shipped configs cannot be downloaded here: their published config.json facts, read from
# huggingface.co/<model id>/blob/main/config.json (num_hidden_layers, hidden_size, vocab_size, tie_word_embeddings),
# and the parameter count of each model card. SmolLM2 is the prepared model's own config.json
# (bench/real_model/prepare.py writes it).
HUB_TARGETS = {
    "meta-llama/Llama-3.3-70B-Instruct": {
        "num_layers": 80,
        "hidden_size": 8192,
        "vocab_size": 128256,
        "tied": False,
        "params": 70.55e9,
    },
    "meta-llama/Llama-3.1-8B-Instruct": {
        "num_layers": 32,
        "hidden_size": 4096,
        "vocab_size": 128256,
        "tied": False,
        "params": 8.03e9,
    },
    "Qwen/Qwen3-8B": {"num_layers": 36, "hidden_size": 4096, "vocab_size": 151936, "tied": False, "params": 8.19e9},
    "bench/real_model/prepared/model/SmolLM2-135M-Instruct": {
        "num_layers": 30,
        "hidden_size": 576,
        "vocab_size": 49152,
        "tied": True,
        "params": 134.5e6,
    },
}
# Mean tokens per training sample, per dataset: an assumption (not measured here). UltraChat 200k's multi-turn
# conversations: ~1,000 tokens under the Llama-3 / Qwen3 tokenizers (issue 12's figure). Sources not listed here are
# counted at their upper bound, min(data.max_length, train_draft.seq_len) tokens per sample.
MEAN_TOKENS = {"HuggingFaceH4/ultrachat_200k": 1000}


def _target_shape(cfg) -> dict:
    if cfg.target.bootstrap == "tiny":
        t = cfg.target.tiny
        return {"num_layers": t.num_layers, "hidden_size": t.hidden_size, "vocab_size": t.vocab_size, "tied": False}
    return HUB_TARGETS[cfg.target.model]


def _tokens_per_sample(cfg) -> float:
    bound = min(cfg.data.max_length, cfg.train_draft.seq_len)
    means = [MEAN_TOKENS.get(getattr(s, "name", None), bound) for s in cfg.data.sources]
    return min(bound, max(means))


def runs_within_its_own_budgets(path: Path) -> None:
    """Each shipped config, against the stage's own estimates on its target's shape: the capture layers and
    draft options fit the target (the stage's run-time shape checks), an EAGLE-3 draft captures 3 layers, and an
    offline config's hidden-state dump (`estimate_dump_bytes`, what the preflight compares) fits its
    `offline.max_dump_gb`, which an offline shipped config must state."""
    from pipeline.config import load_config
    from runtime.algorithms.eagle3 import default_aux_layer_ids
    from runtime.training.algorithm import shape_problems
    from runtime.training.offline import estimate_dump_bytes

    cfg = load_config(path)
    sec = cfg.train_draft
    shape = _target_shape(cfg)
    probs = shape_problems(sec.algorithm, shape["num_layers"], shape["vocab_size"], "num_layers", "vocab_size")
    assert not probs, probs
    a = sec.algorithm
    layers = (a.aux_layer_ids or default_aux_layer_ids(shape["num_layers"])) if a.kind == "eagle3" else \
        (a.target_layer_ids or list(range(a.draft_layers)))
    if a.kind == "eagle3":
        assert len(set(layers)) == 3 and max(layers) < shape["num_layers"], layers
    if sec.mode == "offline":
        n = min(cfg.data.max_samples, sec.max_samples or cfg.data.max_samples)
        itemsize = 4 if sec.dtype == "float32" else 2
        need = estimate_dump_bytes(n, _tokens_per_sample(cfg), len(layers), shape["hidden_size"], itemsize)
        budget = sec.offline.max_dump_gb
        assert budget is not None, f"{path.name}: offline without train_draft.offline.max_dump_gb (needs ~{need / 2**40:.1f} TiB)"
        assert need <= budget * 2**30, (f"{path.name}: the offline dump needs ~{need / 2**30:,.0f} GiB "
                                        f"({n} samples x {_tokens_per_sample(cfg):.0f} tokens), over max_dump_gb={budget}")
    if cfg.run.device == "cuda":
        # the frozen target's bf16 weights per training process: whole, or with launcher.fsdp 1/N of the decoder
        # layers plus the embeddings and lm_head every process keeps; at most half a GPU (the rest: the draft, its
        # optimizer state and the activations of batch_size / processes x seq_len tokens)
        from pipeline.hardware import GPUS

        procs = sec.launcher.nproc_per_node * sec.launcher.nnodes if sec.launcher.kind == "torchrun" else 1
        outside = (1 if shape["tied"] else 2) * shape["vocab_size"] * shape["hidden_size"]
        per_proc = 2 * ((shape["params"] - outside) / procs + outside if sec.launcher.fsdp else shape["params"])
        gpu = GPUS[cfg.hardware.gpu]
        assert per_proc <= 0.5 * gpu.memory_gb * 1e9, (f"{path.name}: each process holds ~{per_proc / 1e9:.0f} GB of target "
                                                      f"weights on a {gpu.memory_gb:.0f} GB {gpu.name}")
