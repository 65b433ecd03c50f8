"""Stage `target`: resolve the target model into a checked artifact (config, tokenizer, safetensors weights).

Two routes:
- `target.model`: a local directory or a hub id, loaded with transformers (`trust_remote_code` only if set).
- `target.bootstrap: tiny`: build a small Llama from scratch: a byte-level BPE tokenizer (with a mask token
  and a chat template) trained on the running Python's standard-library sources, then a short pretraining
  so that the next-token distribution is real (a random target makes acceptance meaningless).

Artifact: `model/` (HF checkpoint + tokenizer), `target.json` (shape summary later stages read), and for the
bootstrap route `corpus/{train,heldout}.jsonl` (the pretraining corpus and the files it never saw).

Stop tokens: `target.json["eos_token_ids"]` lists every id that ends a generation, from config.json's and
generation_config.json's `eos_token_id`, the tokenizer's eos and the chat template's end of turn (the special token
right after an assistant message's content). An id that is part of the template's assistant header (a converted
tokenizer whose eos is ChatML's `<|im_start|>`) is never a stop id: it is rejected with a warning. Each source is
logged; `eos_token_id` (kept for older readers) is the first stop id, the end of turn when there is one.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sysconfig
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection, Strict

NAME = "target"
CONSUMES: tuple[str, ...] = ()
VERSION = "2"   # 2: target.json gains eos_token_ids, end_of_turn, eos_sources, eos_rejected
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
REQUIRED = True

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|mask|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# `{% generation %}` marks the assistant tokens, so the data stage can train on them alone.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class TinyConfig(Strict):
    """The built-in tiny Llama. Defaults: ~5M parameters, pretrained in a few minutes on 2 cores."""

    vocab_size: int = Field(4096, ge=300, description="BPE vocabulary incl. special tokens")
    hidden_size: int = Field(256, ge=16)
    intermediate_size: int = Field(688, ge=16)
    num_layers: int = Field(4, ge=1, description="decoder layers (deeper makes a 1-layer draft relatively cheaper)")
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    max_position_embeddings: int = Field(2048, ge=64)
    seq_len: int = Field(256, ge=16, description="pretraining window in tokens")
    batch_size: int = Field(8, ge=1)
    steps: int = Field(400, ge=1, description="pretraining steps (batch_size x seq_len tokens each)")
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    corpus_mb: float = Field(8.0, gt=0, description="MB of stdlib sources to read")
    heldout_fraction: float = Field(0.1, gt=0, lt=0.5, description="share of corpus files never pretrained on (feed eval "
                                                                   "domains)")
    checkpoint_every: int = Field(100, ge=1, description="steps between resumable checkpoints")
    seed: int = 0

    @model_validator(mode="after")
    def _shape(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}")
        return self


class Config(StageSection):
    model: str | None = Field(None, description="local directory or hub id of the target")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    bootstrap: Literal["tiny"] | None = Field(None, description="build the built-in tiny target instead of loading one")
    tiny: TinyConfig = Field(default_factory=TinyConfig)
    trust_remote_code: bool = Field(False, description="allow model code from the checkpoint; off unless you trust it")
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="dtype of the committed target weights")
    materialize: Literal["link", "copy"] = Field("link", description="local models: hard-link files (copy across filesystems) or "
                                                                     "copy")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.model is None) == (self.bootstrap is None):
            raise ValueError("set exactly one of target.model (a local dir or hub id) or target.bootstrap: tiny")
        return self


def fingerprint_extra(section: Config) -> dict | None:
    """A local model directory is an external input: its file sizes and mtimes enter the fingerprint."""
    if section.model and Path(section.model).expanduser().is_dir():
        root = Path(section.model).expanduser()
        return {str(p.relative_to(root)): [p.stat().st_size, int(p.stat().st_mtime)]
                for p in sorted(root.rglob("*")) if p.is_file()}
    return None


# ---------------------------------------------------------------------------------------------- run


def run(ctx: StageContext) -> dict:
    sec: Config = ctx.section
    model_dir = ctx.out_dir / "model"
    if sec.bootstrap == "tiny":
        metrics = _bootstrap_tiny(ctx, sec, model_dir)
        source = "bootstrap:tiny"
    else:
        metrics = _resolve_model(ctx, sec, model_dir)
        source = sec.model
    summary = _check_and_summarize(model_dir, sec, source, ctx.log)
    (ctx.out_dir / "target.json").write_text(json.dumps(summary, indent=2))
    ctx.log.info("target: %s, %d layers, hidden %d, vocab %d, %.2fM params",
                 summary["architecture"], summary["num_layers"], summary["hidden_size"], summary["vocab_size"],
                 summary["num_parameters"] / 1e6)
    return {**metrics, "num_parameters": summary["num_parameters"], "num_layers": summary["num_layers"],
            "hidden_size": summary["hidden_size"], "vocab_size": summary["vocab_size"], "source": source}


def _stop_ids(model_dir: Path, tok, log) -> dict:
    """Every id that ends a generation (see the module docstring), each source logged, disagreements warned."""
    from runtime.text.chat_template import resolve_stop_ids

    raw = json.loads((model_dir / "config.json").read_text())
    text_cfg = raw.get("text_config") or {}
    config_eos = raw.get("eos_token_id", text_cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    gen_eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.exists() else None
    res = resolve_stop_ids(tok, config_eos=config_eos, generation_eos=gen_eos)
    name = lambda ids: ", ".join(f"{i} ({tok.convert_ids_to_tokens(i) if 0 <= i < len(tok) else '?'})" for i in ids) or "none"  # noqa: E731
    src = res["sources"]
    log.info("eos sources: config.json eos_token_id %s; generation_config.json %s; tokenizer eos %s; chat template end of turn "
             "%s",
             name(src["config"]), name(src["generation_config"]) if gen_path.exists() else "(no file)",
             name(src["tokenizer"]), name(src["chat_template"]) if tok.chat_template else "(no template)")
    for w in res["warnings"]:
        log.warning("eos: %s", w)
    if not res["eos_token_ids"]:
        raise StageError("target: no token ends a generation: config.json, generation_config.json and the tokenizer declare no "
                         "usable eos_token_id and the chat template has no end-of-turn token; set eos_token_id in config.json")
    log.info("stop ids (eos_token_ids): %s", name(res["eos_token_ids"]))
    return res


def _check_and_summarize(model_dir: Path, sec: Config, source: str, log) -> dict:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(model_dir, trust_remote_code=sec.trust_remote_code)
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=sec.trust_remote_code)
    n_params = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                n_params += math.prod(sf.get_slice(k).get_shape())
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    stops = _stop_ids(model_dir, tok, log)
    return {
        "source": source,
        "architecture": (cfg.architectures or [cfg.model_type])[0],
        "model_type": cfg.model_type,
        "num_layers": text_cfg.num_hidden_layers,
        "hidden_size": text_cfg.hidden_size,
        "intermediate_size": getattr(text_cfg, "intermediate_size", None),
        "num_attention_heads": text_cfg.num_attention_heads,
        "num_key_value_heads": getattr(text_cfg, "num_key_value_heads", text_cfg.num_attention_heads),
        "head_dim": getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads,
        "vocab_size": text_cfg.vocab_size,
        "max_position_embeddings": getattr(text_cfg, "max_position_embeddings", None),
        "tokenizer_size": len(tok),
        "mask_token": tok.mask_token,
        "mask_token_id": tok.mask_token_id,
        "eos_token_id": stops["eos_token_ids"][0],
        "eos_token_ids": stops["eos_token_ids"],
        "end_of_turn": stops["end_of_turn"],
        "eos_sources": stops["sources"],
        "eos_rejected": stops["rejected"],
        "pad_token_id": tok.pad_token_id,
        "has_chat_template": bool(getattr(tok, "chat_template", None)),
        "num_parameters": n_params,
        "dtype": sec.dtype,
    }


# ---------------------------------------------------------------------------------------------- local / hub


def _looks_like_path(s: str) -> bool:
    return s.startswith((".", "/", "~")) or os.sep in s.strip("/").split("/", 1)[-1] or Path(s).expanduser().exists()


def _resolve_model(ctx: StageContext, sec: Config, model_dir: Path) -> dict:
    src = Path(sec.model).expanduser()
    if src.is_dir():
        _check_local(src, sec)
        model_dir.mkdir(parents=True)
        n = 0
        for p in sorted(src.iterdir()):
            if p.is_file() and (p.suffix in (".json", ".safetensors", ".model", ".txt", ".jinja",
                                             ".py") or p.name.startswith("tokenizer")):
                _place(p, model_dir / p.name, sec.materialize)
                n += 1
        ctx.log.info("placed %d files from %s (%s)", n, src, sec.materialize)
        return {"files": n}
    if _looks_like_path(sec.model) or src.exists():
        raise StageError(f"target.model: {sec.model} is not a directory; give a model directory or a hub id")
    return _download(ctx, sec, model_dir)


def _place(src: Path, dst: Path, how: str) -> None:
    if how == "link":
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


def _check_local(src: Path, sec: Config) -> None:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not (src / "config.json").exists():
        raise StageError(f"target.model: {src} has no config.json; is it a Hugging Face model directory?")
    cfg = AutoConfig.from_pretrained(src, trust_remote_code=sec.trust_remote_code)
    archs = cfg.architectures or []
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if archs:   # the checkpoint says which head it has: it must be a causal-LM head
        causal = any(a in causal_classes or a.endswith("ForCausalLM") for a in archs)
    else:
        causal = cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(cfg, "is_encoder_decoder", False)
    if not causal:
        raise StageError(f"target.model: {src} is a '{cfg.model_type}' model ({', '.join(archs) or 'no architectures'}), "
                         "not a causal language model; speculative decoding needs a decoder-only causal LM")
    if not list(src.glob("*.safetensors")):
        bins = [p.name for p in src.glob("*.bin")] + [p.name for p in src.glob("*.pt")]
        hint = f" (found {', '.join(bins[:3])}: convert them to safetensors first)" if bins else ""
        raise StageError(f"target.model: {src} has no *.safetensors weights{hint}")
    try:
        AutoTokenizer.from_pretrained(src, trust_remote_code=sec.trust_remote_code)
    except Exception as e:  # transformers raises many types here
        raise StageError(f"target.model: {src} has no usable tokenizer ({type(e).__name__}: {str(e)[:200]}); "
                         "the draft must share the target's tokenizer, so ship tokenizer files with the model") from None


def _download(ctx: StageContext, sec: Config, model_dir: Path) -> dict:
    from huggingface_hub import snapshot_download

    ctx.log.info("downloading %s from the hub", sec.model)
    dl = ctx.scratch_dir / "download"
    try:
        snapshot_download(sec.model, revision=sec.revision, local_dir=dl,
                          allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"])
    except Exception as e:
        raise StageError(f"target.model: could not download '{sec.model}' from the hub ({type(e).__name__}: {str(e)[:300]}); "
                         "check the id, your HF_TOKEN and network, or point target.model at a local directory") from None
    _check_local(dl, sec)
    shutil.move(str(dl), model_dir)
    return {"downloaded": True}


# ---------------------------------------------------------------------------------------------- tiny bootstrap


def stdlib_corpus(max_bytes: int) -> list[tuple[str, str]]:
    """(relative path, text) of standard-library .py files, sorted, up to max_bytes. Same on every machine
    with the same Python version: deterministic for a given seed and corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(("site-packages", "test/", "idlelib/idle_test", "lib2to3/tests")) or "/tests/" in rel:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        out.append((rel, text))
        total += len(text.encode())
        if total >= max_bytes:
            break
    return out


