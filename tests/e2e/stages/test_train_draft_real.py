"""Stage `train_draft` on the real model (tests/e2e: `real_model`, prepared by `bash bench/real_model/prepare.sh`):
SmolLM2's tied embeddings through online, offline and FSDP training. The rest of train_draft's tests: test_train_draft.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import REAL_CONFIG, REPO, run_cli
from support.budgets import runs_within_its_own_budgets
from support.stage_runs import assert_al_is_the_counts
from support.synthetic import needs_prepared_inputs

pytestmark = pytest.mark.slow

# ------------------------------------------------------------------------------------------- the real model: tied embeddings

# SmolLM2-135M-Instruct ties lm_head to embed_tokens: its checkpoint has no lm_head.weight. A few steps each.
REAL_SMALL = ["train_draft.steps=2", "train_draft.batch_size=2", "train_draft.seq_len=64", "train_draft.warmup_steps=1",
              "train_draft.checkpoint_every=100", "train_draft.log_every=1", "train_draft.eval.prompts_per_domain=2",
              "train_draft.eval.osl=8", "train_draft.max_samples=16"]


@pytest.fixture(scope="module")
def real_inputs(real_model, tmp_path_factory) -> Path:
    """Committed `target` (the stage, on SmolLM2) and a small `data` artifact written here per the contract in
    docs/architecture.md (first user/assistant turns of the prepared ShareGPT chats, assistant tokens as loss;
    humaneval and gsm8k prompts), since this branch's data stage does not mask SmolLM2's stock template yet."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from pipeline.store import Store

    wd = tmp_path_factory.mktemp("td_real") / "run"
    r = run_cli("build", str(REAL_CONFIG), "--workdir", str(wd), "--only", "target")
    assert r.returncode == 0, r.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(wd / "artifacts" / "target" / "model")
    rows = {"input_ids": [], "loss_mask": [], "domain": [], "source": []}
    for i, line in enumerate((real_model["data_dir"] / "sharegpt_chats.jsonl").read_text().splitlines()):
        msgs = json.loads(line)["messages"][:2]
        if len(rows["input_ids"]) == 24:
            break
        if [m["role"] for m in msgs] != ["user", "assistant"]:
            continue
        head = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        full = tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
        assert full[: len(head)] == head
        rows["input_ids"].append(full[:128])
        rows["loss_mask"].append(([0] * len(head) + [1] * (len(full) - len(head)))[:128])
        rows["domain"].append("chat")
        rows["source"].append(f"sharegpt_chats.jsonl:{i}")
    tmp = wd / "data.tmp"
    (tmp / "eval").mkdir(parents=True)
    for split in ("train", "heldout", "calib"):
        Dataset.from_dict(rows).to_parquet(str(tmp / f"{split}.parquet"))
    for dom in ("humaneval", "gsm8k"):
        lines = []
        for line in (real_model["data_dir"] / f"{dom}.jsonl").read_text().splitlines()[:2]:
            user = next(m["content"] for m in json.loads(line)["messages"] if m["role"] == "user")
            ids = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"][-96:]
            lines.append(
                json.dumps({"id": f"{dom}-{len(lines)}", "prompt": tok.decode(ids), "prompt_ids": ids, "reference": None})
            )
        (tmp / "eval" / f"{dom}.jsonl").write_text("\n".join(lines) + "\n")
    (tmp / "stats.json").write_text("{}")
    Store(wd).commit(
        "data", tmp, {"stage": "data", "fingerprint": "f" * 64, "metrics": {"train_samples": len(rows["input_ids"])}}
    )
    return wd


def _real_ctx(inputs: Path, tmp_path: Path, *overrides: str):
    import logging

    from pipeline.config import load_config
    from pipeline.device import resolve_device
    from pipeline.stage import StageContext
    from pipeline.store import Store

    wd = tmp_path / "run"
    (wd / "artifacts").mkdir(parents=True)
    for stage in ("target", "data"):
        shutil.copytree(inputs / "artifacts" / stage, wd / "artifacts" / stage)
    cfg = load_config(REAL_CONFIG, [*REAL_SMALL, "run.device=cpu", *overrides])
    st = Store(wd)
    (wd / "out").mkdir()
    return StageContext(
        name="train_draft",
        config=cfg,
        section=cfg.train_draft,
        out_dir=wd / "out",
        scratch_dir=st.scratch_dir("train_draft", "0" * 16),
        inputs={k: st.artifact(k) for k in ("target", "data")},
        workdir=wd,
        fingerprint="0" * 16,
        log=logging.getLogger("test_train_draft"),
        device=resolve_device(cfg.run),
    )


def _real_tensor(model_dir: Path, name: str):
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return f.get_tensor(name)


