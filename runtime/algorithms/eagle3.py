"""EAGLE-3: what a valid draft export is, in one place.

The export is what ModelOpt 0.47's `export_speculative_decoding` writes (`EagleExporter`,
modelopt/torch/export/plugins/hf_spec_export.py and hf_spec_configs.py `llama_eagle_template_config`, nvidia-modelopt
0.47.0 as installed): config.json with `architectures: ["LlamaForCausalLMEagle3"]` and an `eagle_config`, and
model.safetensors with the draft's tensors. The truth below, and where it was read:

- tensors: ModelOpt's `LLAMA_EAGLE_SINGLE_LAYER` requires fc, layers.0.hidden_norm, layers.0.input_layernorm, every
  layer's attention/MLP/post_attention_layernorm, and `norm`; `d2t` and `lm_head` are optional there, but
  `_extract_state_dict` always writes lm_head (the base model's when the draft has none). `norm.weight` is REQUIRED:
  ModelOpt's `_check_valid_sd` asserts it whatever `use_last_layernorm` says, and TensorRT-LLM's Eagle3DraftModel
  builds `self.norm` unconditionally (NVIDIA/TensorRT-LLM tensorrt_llm/_torch/models/modeling_speculative.py at
  00679c66c3e38f6d2651ad0a5bef0f94d862e36c). Layers i >= 1 carry input_layernorm too (HF decoder layers; this
  runtime reads it; TensorRT-LLM's `next_layer_regular` layers do not). Bias tensors and quantization scales may
  sit beside any weight; nothing else (a serving engine would skip or reject it).
- d2t: present iff draft_vocab_size < vocab_size (ModelOpt registers the int64 buffer only then; TensorRT-LLM's
  Eagle3DraftModel makes `d2t` an int32 Parameter of (draft_vocab_size,) iff they differ, modeling_speculative.py
  above); an integer tensor of shape (draft_vocab_size,) whose target ids `arange(Vd) + d2t` are distinct and in
  [0, vocab_size) (ModelOpt's hf_eagle.py: `draft_token += d2t[draft_token]`). With the full vocabulary any d2t
  must be all zero. `t2d` (bool over the target vocabulary) is speculators' form of the same map (`t2d_of`).
- capture layers: `eagle_config.eagle_aux_hidden_state_layer_ids` (the target layers whose outputs fc reads, 0-based
  as ModelOpt and TensorRT-LLM number them); fc.weight is [hidden, len(ids) x hidden]; layers.0's q/k/v read
  [embedding, hidden] (2 x hidden). Deployments build fc for exactly `CAPTURE_LAYERS` = 3 (`deployable_fc`).
- config keys: `CONFIG_KEYS`, `eagle_config.use_aux_hidden_state` true (else an EAGLE-1/2 draft), and the ids.
- draft length: no structural cap (chain drafting: one step per token); training's `ttt_steps` is the trained one.
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.algorithms.export import LAYER_TENSORS, DraftExportError, Export, Problem, TargetShape

ARCHITECTURE = "LlamaForCausalLMEagle3"
UPSTREAM = ("modelopt 0.47.0 modelopt/torch/export/plugins/hf_spec_export.py LLAMA_EAGLE_SINGLE_LAYER / "
            "EagleExporter._check_valid_sd; NVIDIA/TensorRT-LLM tensorrt_llm/_torch/models/modeling_speculative.py "
            "Eagle3DraftModel at 00679c66c3e38f6d2651ad0a5bef0f94d862e36c")
# config.json keys ModelOpt's template writes and every consumer reads
CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "draft_vocab_size", "eagle_config")
OPTIONAL_TENSORS = ("d2t",)
# where config.json declares the capture layers: the one spelling of the key outside the writers (ModelOpt reads the
# same key in `eagle_architecture_config`, runtime/training/model.py writes it from here)
CAPTURE_SECTION, CAPTURE_KEY = "eagle_config", "eagle_aux_hidden_state_layer_ids"
# EAGLE-3 drafts read exactly this many target layers where they are deployed. TensorRT-LLM sizes the draft's fc as
# hidden x (number of capture layers), 3 when eagle3_layers_to_capture is unset (tensorrt_llm/_torch/speculative/
# eagle3.py, Eagle3SpecMetadata / _get_eagle3_default_capture_layers); vLLM's llama_eagle3.py builds
# fc = Linear(3 x hidden, hidden) (vllm-project/vllm vllm/model_executor/models/llama_eagle3.py at 583507d1) and
# speculators' converter does the same: any other count does not load there.
CAPTURE_LAYERS = 3


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 capture layers when `aux_layer_ids` is not set (0-based, sorted).

    TensorRT-LLM's default tuple (1, L//2-1, L-4) when its three ids are distinct and inside the target;
    otherwise (L <= 6, where it collapses or leaves the stack) three distinct layers spread over the whole
    target: the first, the middle ((L-1)//2) and the last. ModelOpt 0.47's own default
    (`default_eagle_aux_layer_ids`: sorted({1, max(0, L//2-1), max(0, L-4)})) collapses to 2 layers on a 4-layer
    target, which gives fc [H, 2H]: a shape TensorRT-LLM and vLLM refuse, so it is never used."""
    if num_layers < CAPTURE_LAYERS:
        raise ValueError(f"EAGLE-3 captures {CAPTURE_LAYERS} distinct target layers; a {num_layers}-layer target "
                         "has too few")
    trt = (1, num_layers // 2 - 1, num_layers - 4)
    if len(set(trt)) == CAPTURE_LAYERS and all(0 <= i < num_layers for i in trt):
        return sorted(trt)
    return [0, (num_layers - 1) // 2, num_layers - 1]


def required_tensors(num_layers: int) -> set[str]:
    names = {"fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.{n}.weight" for n in LAYER_TENSORS}
    return names


def capture_layer_ids(cfg: dict) -> list[int] | None:
    """The target layers the export declares it reads (ModelOpt / TensorRT-LLM numbering), None when absent."""
    ids = (cfg.get(CAPTURE_SECTION) or {}).get(CAPTURE_KEY)
    return [int(i) for i in ids] if ids else None


def deployable_fc(in_features: int | None, hidden: int) -> str:
    """'' when fc's input width is the one every deployment builds (3 x hidden), else why it does not load."""
    want = CAPTURE_LAYERS * hidden
    if in_features == want:
        return ""
    return (f"fc.weight takes {in_features} inputs, expected {CAPTURE_LAYERS} x hidden = {want}: TensorRT-LLM (default "
            f"capture count), vLLM's llama_eagle3 and speculators build fc for {CAPTURE_LAYERS} captured layers and refuse "
            "this shape at load; train on 3 distinct capture layers (train_draft.algorithm.aux_layer_ids)")


def t2d_of(d2t, vocab_size: int):
    """speculators' `t2d`: bool over the target vocabulary, True at every id the draft can propose."""
    import torch

    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t.long()] = True
    return t2d


def check_export(ex: Export, *, target: TargetShape | None = None) -> list[Problem]:
    """Every problem of an EAGLE-3 export, in the order a reader fixes them: config, tensors, shapes, vocabulary
    and d2t, then the pairing with `target` (when given)."""
    out = _config_problems(ex)
    if any(p.check == "config_keys" for p in out):
        return out
    cfg = ex.cfg
    H, L = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    ids = capture_layer_ids(cfg) or []
    out += _tensor_problems(ex, L)
    fc = ex.shapes.get("fc.weight")
    if fc is not None and len(fc[0]) == 2 and ids and fc[0][1] != len(ids) * H:
        out.append(Problem("fc_shape", f"{ex.where}: fc.weight takes {fc[0][1]} inputs = {fc[0][1] / H:g} x hidden {H}, "
                                       f"but {CAPTURE_KEY} lists {len(ids)} layers {ids}"))
    q = ex.shapes.get("layers.0.self_attn.q_proj.weight")
    if q is not None and len(q[0]) == 2 and q[0][1] != 2 * H:
        out.append(Problem("first_layer_shape", f"{ex.where}: layers.0.self_attn.q_proj takes {q[0][1]} inputs, "
                                                f"expected 2 x hidden = {2 * H} ([embedding, hidden])"))
    out += vocab_problems(ex)
    if target is not None:
        out += _pairing_problems(ex, ids, target)
    return out


def _config_problems(ex: Export) -> list[Problem]:
    cfg, out = ex.cfg, []
    archs = cfg.get("architectures")
    if ARCHITECTURE not in (archs or []):
        out.append(Problem("config", f"{ex.where}: config.json architectures is {archs}, expected ['{ARCHITECTURE}'] "
                                     "(TensorRT-LLM picks the draft implementation from it)"))
    missing = [k for k in CONFIG_KEYS if k != "draft_vocab_size" and cfg.get(k) is None]
    if missing:
        return out + [Problem("config_keys", f"{ex.where}: config.json lacks {missing}, which ModelOpt's EAGLE-3 export "
                                             "writes and every consumer reads; re-export with export_speculative_decoding")]
    ec = cfg["eagle_config"]
    if not isinstance(ec, dict) or not ec.get("use_aux_hidden_state", False):
        out.append(Problem("eagle_config", f"{ex.where}: eagle_config.use_aux_hidden_state is not true: an EAGLE-1/2 "
                                           "draft, which TensorRT-LLM's Eagle3 path cannot run"))
    elif not ec.get(CAPTURE_KEY):
        out.append(Problem("eagle_config", f"{ex.where}: {CAPTURE_SECTION}.{CAPTURE_KEY} is empty: the "
                                           "capture layers the draft was trained on are unknown"))
    if cfg.get("draft_vocab_size") is None:
        out.append(Problem("draft_vocab_size", f"{ex.where}: config.json has no draft_vocab_size: TensorRT-LLM then "
                                               "assumes the full vocabulary, which is wrong for a reduced-vocabulary draft",
                           "missing"))
    return out


def _tensor_problems(ex: Export, num_layers: int) -> list[Problem]:
    required = required_tensors(num_layers)
    keys = ex.names()
    missing = sorted(required - keys)
    allowed = required | set(OPTIONAL_TENSORS) | {k.replace(".weight", ".bias") for k in required}
    unexpected = sorted(keys - allowed)
    out = []
    if missing:
        out.append(Problem("required_tensors", f"{ex.where}: missing {len(missing)} tensor(s) {missing[:8]}"
                                               f"{' ...' if len(missing) > 8 else ''}; an EAGLE-3 export has fc, "
                                               "layers.*.{input_layernorm,post_attention_layernorm,self_attn.*,mlp.*}, "
                                               "layers.0.hidden_norm, norm, lm_head (ModelOpt 0.47 LLAMA_EAGLE_SINGLE_LAYER)"))
    if unexpected:
        out.append(Problem("unexpected_tensors", f"{ex.where}: unexpected tensors {unexpected[:8]}: a serving engine "
                                                 "would skip or reject them; re-export with export_speculative_decoding"))
    return out


def vocab_problems(ex: Export) -> list[Problem]:
    """lm_head has draft_vocab_size rows; a reduced vocabulary ships a valid d2t, a full one none (or zeros)."""
    cfg = ex.cfg
    V, dv = int(cfg["vocab_size"]), cfg.get("draft_vocab_size")
    if dv is None:
        return []   # reported as draft_vocab_size; what it should be is unknown
    dv = int(dv)
    out = []
    lm = ex.shapes.get("lm_head.weight")
    if lm is not None and lm[0][0] != dv:
        out.append(Problem("lm_head_rows", f"{ex.where}: lm_head.weight has {lm[0][0]} rows but draft_vocab_size is {dv}"))
    if dv > V:
        return out + [Problem("draft_vocab_size", f"{ex.where}: draft_vocab_size {dv} > vocab_size {V}", "value")]
    return out + d2t_problems(ex, dv, V)


def d2t_problems(ex: Export, dv: int, V: int) -> list[Problem]:
    """The d2t rule (module doc); problems carry check 'd2t' and a code: missing, dtype, shape, values, nonzero."""
    d2t = ex.shapes.get("d2t")
    if dv == V:
        if d2t is not None and bool((ex.tensor("d2t") != 0).any()):
            return [Problem("d2t", f"{ex.where}: d2t is non-zero although draft_vocab_size == vocab_size", "nonzero")]
        return []
    if d2t is None:
        return [Problem("d2t", f"{ex.where}: draft_vocab_size {dv} < vocab_size {V} but there is no d2t tensor: draft "
                               "ids would be read as target ids and acceptance collapses silently; export with the draft "
                               "vocabulary cache loaded", "missing")]
    if not d2t[1].startswith(("int", "uint")):
        return [Problem("d2t", f"{ex.where}: d2t is {d2t[1]}, expected an integer tensor (int64 as ModelOpt writes it)",
                        "dtype")]
    if tuple(d2t[0]) != (dv,):
        return [Problem("d2t", f"{ex.where}: d2t has shape {tuple(d2t[0])}, expected ({dv},) = draft_vocab_size (one "
                               "offset per draft token)", "shape")]
    import torch

    tgt = torch.arange(dv) + ex.tensor("d2t").long()
    bad = int(((tgt < 0) | (tgt >= V)).sum())
    dup = dv - len(set(tgt.tolist()))
    if bad or dup:
        return [Problem("d2t", f"{ex.where}: d2t maps {bad} draft ids outside the target vocabulary [0, {V}) and {dup} "
                               "onto an already-used target id", "values")]
    return []


def _pairing_problems(ex: Export, ids: list[int], target: TargetShape) -> list[Problem]:
    H, V = int(ex.cfg["hidden_size"]), int(ex.cfg["vocab_size"])
    out = []
    if H != target.hidden_size:
        out.append(Problem("pairing", f"{ex.where}: draft hidden_size {H} != target hidden_size {target.hidden_size}"))
    if V != target.vocab_size:
        out.append(Problem("pairing", f"{ex.where}: draft vocab_size {V} != target vocab_size {target.vocab_size}: the "
                                      "draft must share the target's tokenizer"))
    if bad := [i for i in ids if not 0 <= i < target.num_layers]:
        out.append(Problem("pairing", f"{ex.where}: aux layer ids {bad} are outside the target's {target.num_layers} layers"))
    return out


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 export's config.json as its consumers read it (`EAGLE3.parse`)."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    draft_vocab_size: int
    capture_layers: tuple[int, ...]      # sorted, 0-based (ModelOpt / TensorRT-LLM numbering)
    use_last_layernorm: bool
    raw: dict

    @property
    def has_d2t(self) -> bool:
        return self.draft_vocab_size < self.vocab_size


@dataclass(frozen=True)
class Eagle3:
    """EAGLE-3 as the `Algorithm` protocol (runtime/algorithms/base.py) answers it."""

    name: str = "eagle3"
    title: str = "EAGLE-3"
    architecture: str | None = ARCHITECTURE
    needs_trained_draft: bool = True
    takes_hidden_states: bool = True
    drafts_block: bool = False               # chain drafting: one forward per drafted token
    has_draft_vocab: bool = True
    shares_target_head: bool = False         # its own lm_head (ModelOpt writes the base model's when it has none)
    first_layer_norm_choice: bool = True     # hidden_norm(input_layernorm(h)) trained vs hidden_norm(h) served
    capture_key: str | None = f"{CAPTURE_SECTION}.{CAPTURE_KEY}"
    capture_field: str | None = "aux_layer_ids"
    capture_count: int | None = CAPTURE_LAYERS
    trtllm_decoding_type: str = "Eagle3"
    trtllm_two_model: bool = True
    trtllm_layers_to_capture: bool = True
    trtllm_renamed_weights: bool = True
    fp8_draft: bool = True
    vllm_method: str = "eagle3"
    speculators_model_type: str | None = "eagle3"

    def parse(self, cfg: dict) -> Eagle3Config:
        missing = [k for k in CONFIG_KEYS if k != "draft_vocab_size" and cfg.get(k) is None]
        ids = capture_layer_ids(cfg)
        if missing or ids is None:
            raise DraftExportError(f"EAGLE-3 config.json lacks {missing or [self.capture_key]}; re-export with ModelOpt's "
                                   "export_speculative_decoding")
        V = int(cfg["vocab_size"])
        return Eagle3Config(int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), V,
                            int(cfg.get("draft_vocab_size") or V), tuple(sorted(ids)),
                            bool(cfg[CAPTURE_SECTION].get("use_last_layernorm", True)), cfg)

    def check_export(self, ex: Export, *, target: TargetShape | None = None) -> list[Problem]:
        return check_export(ex, target=target)

    def capture_layers(self, cfg: dict) -> list[int] | None:
        return capture_layer_ids(cfg)

    def draft_len_cap(self, block_size: int | None = None) -> int | None:
        return None


EAGLE3 = Eagle3()