def _is_heldout(rel: str, frac: float) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < frac


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|end|>",
                                   pad_token="<|pad|>", mask_token="<|mask|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 30
    fast.save_pretrained(out_dir)
    return fast


def _bootstrap_tiny(ctx: StageContext, sec: Config, model_dir: Path) -> dict:
    """Build the tiny target: a corpus of standard-library sources, a BPE tokenizer trained on it, a small Llama
    pretrained on it (resumable), saved to `model_dir`. Returns the pretraining metrics."""
    import torch

    t = sec.tiny
    torch.manual_seed(t.seed)
    files, train_files, held_files = _write_tiny_corpus(ctx, t)
    tok = train_tokenizer([x for _, x in train_files], t.vocab_size, model_dir)
    data = _token_stream(tok, train_files)
    held_t = _token_stream(tok, held_files)
    ctx.log.info("tokenizer: vocab %d; %d training tokens, %d held-out tokens", len(tok), len(data), len(held_t))

    model = _tiny_llama(tok, t)
    loss_v, first_loss, train_s = _pretrain(ctx, t, model, data)
    held_loss = _eval_loss(model, held_t, t.seq_len)
    dtype = getattr(torch, sec.dtype)
    model.to(dtype).save_pretrained(model_dir, safe_serialization=True)
    ctx.log.info("pretrained %d steps in %.0fs: loss %.3f, held-out perplexity "
                 "%.1f", t.steps, train_s, loss_v, math.exp(held_loss))
    return {
        "pretrain_steps": t.steps,
        "pretrain_first_loss": round(first_loss, 4) if first_loss is not None else None,
        "pretrain_final_loss": round(loss_v, 4),
        "heldout_loss": round(held_loss, 4),
        "heldout_perplexity": round(math.exp(held_loss), 3),
        "pretrain_seconds": round(train_s, 2),
        "train_tokens": len(data),
        "heldout_tokens": len(held_t),
        "corpus_files": len(files),
    }