def test_real_model_tied_embeddings_full_vocabulary(real_inputs, tmp_path, monkeypatch):
    """Full draft vocabulary on the tied target: the draft has no lm_head of its own, ModelOpt's export copies the
    target's, which is its embedding (the checkpoint stores no lm_head.weight); the export loads in the runtime,
    captures SmolLM2's default 3 layers [1, 14, 26], and the runtime estimate runs on it."""
    import stages.train_draft as td

    monkeypatch.chdir(REPO)
    ctx = _real_ctx(real_inputs, tmp_path, "train_draft.algorithm.draft_vocab_size=null")
    m = td.run(ctx)
    draft = ctx.out_dir / "draft"
    model_dir = real_inputs / "artifacts" / "target" / "model"
    embed = _real_tensor(model_dir, "model.embed_tokens.weight")
    lm = _real_tensor(draft, "lm_head.weight")
    assert lm.shape == (49152, 576) and lm.dtype == embed.dtype and bool((lm == embed).all())
    d = json.loads((ctx.out_dir / "draft.json").read_text())
    assert d["aux_layer_ids"] == [1, 14, 26] and d["has_d2t"] is False and d["draft_vocab_size"] == 49152
    assert all(c["passed"] for c in json.loads((ctx.out_dir / "checks.json").read_text()))
    assert m["acceptance_estimator"] == "runtime"
    acc = json.loads((ctx.out_dir / "curve.json").read_text())["acceptance"]
    assert m["acceptance_length"] == acc["acceptance_length"] and 1.0 <= m["acceptance_length"] <= 4.0
    assert_al_is_the_counts(acc)
    assert set(m["acceptance_by_domain"]) == {"humaneval", "gsm8k"}


def test_real_model_offline_with_tied_embeddings(real_inputs, tmp_path, monkeypatch):
    """Offline on the tied target, reduced vocabulary: ModelOpt's 0-layer base (`load_vlm_or_llm(...,
    use_offline_training=True)`) keeps the tied lm_head, so the base logits it computes from a dumped record are the
    target's own; the draft is exported from the offline model (no reload for the runtime estimate) and passes
    its checks with a valid d2t."""
    import torch
    from transformers import AutoModelForCausalLM

    import stages.train_draft as td
    from runtime.training.model import build_model

    monkeypatch.chdir(REPO)
    # target_dtype auto (float32): the logits below are compared with the float32 target's at 1e-4
    ctx = _real_ctx(
        real_inputs, tmp_path, "train_draft.mode=offline", "train_draft.max_samples=4", "train_draft.target_dtype=auto"
    )
    m = td.run(ctx)
    assert m["mode"] == "offline" and m["dump_bytes"] > 0 and m["acceptance_estimator"] == "runtime"
    assert all(c["passed"] for c in json.loads((ctx.out_dir / "checks.json").read_text()))
    assert _real_tensor(ctx.out_dir / "draft", "lm_head.weight").shape == (8192, 576)
    rec = torch.load(sorted(ctx.scratch_dir.glob("hidden/*.pt"))[0], weights_only=True)
    job = json.loads(json.dumps(td.make_job(ctx)))
    offline = build_model(job, True, torch.device("cpu"))
    target = AutoModelForCausalLM.from_pretrained(real_inputs / "artifacts" / "target" / "model", dtype=torch.float32).eval()
    with torch.no_grad():
        want = target(input_ids=rec["input_ids"][None]).logits[0]
        got = offline._base_model_lm_head(rec["hidden_states"].float())
    assert offline._base_model_lm_head.weight.data_ptr() == offline.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_real_model_fsdp_skeleton_ties_lm_head(real_inputs):
    """launcher.fsdp reads the tensors outside the decoder layers from the safetensors: SmolLM2's has no
    lm_head.weight, and the skeleton ties it to the embedding read from the checkpoint (not left on the meta device,
    not refused as missing)."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.training.fsdp import load_target_skeleton

    model_dir = real_inputs / "artifacts" / "target" / "model"
    sk = load_target_skeleton({"target_dir": str(model_dir), "trust_remote_code": False}, torch.device("cpu"), torch.float32)
    assert sk.lm_head.weight is sk.get_input_embeddings().weight and not sk.lm_head.weight.is_meta
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for n, p in sk.named_parameters():
        if ".layers." not in n:
            assert torch.equal(p, ref.get_parameter(n)), n


@pytest.mark.parametrize("path", [p for p in sorted((REPO / "configs").glob("*.yaml")) if needs_prepared_inputs(p)],
                         ids=lambda p: p.name)
def test_real_model_config_runs_within_its_own_budgets(path, real_model):
    """As test_train_draft_budgets.py, on the shipped configs that read the prepared inputs (support/budgets.py)."""
    runs_within_its_own_budgets(path)
