"""The draft in the speculators format for vLLM, checked by the real speculators 0.9.0 library.

speculators cannot share the project's environment (it needs numpy >= 2; Triton's Python-backend stub needs
numpy < 2), so it lives in its own venv (`.ci/run` creates `.venv-speculators/`; elsewhere point
SPECPIPE_SPECULATORS_PYTHON at its python). Each check computes, in this process, the target's hidden states and
what specpipe's runtime drafts from them (runtime/engine/drafts/ `load_draft`, runtime/engine/speculative.py), saves inputs
and expectations, then runs tests/support/speculators_check.py with the speculators venv's python, which loads the
speculators export with the library's own classes, runs the library's forward on the same hidden states and
returns its argmax. The runtime's first-layer norm is `serving`: speculators' Eagle3FirstLayerMixin (and vLLM's
llama_eagle3.py) compute hidden_norm(h), see runtime/vllm/speculators_format.py.

Upstream read for these tests:
- speculators 0.9.0 (PyPI wheel): models/eagle3/{config,core,model_definitions}.py, models/dflash/{config,core,
  attention,model_definitions}.py, model.py (DraftVocabMixin: t2d/d2t, verifier-owned embed_tokens/lm_head),
  config.py, models/utils.py (resolve_target_layer_ids: ids in [0, num_layers], distinct).
- vLLM (vllm-project/vllm), read through the code index: vllm/transformers_utils/configs/speculators/algos.py
  (upstream versions with update_dflash; the newest stored one, 055e47c2, is a shim to vllm/foundation/...;
  update_eagle3: `norm_before_residual` defaults to True when absent; update_dflash: capture ids = the aux ids,
  `dflash_config.target_layer_ids = [i - 1 ...]`, `causal = not sliding_window_non_causal`), base.py @ 052316ae
  (num_speculative_tokens = proposal_methods[0].speculative_tokens; `vllm serve <speculators dir>` serves
  verifier.name_or_path: transformers_utils/config.py maybe_override_with_speculators), model_executor/models/
  llama_eagle3.py @ 00bd1493 (names prefixed `model.` except lm_head, d2t -> draft_id_to_target_id, t2d skipped,
  embed_tokens optional; fc = 3 x hidden in that version), model_executor/models/llama.py (aux state L =
  `hidden_states + residual` entering layer L), v1/spec_decode/dflash.py @ 01046b9a (1 + num_speculative_tokens
  queries), model_executor/models/qwen3_dflash.py @ 036a00d1 (dflash_config.causal overrides every layer).
- ModelOpt 0.47 (installed): torch/speculative/plugins/modeling_eagle.py (first layer: residual = raw h, hidden
  half = hidden_norm(input_layernorm(h))), plugins/hf_eagle.py default_eagle_aux_layer_ids {1, L//2-1, L-4} on
  layer outputs, torch/export/plugins/hf_spec_export.py (tensor names, DFlash config).
"""
from __future__ import annotations

import copy
import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.engine.drafters import DFlashDrafter, Eagle3Drafter
from runtime.engine.drafts import load_draft
from runtime.engine.layers import positions_for
from runtime.engine.speculative import SpeculativeEngine
from runtime.engine.target import TargetRunner, load_target, target_shape
from runtime.vllm import speculators_format as S

from support import REPO, SUPPORT, missing, script_argv

CHECK = SUPPORT / "speculators_check.py"
SPEC_ENV = "SPECPIPE_SPECULATORS_PYTHON"
DEFAULT_PY = REPO / ".venv-speculators" / "bin" / "python"
CREATE = ("python3 -m venv .venv-speculators && .venv-speculators/bin/pip install torch==2.13.0 && "
          ".venv-speculators/bin/pip install speculators==0.9.0 torch==2.13.0 && "
          ".venv-speculators/bin/pip uninstall -y torchvision torchaudio")


def speculators_python() -> str:
    """The speculators venv's python. Absent: a failure under CI (CI=true), a skip with the command elsewhere."""
    py = os.environ.get(SPEC_ENV) or str(DEFAULT_PY)
    if Path(py).is_file():
        return py
    msg = (f"the speculators venv is missing ({SPEC_ENV}={os.environ.get(SPEC_ENV)!r}, default {DEFAULT_PY}); "
           f"create it from the repository root with: {CREATE}")
    missing(msg)