def _write_tiny_corpus(ctx: StageContext, t: TinyConfig) -> tuple[list, list, list]:
    """Standard-library sources split into pretraining and held-out files, written to `corpus/{train,heldout}.jsonl`.
    Returns (all files, training files, held-out files), each a list of (relative path, text)."""
    files = stdlib_corpus(int(t.corpus_mb * 2**20))
    if len(files) < 10:
        raise StageError("target.bootstrap: found fewer than 10 standard-library sources to build the tiny corpus")
    train_files = [(r, x) for r, x in files if not _is_heldout(r, t.heldout_fraction)]
    held_files = [(r, x) for r, x in files if _is_heldout(r, t.heldout_fraction)]
    corpus_dir = ctx.out_dir / "corpus"
    corpus_dir.mkdir(parents=True)
    for name, items in (("train", train_files), ("heldout", held_files)):
        with open(corpus_dir / f"{name}.jsonl", "w") as f:
            for rel, text in items:
                f.write(json.dumps({"path": rel, "text": text}) + "\n")
    ctx.log.info("corpus: %d files for pretraining, %d held out (%.1f MB)", len(train_files), len(held_files),
                 sum(len(x) for _, x in files) / 2**20)
    return files, train_files, held_files


def _token_stream(tok, items: list):
    """The files' token ids, each followed by eos, as one LongTensor."""
    import torch

    ids = []
    for _, text in items:
        ids.extend(tok(text)["input_ids"] + [tok.eos_token_id])
    return torch.tensor(ids, dtype=torch.long)


