"""Stage `target`: resolve the target model into a checked artifact (config, tokenizer, safetensors weights).

Two routes:
- `target.model`: a local directory or a hub id, loaded with transformers (`trust_remote_code` only if set).
- `target.bootstrap: tiny`: build a small Llama from scratch: a byte-level BPE tokenizer (with a mask token
  and a chat template) trained on the running Python's standard-library sources, then a short pretraining
  so that the next-token distribution is real (a random target makes acceptance meaningless): runtime/target/.

Artifact: `model/` (HF checkpoint + tokenizer), `target.json` (shape summary later stages read), and for the
bootstrap route `corpus/{train,heldout}.jsonl` (the pretraining corpus and the files it never saw).

Stop tokens: `target.json["eos_token_ids"]` lists every id that ends a generation, from config.json's and
generation_config.json's `eos_token_id`, the tokenizer's eos and the chat template's end of turn (the special token
right after an assistant message's content). An id that is part of the template's assistant header (a converted
tokenizer whose eos is ChatML's `<|im_start|>`) is never a stop id: it is rejected with a warning. Each source is
logged; `eos_token_id` (kept for older readers) is the first stop id, the end of turn when there is one.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline.artifacts import target as target_artifact
from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection, Strict
from pipeline.store import fault_point
from runtime.errors import RuntimeFailure
from runtime.records import TargetInfo

NAME = "target"
CONSUMES: tuple[str, ...] = ()
VERSION = "2"   # 2: target.json gains eos_token_ids, end_of_turn, eos_sources, eos_rejected
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
REQUIRED = True

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
        from runtime.target.tiny import bootstrap_tiny

        try:
            metrics = bootstrap_tiny(sec.tiny, model_dir, corpus_dir=ctx.out_dir / "corpus", scratch_dir=ctx.scratch_dir,
                                     dtype=sec.dtype, log=ctx.log, progress=ctx.progress,
                                     on_checkpoint=lambda step: fault_point(NAME, f"pretrain-checkpoint-{step}"))
        except RuntimeFailure as e:
            raise StageError(f"target.bootstrap: {e}") from None
        source = "bootstrap:tiny"
    else:
        metrics = _resolve_model(ctx, sec, model_dir)
        source = sec.model
    info = _check_and_summarize(model_dir, sec, source, ctx.log)
    (ctx.out_dir / target_artifact.INFO).write_text(json.dumps(info.to_json(), indent=2))
    ctx.log.info("target: %s, %d layers, hidden %d, vocab %d, %.2fM params",
                 info.architecture, info.num_layers, info.hidden_size, info.vocab_size, info.num_parameters / 1e6)
    return {**metrics, "num_parameters": info.num_parameters, "num_layers": info.num_layers,
            "hidden_size": info.hidden_size, "vocab_size": info.vocab_size, "source": source}


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


def _check_and_summarize(model_dir: Path, sec: Config, source: str, log) -> TargetInfo:
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
    return TargetInfo(
        source=source, architecture=(cfg.architectures or [cfg.model_type])[0], model_type=cfg.model_type,
        num_layers=text_cfg.num_hidden_layers, hidden_size=text_cfg.hidden_size,
        intermediate_size=getattr(text_cfg, "intermediate_size", None), num_attention_heads=text_cfg.num_attention_heads,
        num_key_value_heads=getattr(text_cfg, "num_key_value_heads", text_cfg.num_attention_heads),
        head_dim=getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads,
        vocab_size=text_cfg.vocab_size, max_position_embeddings=getattr(text_cfg, "max_position_embeddings", None),
        tokenizer_size=len(tok), mask_token=tok.mask_token, mask_token_id=tok.mask_token_id,
        eos_token_ids=tuple(stops["eos_token_ids"]), end_of_turn=stops["end_of_turn"], eos_sources=stops["sources"],
        eos_rejected=stops["rejected"], pad_token_id=tok.pad_token_id,
        has_chat_template=bool(getattr(tok, "chat_template", None)), num_parameters=n_params, dtype=sec.dtype)


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


def report(artifact) -> str:
    from pipeline.report import table

    s = target_artifact.read_info(artifact.path).raw
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