# ---------------------------------------------------------------------------------------------- expectations


@torch.no_grad()
def eagle3_expected(draft, runner: TargetRunner, seq: list[int], k: int) -> dict:
    """Target aux states of `seq`, and specpipe's runtime draft on them: step 0 at every position (the
    drafter's first pass over verified positions), steps 1..k-1 chained from each position's own pre-norm
    output with the next true tokens fed as the drafted ones (speculators' TTT forward does the same)."""
    tokens = torch.tensor([seq])
    runner.reset(1, tokens.shape[1] + 1)
    _, hid = runner.forward(tokens)
    aux, nxt = hid[0, :-1], tokens[0, 1:]                 # position i pairs aux[i] with the token after it
    T = aux.shape[0]
    cache = draft.new_cache(1, T + k, aux.device)
    pos, uniform = positions_for(cache.lengths, T, cache.capacity)
    logits, pre = draft.step(draft.fc(aux[None]), runner.embed(nxt[None]).to(aux.dtype), cache, pos, uniform)
    steps = [logits[0].argmax(-1)]
    rows = torch.arange(T)
    chain = draft.new_cache(T, T + k, aux.device)         # one row per position: its verified prefix, then its chain
    for layer in range(draft.num_layers):
        chain.k[layer][:] = cache.k[layer]
        chain.v[layer][:] = cache.v[layer]
    pre = pre[0]
    for j in range(1, k):
        tok = nxt[(rows + j).clamp(max=T - 1)]
        lg, pre = draft.step(pre[:, None], runner.embed(tok[:, None]).to(pre.dtype), chain, (rows + j)[:, None], None)
        steps.append(lg[:, 0].argmax(-1))
        pre = pre[:, 0]
    target_ids = draft.to_target_ids(torch.stack(steps))
    valid = rows[None] + torch.arange(k)[:, None] <= T - 1   # step j at i needs the true token i + j
    # the engine's own drafting path gives the same first token at the last position
    d = Eagle3Drafter(draft, runner)
    d.reset(1, T + k + 1)
    d.observe(aux[None], nxt[None], torch.tensor([T]))
    first = d.propose(tokens[:, -1], 1, 0.0, None)[0][0, 0]
    assert int(first) == int(target_ids[0, -1]), "test helper and Eagle3Drafter.propose disagree"
    return {"inputs": {"hidden": aux.float().contiguous(), "input_ids": nxt.contiguous(), "ttt_steps": torch.tensor(k)},
            "expected": target_ids, "valid": valid, "logits0": logits[0].float()}


@torch.no_grad()
def dflash_expected(draft, runner: TargetRunner, seq: list[int]) -> dict:
    """Target states of `seq`, and DFlashDrafter.propose for a block anchored at every position p >= 1
    (context = positions < p, anchor token seq[p]), all block_size - 1 slots."""
    tokens = torch.tensor([seq])
    N = tokens.shape[1]
    runner.reset(1, N + 1)
    _, hid = runner.forward(tokens)
    anchors = torch.arange(1, N)
    bs = draft.block_size
    d = DFlashDrafter(draft, runner)
    d.reset(len(anchors), N + bs)
    d.observe(hid.expand(len(anchors), -1, -1).contiguous(), None, anchors.clone())
    out, _ = d.propose(tokens[0, anchors], bs - 1, 0.0, None)
    return {"inputs": {"hidden": hid[0].float().contiguous(), "input_ids": tokens[0].contiguous(), "anchors": anchors},
            "expected": out, "valid": torch.ones_like(out, dtype=torch.bool)}


# ---------------------------------------------------------------------------------------------- running the check


@dataclass
class Case:
    name: str
    spec_dir: Path
    runs: list[dict] = field(default_factory=list)
    result: list[dict] = field(default_factory=list)
    loading: dict = field(default_factory=dict)