def _tiny_llama(tok, t: TinyConfig):
    """A freshly initialised Llama of the configured tiny shape for tokenizer `tok` (the global torch seed decides
    its weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
        max_position_embeddings=t.max_position_embeddings, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, rope_theta=10000.0,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return LlamaForCausalLM(cfg)


def _lr_at(t: TinyConfig, step: int) -> float:
    """Linear warmup, then cosine decay to a tenth of `lr`."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    prog = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))


def _pretrain(ctx: StageContext, t: TinyConfig, model, data) -> tuple[float, float | None, float]:
    """Pretrain `model` on random windows of `data` for `t.steps` steps, resuming from (and checkpointing to) the
    scratch directory. Returns (last loss, first loss of this run, seconds)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(t.seed)
    ckpt = ctx.scratch_dir / "pretrain.pt"
    step0 = _resume_pretraining(ctx, ckpt, model, opt, gen)
    n = len(data) - t.seq_len - 1
    model.train()
    t0 = time.monotonic()
    loss_v = float("nan")
    first_loss = None
    with ctx.progress(total=t.steps, desc="pretrain tiny target") as bar:
        bar.update(step0)
        for step in range(step0, t.steps):
            starts = torch.randint(0, n, (t.batch_size,), generator=gen)
            x = torch.stack([data[s: s + t.seq_len] for s in starts])
            for g in opt.param_groups:
                g["lr"] = _lr_at(t, step)
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss_v = loss.item()
            first_loss = loss_v if first_loss is None else first_loss
            bar.update(1, loss=f"{loss_v:.3f}")
            if (step + 1) % t.checkpoint_every == 0 and step + 1 < t.steps:
                tmp = ckpt.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step + 1}, tmp)
                os.replace(tmp, ckpt)
    return loss_v, first_loss, time.monotonic() - t0


def _resume_pretraining(ctx: StageContext, ckpt: Path, model, opt, gen) -> int:
    """Load model, optimizer and sampler state from `ckpt` when it exists; the step to continue from (0 if not)."""
    import torch

    if not ckpt.exists():
        return 0
    state = torch.load(ckpt, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    gen.set_state(state["gen"])
    step0 = int(state["step"])
    ctx.log.info("resuming pretraining from step %d (checkpoint %s)", step0, ckpt)
    return step0


def _eval_loss(model, ids, seq_len: int, max_windows: int = 32) -> float:
    import torch

    model.eval()
    losses = []
    with torch.no_grad():
        for i in range(0, min(len(ids) - seq_len - 1, max_windows * seq_len), seq_len):
            x = ids[i: i + seq_len].unsqueeze(0)
            losses.append(model(input_ids=x, labels=x).loss.item())
    return sum(losses) / max(1, len(losses))


def report(artifact) -> str:
    from pipeline.report import table

    s = artifact.read_json("target.json")
    m = artifact.metrics
    rows = [[k, s.get(k)] for k in ("source", "architecture", "num_layers", "hidden_size", "num_attention_heads",
                                     "num_key_value_heads", "vocab_size", "num_parameters", "dtype", "mask_token")]
    if s.get("eos_token_ids") is not None:
        eot = s.get("end_of_turn") or {}
        rows += [["stop ids (eos_token_ids)", s["eos_token_ids"]], ["chat template end of turn", eot.get("token")]]
        rows += [[f"rejected eos {x['id']} ({x['token']}, {x['source']})", x["why"]] for x in s.get("eos_rejected", [])]
    if "heldout_perplexity" in m:
        rows += [["pretraining", f"{m['pretrain_steps']} steps, loss {m['pretrain_first_loss']} -> {m['pretrain_final_loss']}"],
                 ["held-out perplexity", m["heldout_perplexity"]]]
    return table(rows, ["", ""])
