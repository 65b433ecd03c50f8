"""The tiny ModelOpt pair the engine, validate and speculators tests share, built once per test process.

`tiny_assets` pretrains a tiny Llama on standard-library code with the project's tokenizer, trains an EAGLE-3 draft
(full and reduced vocabulary) and a DFlash draft with ModelOpt for a few dozen steps, and exports them with
`export_speculative_decoding`."""
from __future__ import annotations

import atexit
import copy
import functools
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch

H, LAYERS, VOCAB = 64, 4, 512


def _corpus_ids(tok, n_bytes=300_000):
    from runtime.target.corpus import stdlib_corpus

    ids = []
    for _, text in stdlib_corpus(n_bytes):
        ids += tok(text)["input_ids"] + [tok.eos_token_id]
    return torch.tensor(ids)


def batches(data, steps, bs, seq, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        s = torch.randint(0, len(data) - seq - 1, (bs,), generator=g)
        yield torch.stack([data[i:i + seq] for i in s])


def _train(model, data, steps, lr, seed, bs=8, seq=64):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for x in batches(data, steps, bs, seq, seed):
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss)


@functools.lru_cache(maxsize=1)
def tiny_assets() -> dict:
    """Build once per test process: tokenizer, pretrained tiny target, EAGLE-3 (full vocab, no YaRN), EAGLE-3
    with a reduced draft vocabulary + d2t, DFlash. Returns paths, the in-memory ModelOpt models and data."""
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.target.corpus import stdlib_corpus, train_tokenizer

    root = Path(tempfile.mkdtemp(prefix="specpipe-rt-"))
    atexit.register(shutil.rmtree, root, True)
    torch.manual_seed(0)
    tok = train_tokenizer([t for _, t in stdlib_corpus(400_000)], VOCAB, root / "target")
    data = _corpus_ids(tok)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id)
    target = LlamaForCausalLM(cfg)
    _train(target, data, 250, 3e-3, 0)
    target.save_pretrained(root / "target")
    out = {"root": root, "tok": tok, "data": data, "target_dir": root / "target"}

    def eagle(name, draft_vocab=None, rope=None):
        m = LlamaForCausalLM.from_pretrained(root / "target", dtype=torch.float32)
        ec = copy.deepcopy(mtsp.EAGLE3_DEFAULT_CFG["config"])
        ec["eagle_architecture_config"].update({"num_hidden_layers": 1, "intermediate_size": 128, "num_attention_heads": 4,
                                                "num_key_value_heads": 2, "head_dim": 16})
        if draft_vocab:
            ec["eagle_architecture_config"]["draft_vocab_size"] = draft_vocab
        ec["eagle_use_torch_compile"] = False
        ec["eagle_export_rope_scaling"] = {} if rope is None else rope
        mtsp.convert(m, [("eagle", ec)])
        if draft_vocab:   # the draft vocabulary: the most frequent tokens (what calibrate_frequent_vocab computes)
            top = torch.tensor(sorted(t for t, _ in Counter(data.tolist()).most_common(draft_vocab)))
            m.eagle_module.d2t.copy_(top - torch.arange(draft_vocab))
        _train(m, data, 200, 3e-3, 1, bs=4)
        export_speculative_decoding(m, export_dir=root / name)
        return m

    out["eagle_model"] = eagle("eagle3")
    out["eagle_dir"] = root / "eagle3"
    eagle("eagle3_yarn", rope={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048})
    out["eagle_yarn_dir"] = root / "eagle3_yarn"
    out["eagle_d2t_model"] = eagle("eagle3_d2t", draft_vocab=256)
    out["eagle_d2t_dir"] = root / "eagle3_d2t"

    m = LlamaForCausalLM.from_pretrained(root / "target", dtype=torch.float32)
    dc = copy.deepcopy(mtsp.DFLASH_DEFAULT_CFG["config"])
    dc.update({"dflash_block_size": 4, "dflash_mask_token_id": tok.mask_token_id, "dflash_use_torch_compile": False,
               "dflash_num_anchors": 8,
               "dflash_architecture_config": {"num_hidden_layers": 2, "target_layer_ids": [1, 2], "intermediate_size": 128,
                                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}})
    mtsp.convert(m, [("dflash", dc)])
    _train(m, data, 200, 3e-3, 2, bs=4)
    export_speculative_decoding(m, export_dir=root / "dflash")
    out["dflash_model"] = m
    out["dflash_dir"] = root / "dflash"
    out["prompts"] = [data[s:s + n].tolist() for s, n in ((1000, 12), (5000, 20), (9000, 7), (20000, 16), (31000, 24))]
    return out