def build_case(name: str, draft_dir: Path, target_dir: Path, seqs: list[list[int]], k: int, work: Path,
               spec_dir: Path | None = None) -> Case:
    """Write the speculators export (unless `spec_dir` is an existing one) and the runtime's expectations."""
    if spec_dir is None:
        spec_dir = work / name / "speculators"
        S.write_speculators_draft(draft_dir, spec_dir, target_dir=target_dir, speculative_tokens=k)
    model = load_target(target_dir)
    draft = load_draft(draft_dir, target_shape(model), first_layer_norm="serving")
    runner = TargetRunner(model, draft.aux_layer_ids if draft.algorithm == "eagle3" else draft.target_layer_ids)
    case = Case(name, spec_dir)
    for i, seq in enumerate(seqs):
        r = eagle3_expected(draft, runner, seq, k) if draft.algorithm == "eagle3" else dflash_expected(draft, runner, seq)
        r["file"] = work / name / f"in{i}.safetensors"
        r["file"].parent.mkdir(parents=True, exist_ok=True)
        save_file(r.pop("inputs"), str(r["file"]))
        case.runs.append(r)
    return case


def run_check(cases: list[Case], work: Path) -> None:
    """One speculators process for all cases; fills case.result (outputs) and case.loading."""
    py = speculators_python()
    out = {c.name: [work / "out" / c.name / f"{i}.safetensors" for i in range(len(c.runs))] for c in cases}
    for files in out.values():
        for f in files:
            f.parent.mkdir(parents=True, exist_ok=True)
    manifest = {"cases": [{"name": c.name, "spec_dir": str(c.spec_dir), "loading": str(work / f"{c.name}.loading.json"),
                           "runs": [{"inputs": str(r["file"]), "output": str(o)}
                                    for r, o in zip(c.runs, out[c.name], strict=True)]}
                          for c in cases]}
    (work / "manifest.json").write_text(json.dumps(manifest))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    p = subprocess.run([py, str(CHECK), str(work / "manifest.json")], cwd=work, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, f"speculators check failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    for c in cases:
        c.loading = json.loads((work / f"{c.name}.loading.json").read_text())
        c.result = [load_file(str(o)) for o in out[c.name]]


def assert_same_drafts(case: Case) -> float:
    """100 % of compared positions equal; returns the number of compared positions."""
    info = case.loading
    assert info["speculators"] == S.SPECULATORS_VERSION
    assert info["not_in_checkpoint"] == [] and info["not_in_model"] == [] and info["nan_parameters"] == [], info
    assert info["differs_from_verifier"] == [], info
    total, bad = 0, []
    for i, (r, out) in enumerate(zip(case.runs, case.result, strict=True)):
        got = out["target_ids"] if "target_ids" in out else out["argmax"]
        assert got.shape == r["expected"].shape, (got.shape, r["expected"].shape)
        ok = (got == r["expected"]) | ~r["valid"]
        total += int(r["valid"].sum())
        for pos in (~ok).nonzero().tolist():
            top = out["logits"][tuple(pos)].topk(2).values
            bad.append((i, *pos, int(got[tuple(pos)]), int(r["expected"][tuple(pos)]), round(float(top[0] - top[1]), 6)))
    assert not bad, (f"{case.name}: speculators' draft differs from specpipe's runtime at {len(bad)} of {total} positions "
                     f"(run, step/anchor, position, speculators, runtime, speculators' top-1 margin): {bad[:12]}")
    for r, out in zip(case.runs, case.result, strict=True):     # EAGLE-3 step 0: the logits themselves, not only their argmax
        if "logits0" in r:
            ref = r["logits0"]
            assert float((out["logits"][0] - ref).abs().max()) <= 1e-4 * float(ref.abs().max()), case.name
    return total


# ---------------------------------------------------------------------------------------------- the writer alone


def _tiny():
    from support.tiny_models import tiny_assets

    return tiny_assets()


def _seqs(tiny, n=3, extra=12):
    """Prompts continued greedily by the target: realistic contexts for the draft."""
    model = load_target(tiny["target_dir"])
    prompts = tiny["prompts"][:n]
    gen = SpeculativeEngine(model, drafter=None).generate(prompts, max_new_tokens=extra).tokens
    return [p + g for p, g in zip(prompts, gen, strict=True)]


def test_eagle3_export_is_modelopt_names_plus_t2d_with_speculators_numbering(tmp_path):
    tiny = _tiny()
    src = tiny["eagle_d2t_dir"]
    spec = S.write_speculators_draft(src, tmp_path / "s", target_dir=tiny["target_dir"], speculative_tokens=3)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    dcfg = json.loads((src / "config.json").read_text())
    mo = dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    # speculators/vLLM number a state by the layer it enters, ModelOpt by the layer it leaves (module docstring)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in sorted(mo)] == spec.aux_hidden_state_layer_ids
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["norm_before_residual"] is False          # vLLM's update_eagle3 defaults an absent key to True
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(Path(tiny["target_dir"]).resolve())
    tl = cfg["transformer_layer_config"]
    assert tl["model_type"] == "llama" and tl["vocab_size"] == dcfg["vocab_size"] and tl["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 256 < tl["vocab_size"]
    src_sd = load_file(str(src / "model.safetensors"))
    out = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert set(out) == set(src_sd) | {"t2d", "embed_tokens.weight"}
    for k, v in src_sd.items():
        assert torch.equal(out[k], v), k
    # the verifier's embeddings, bit for bit (speculators 0.9.0 leaves a missing one uninitialized)
    assert torch.equal(out["embed_tokens.weight"],
                       load_file(str(tiny["target_dir"] / "model.safetensors"))["model.embed_tokens.weight"])
    target_ids = torch.arange(256) + out["d2t"]
    assert out["t2d"].dtype == torch.bool and out["t2d"].shape == (tl["vocab_size"],) and int(out["t2d"].sum()) == 256
    assert bool(out["t2d"][target_ids].all())


def test_dflash_export_maps_target_layer_ids_and_stays_bidirectional(tmp_path):
    tiny = _tiny()
    src = tiny["dflash_dir"]
    dcfg = json.loads((src / "config.json").read_text())
    spec = S.write_speculators_draft(src, tmp_path / "s", target_dir=tiny["target_dir"], speculative_tokens=2)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["block_size"] == dcfg["block_size"] == 4
    # vLLM's update_dflash: dflash_config.target_layer_ids = aux - 1 (ModelOpt's), causal = not sliding_window_non_causal
    assert [i - 1 for i in cfg["aux_hidden_state_layer_ids"]] == dcfg["dflash_config"]["target_layer_ids"]
    assert cfg["sliding_window_non_causal"] is True and cfg["sample_from_anchor"] is False
    assert cfg["mask_token_id"] == dcfg["dflash_config"]["mask_token_id"]
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    out = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert set(out) == set(load_file(str(src / "model.safetensors")))     # no embeddings, no lm_head, no d2t
    assert any("block of 4" in n or "blocks of 4" in n for n in spec.notes)  # 2 < block_size - 1: vLLM's block is shorter


def _edit(src: Path, dst: Path, fn_cfg=None, fn_sd=None) -> Path:
    shutil.copytree(src, dst)
    if fn_cfg:
        cfg = json.loads((dst / "config.json").read_text())
        fn_cfg(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if fn_sd:
        sd = load_file(str(dst / "model.safetensors"))
        fn_sd(sd)
        save_file(sd, str(dst / "model.safetensors"))
    return dst


def test_writer_refuses_what_the_format_cannot_carry(tmp_path):
    tiny = _tiny()
    t = tiny["target_dir"]

    def ids(v):
        return lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", v)

    cases = [
        (_edit(tiny["eagle_dir"], tmp_path / "dup", ids([1, 1])), "repeats a layer"),
        (_edit(tiny["eagle_dir"], tmp_path / "far", ids([1, 9])), "outside the target's 4 layers"),
        (_edit(tiny["eagle_dir"], tmp_path / "rev", ids([2, 1])), "not ascending"),
        (_edit(tiny["eagle_d2t_dir"], tmp_path / "nod2t", fn_sd=lambda sd: sd.pop("d2t")), "no d2t"),
        (_edit(tiny["eagle_dir"], tmp_path / "fp8", fn_sd=lambda sd: sd.update(
            {"fc.weight": sd["fc.weight"].to(torch.float8_e4m3fn), "fc.weight_scale": torch.tensor(1.0)})), "FP8"),
        (_edit(tiny["eagle_dir"], tmp_path / "extra", fn_sd=lambda sd: sd.update(
            {"midlayer.x.weight": torch.zeros(2)})), "unexpected tensors"),
        (_edit(tiny["dflash_dir"], tmp_path / "causal", lambda c: c["dflash_config"].__setitem__("causal", True)),
         "causal"),
    ]
    for d, msg in cases:
        with pytest.raises(S.SpeculatorsFormatError, match=msg):
            S.write_speculators_draft(d, tmp_path / f"out-{d.name}", target_dir=t, speculative_tokens=2)
    with pytest.raises(S.SpeculatorsFormatError, match="block_size - 1 = 3"):
        S.write_speculators_draft(tiny["dflash_dir"], tmp_path / "k", target_dir=t, speculative_tokens=4)


def test_export_stage_fails_loudly_on_a_draft_it_cannot_convert(tmp_path):
    """A draft the format cannot carry stops the export with a message naming the switch; with the switch off,
    export.json says nothing was written."""
    from pipeline.errors import StageError
    from stages import build, export

    from support.synthetic import gate, run_stage, write_checkpoints

    # a synthetic draft: not an EAGLE-3 export (no decoder tensors); the conversion runs the algorithm's check_export
    # first (runtime/algorithms/eagle3.py), so its first problem is what the message carries
    write_checkpoints(tmp_path)
    gate(tmp_path, True)
    run_stage(tmp_path, build, build.Config())
    with pytest.raises(StageError, match=r"speculators format for vLLM: .*train_draft/draft: eagle_config"
                                         r".*EAGLE-1/2 draft.*export.speculators: false"):
        run_stage(tmp_path, export, export.Config())
    assert not (tmp_path / "artifacts" / "export").exists()
    shutil.rmtree(tmp_path / ".tmp")
    out = run_stage(tmp_path, export, export.Config(speculators=False))
    assert json.loads((out / "export.json").read_text())["speculators"] is None and not (out / "speculators").exists()


# ---------------------------------------------------------------------------------------------- the library's verdict


@pytest.fixture(scope="module")
def tiny_cases(tmp_path_factory):
    """EAGLE-3 (full vocabulary, reduced vocabulary with d2t/t2d, YaRN RoPE), DFlash, and a control whose config
    flips norm_before_residual, all checked by one speculators process."""
    speculators_python()            # fail or skip before building anything
    tiny = _tiny()
    work = tmp_path_factory.mktemp("speculators")
    seqs = _seqs(tiny)
    t = tiny["target_dir"]
    cases = {n: build_case(n, tiny[d], t, seqs, k, work) for n, d, k in (
        ("eagle3", "eagle_dir", 3), ("eagle3_d2t", "eagle_d2t_dir", 4), ("eagle3_yarn", "eagle_yarn_dir", 3),
        ("dflash", "dflash_dir", 3))}
    control = copy.deepcopy(cases["eagle3_d2t"])
    control.name = "control"
    control.spec_dir = _edit(cases["eagle3_d2t"].spec_dir, work / "control" / "speculators",
                             lambda c: c.__setitem__("norm_before_residual", True))
    cases["control"] = control
    run_check(list(cases.values()), work)
    return cases


@pytest.mark.parametrize("name", ["eagle3", "eagle3_d2t", "eagle3_yarn", "dflash"])
def test_speculators_drafts_what_specpipes_runtime_drafts(tiny_cases, name):
    case = tiny_cases[name]
    n = assert_same_drafts(case)
    assert n >= 60
    assert case.loading["class"] == ("DFlashDraftModel" if name == "dflash" else "Eagle3DraftModel")


def test_the_check_sees_a_wrong_config(tiny_cases):
    """The same weights with vLLM's default norm_before_residual (true) draft differently: the comparison can fail."""
    case = tiny_cases["control"]
    with pytest.raises(AssertionError, match="differs from specpipe's runtime"):
        assert_same_drafts(case)


# ---------------------------------------------------------------------------------------------- the pipeline's export


def _pipeline(tiny_run):
    from conftest import artifact_dir

    wd, r = tiny_run
    assert (wd / "artifacts" / "export" / "manifest.json").exists(), r.stderr[-3000:]
    return {s: artifact_dir(wd, s) for s in ("train_draft", "quantize", "tune", "build", "export", "data")}


def test_export_writes_the_speculators_draft_with_the_tuned_deployment(tiny_run):
    a = _pipeline(tiny_run)
    doc = json.loads((a["export"] / "export.json").read_text())
    dep = json.loads((a["build"] / "deployment.json").read_text())
    tuning = json.loads((a["tune"] / "tuning.json").read_text())
    draft = json.loads((a["train_draft"] / "draft.json").read_text())
    s = doc["speculators"]
    spec = a["export"] / "speculators"
    cfg = json.loads((spec / "config.json").read_text())
    k = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert k == s["speculative_tokens"] == dep["max_draft_len"] == tuning["max_draft_len"]
    # the layer ids come from the draft, renumbered (the draft decides how many: fc = n x hidden)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in sorted(draft["aux_layer_ids"])]
    assert s["modelopt_layer_ids"] == sorted(draft["aux_layer_ids"])
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == dep["target_dir"] == s["verifier"]
    assert (Path(dep["target_dir"]) / "hf_quant_config.json").exists()     # the FP8 target is the verifier
    assert s["source_draft"] == str((a["train_draft"] / "draft").resolve())
    # the vllm serve command beside it, and in export.json and the report
    assert all(f.stat().st_mode & 0o444 == 0o444 for f in spec.iterdir())     # readable by a container's user
    script = spec / "serve_vllm.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("HOST", "PORT")}
    argv = script_argv(script, "--extra", **env)
    assert argv[:3] == ["vllm", "serve", dep["target_dir"]] and argv[-1] == "--extra"
    assert shlex.join(argv[:-1]) == s["vllm_serve"] and s["vllm_serve"] in (spec / "README.md").read_text()
    on_all = script_argv(script, **{**env, "HOST": "0.0.0.0", "PORT": "9000"})     # the container form
    assert on_all[on_all.index("--host") + 1] == "0.0.0.0" and on_all[on_all.index("--port") + 1] == "9000"
    sc = json.loads(argv[argv.index("--speculative-config") + 1])
    # vLLM 0.32 takes a draft length per batch size (runtime/vllm/serve.py): tune's best k per measured batch size
    from runtime.vllm import serve as V

    sched = V.schedule_from_predicted(tuning["predicted"])
    kmax, per_batch = V.vllm_schedule(sched) if sched else (k, None)
    assert sc == {"model": str(spec), "method": "eagle3", "num_speculative_tokens": kmax,
                  **({"num_speculative_tokens_per_batch_size": per_batch} if per_batch else {})}
    assert Path(sc["model"]).is_dir() and (per_batch or kmax == k)
    assert argv[argv.index("--max-model-len") + 1] == str(dep["max_seq_len"])
    kv = json.loads((Path(dep["target_dir"]) / "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"]
    assert ("--kv-cache-dtype" in argv) == (str(kv).upper() == "FP8")
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    from pipeline.stage import Artifact
    from stages import export

    html = export.report(Artifact("export", a["export"], {}))
    assert "speculators/serve_vllm.sh" in html and "eagle3" in html


def test_pipeline_pair_drafts_the_same_in_speculators(tiny_run, tmp_path):
    """The tiny pipeline's own pair: its FP8 target's hidden states, its draft as export wrote it for vLLM."""
    speculators_python()
    a = _pipeline(tiny_run)
    spec = a["export"] / "speculators"
    k = json.loads((spec / "config.json").read_text())["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    target = Path(json.loads((a["build"] / "deployment.json").read_text())["target_dir"])
    prompts = [json.loads(line)["prompt_ids"] for f in sorted((a["data"] / "eval").glob("*.jsonl"))
               for line in f.read_text().splitlines()[:2]]
    gen = SpeculativeEngine(load_target(target), drafter=None).generate(prompts, max_new_tokens=12).tokens
    case = build_case("pipeline", a["train_draft"] / "draft", target, [p + g for p, g in zip(prompts, gen, strict=True)], k,
                      tmp_path, spec_dir=spec)
    run_check([case], tmp_path)
    assert assert_same_drafts(case) >= 60


# ---------------------------------------------------------------------------------------------- the real model


def _smollm2_drafts(model_dir: Path, out: Path) -> dict:
    """ModelOpt EAGLE-3 (reduced vocabulary 8192 with d2t, ModelOpt's 3 default capture layers of 30, RoPE theta
    1e5 like the target) and DFlash (2 layers) drafts for SmolLM2, exported with export_speculative_decoding.
    Not trained: the format is what is checked; every norm weight is perturbed so that no two are interchangeable."""
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding
    from transformers import LlamaForCausalLM

    tc = json.loads((model_dir / "config.json").read_text())
    shape = {"intermediate_size": tc["intermediate_size"], "num_attention_heads": tc["num_attention_heads"],
             "num_key_value_heads": tc["num_key_value_heads"], "head_dim": tc["head_dim"]}

    def perturb(module, seed):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in module.parameters():
                if p.ndim == 1:
                    p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))

    m = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ec = copy.deepcopy(mtsp.EAGLE3_DEFAULT_CFG["config"])
    ec["eagle_architecture_config"].update({**shape, "num_hidden_layers": 1, "draft_vocab_size": 8192,
                                            "rope_theta": 100000.0,
                                            "rope_scaling": {"rope_type": "default", "rope_theta": 100000.0}})
    ec.update(eagle_use_torch_compile=False, eagle_export_rope_scaling={})
    mtsp.convert(m, [("eagle", ec)])
    top = torch.randperm(tc["vocab_size"], generator=torch.Generator().manual_seed(0))[:8192].sort().values
    m.eagle_module.d2t.copy_(top - torch.arange(8192))
    perturb(m.eagle_module, 1)
    export_speculative_decoding(m, export_dir=out / "eagle3")
    del m
    m = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dc = copy.deepcopy(mtsp.DFLASH_DEFAULT_CFG["config"])
    dc.update({"dflash_block_size": 4, "dflash_mask_token_id": tc.get("unk_token_id") or 0, "dflash_num_anchors": 8,
               "dflash_use_torch_compile": False,
               "dflash_architecture_config": {**shape, "num_hidden_layers": 2, "target_layer_ids": [3, 17]}})
    mtsp.convert(m, [("dflash", dc)])
    perturb(m.dflash_module, 2)
    export_speculative_decoding(m, export_dir=out / "dflash")
    return {"eagle3": out / "eagle3", "dflash": out / "dflash"}


@pytest.mark.slow
def test_real_model_pair_drafts_the_same_in_speculators(real_model, tmp_path):
    """SmolLM2-135M-Instruct (30 layers, tied embeddings, RoPE theta 1e5, 49152 tokens) with ModelOpt drafts."""
    speculators_python()
    from transformers import AutoTokenizer

    md = real_model["model_dir"]
    drafts = _smollm2_drafts(md, tmp_path / "drafts")
    tok = AutoTokenizer.from_pretrained(md)
    prompts = []
    for f in ("humaneval.jsonl", "gsm8k.jsonl"):
        row = json.loads((real_model["data_dir"] / f).read_text().splitlines()[0])
        text = tok.apply_chat_template(row["messages"][:1], tokenize=False, add_generation_prompt=True)
        prompts.append(tok(text)["input_ids"][-40:])
    gen = SpeculativeEngine(load_target(md), drafter=None).generate(prompts, max_new_tokens=16).tokens
    seqs = [p + g for p, g in zip(prompts, gen, strict=True)]
    cases = [build_case("smollm2_eagle3", drafts["eagle3"], md, seqs, 4, tmp_path),
             build_case("smollm2_dflash", drafts["dflash"], md, seqs, 3, tmp_path)]
    cfg = json.loads((cases[0].spec_dir / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]            # ModelOpt's {1, L//2-1, L-4} + 1
    assert cfg["transformer_layer_config"]["rope_parameters"]["rope_theta"] == 100000.0
    run_check(cases, tmp_path)
    for c in cases:
        assert assert_same_drafts(c) >= 300
