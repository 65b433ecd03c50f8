"""The Algorithm protocol (runtime/algorithms/base.py) and the rules it exists for: callers ask an algorithm's traits
instead of comparing its name as a string, the draft config's capture-layer key is spelled in runtime/algorithms/ (and
the one writer of another format that shares its spelling), and "allow 4 capture layers" / "rename the capture key"
are each an edit of one file. The counts are taken over the code with `ast`, so a comment or a docstring that names
the key does not count and a comparison written `"eagle3" == x` or `x in ("eagle3", "dflash")` does."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from support import REPO

NAMES = {"eagle3", "dflash", "ngram"}
CODE_DIRS = ("pipeline", "stages", "runtime", "bench")
# Comparisons with an algorithm name left on purpose, each for its reason (a label, not the algorithm to branch on):
ALLOWED_NAME_COMPARISONS = {
    # validate's per-domain comparison labels the arm that pays more "ngram" or "trained" (acceptance.json)
    "runtime/trtllm/ngram_deployment.py": 1,
    # the benchmark's arms are named plain / trained / ngram / hybrid
    "bench/hybrid_bench.py": 1,
}
CAPTURE_KEY = "eagle_aux_hidden_state_layer_ids"
# Files outside runtime/algorithms/ that may spell it: speculators' own config field of the same name (a different
# format, numbered from 1: runtime/vllm/speculators_config.py SPECULATORS_CAPTURE_KEY)
CAPTURE_KEY_WRITERS = {"runtime/vllm/speculators_config.py"}


def _py_files(root: Path, dirs=CODE_DIRS):
    for d in dirs:
        yield from sorted((root / d).rglob("*.py"))


def _compares_a_name(node: ast.Compare) -> bool:
    """`x == "eagle3"`, `"dflash" != x`, `x in ("eagle3", ...)`; not `"ngram" in doc` (a key looked up in data)."""
    left = node.left
    for op, right in zip(node.ops, node.comparators, strict=True):
        if isinstance(op, (ast.Eq, ast.NotEq)) and any(isinstance(x, ast.Constant) and x.value in NAMES
                                                      for x in (left, right)):
            return True
        if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)) and any(
                isinstance(e, ast.Constant) and e.value in NAMES for e in right.elts):
            return True
        left = right
    return False


def name_comparisons(root: Path, dirs=CODE_DIRS) -> dict[str, list[int]]:
    """file -> the lines comparing something with an algorithm name (==, !=, in / not in a literal holding one)."""
    out: dict[str, list[int]] = {}
    for f in _py_files(root, dirs):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Compare) and _compares_a_name(node):
                out.setdefault(str(f.relative_to(root)), []).append(node.lineno)
    return out


def code_strings(f: Path) -> list[str]:
    """The string constants of a module's code: docstrings and other bare string statements left out."""
    tree = ast.parse(f.read_text(), str(f))
    bare = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in bare]


def capture_key_spellings(root: Path) -> set[str]:
    """Files outside runtime/algorithms/ whose code spells a draft config's capture-layer key: EAGLE-3's key, or
    DFlash's (`target_layer_ids` read where `dflash_config` is read)."""
    out = set()
    for f in _py_files(root):
        rel = str(f.relative_to(root))
        if rel.startswith("runtime/algorithms/"):
            continue
        s = code_strings(f)
        if any(CAPTURE_KEY in x for x in s) or ("dflash_config" in s and "target_layer_ids" in s):
            out.add(rel)
    return out


def test_algorithm_names_are_compared_as_strings_fewer_than_10_times():
    found = name_comparisons(REPO)
    over = {f: lines for f, lines in found.items() if len(lines) > ALLOWED_NAME_COMPARISONS.get(f, 0)}
    assert not over, (f"comparisons of an algorithm name as a string: {over}; ask the algorithm instead "
                      "(runtime/algorithms/registry.py get(name).<trait>, runtime/algorithms/base.py)")
    assert sum(len(v) for v in found.values()) < 10


def test_the_capture_key_is_spelled_in_runtime_algorithms_and_the_writers_only():
    assert capture_key_spellings(REPO) <= CAPTURE_KEY_WRITERS


def test_the_counts_see_what_they_count(tmp_path):
    """The scans find what they look for (they would pass vacuously otherwise): a comparison written any way round,
    a membership test, the key inside an f-string; and not a docstring, a comment or a key looked up in data."""
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "m.py").write_text(
        '"""eagle_aux_hidden_state_layer_ids in a docstring"""\n'
        '# algorithm == "eagle3" in a comment\n'
        'def f(a, cfg):\n'
        '    """a == "dflash" in a docstring"""\n'
        '    x = a == "eagle3" or "dflash" != a or a in ("eagle3", "dflash") or a.kind not in {"ngram"}\n'
        '    y = "ngram" in cfg\n'
        '    return x, f"{cfg}.eagle_aux_hidden_state_layer_ids"\n')
    assert name_comparisons(tmp_path, ("runtime",)) == {"runtime/m.py": [5, 5, 5, 5]}
    assert capture_key_spellings(tmp_path) == {"runtime/m.py"}


def test_every_algorithm_answers_the_protocol():
    from runtime.algorithms import base
    from runtime.algorithms.registry import ALGORITHMS, get

    assert set(ALGORITHMS) == NAMES
    traits = [k for k in base.Algorithm.__annotations__]
    for name, algo in ALGORITHMS.items():
        assert isinstance(algo, base.Algorithm) and algo.name == name and get(name.upper()) is algo and get(algo) is algo
        assert all(hasattr(algo, t) for t in traits), name
        with pytest.raises(dataclasses.FrozenInstanceError):
            algo.name = "other"
    assert [a.name for a in ALGORITHMS.values() if a.needs_trained_draft] == ["eagle3", "dflash"]
    assert [a.name for a in ALGORITHMS.values() if a.drafts_block] == ["dflash"]
    assert (get("eagle3").trtllm_decoding_type, get("dflash").trtllm_decoding_type, get("ngram").trtllm_decoding_type) \
        == ("Eagle3", "DFlash", "NGram")


def test_an_unknown_name_is_refused_with_the_known_ones():
    from runtime.algorithms.registry import UnknownAlgorithm, get

    with pytest.raises(UnknownAlgorithm, match="unknown speculative-decoding algorithm 'medusa': expected one of "
                                               "eagle3, dflash, ngram"):
        get("medusa")
    assert issubclass(UnknownAlgorithm, ValueError)


def test_parse_gives_a_frozen_typed_value_and_names_what_is_missing():
    from runtime.algorithms.dflash import DFLASH
    from runtime.algorithms.eagle3 import EAGLE3
    from runtime.algorithms.export import DraftExportError
    from runtime.algorithms.ngram import NGRAM

    e = EAGLE3.parse({"hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 100, "draft_vocab_size": 50,
                      "eagle_config": {CAPTURE_KEY: [5, 1, 3]}})
    assert e.capture_layers == (1, 3, 5) and e.has_d2t and e.use_last_layernorm
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.hidden_size = 9
    with pytest.raises(DraftExportError, match=r"eagle_config\.eagle_aux_hidden_state_layer_ids"):
        EAGLE3.parse({"hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 100, "eagle_config": {}})
    d = DFLASH.parse({"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 100, "block_size": 4,
                      "dflash_config": {"mask_token_id": 99, "target_layer_ids": [2, 0]}})
    assert (d.capture_layers, d.max_draft_len, d.causal) == ((2, 0), 3, False)
    with pytest.raises(DraftExportError, match=r"dflash_config\.mask_token_id"):
        DFLASH.parse({"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 100, "block_size": 4,
                      "dflash_config": {"target_layer_ids": [0]}})
    assert NGRAM.parse({"k": 3, "min_n": 1, "max_n": 4}) == NGRAM.parse({"k": 3, "min_n": 1, "max_n": 4})
    with pytest.raises(ValueError, match="min_n 5 must be in 1..max_n"):
        NGRAM.parse({"k": 3, "min_n": 5, "max_n": 4})
    assert (EAGLE3.draft_len_cap(), DFLASH.draft_len_cap(4), NGRAM.draft_len_cap()) == (None, 3, None)
    assert NGRAM.capture_layers({}) is None and NGRAM.check_export({"k": 0, "min_n": 1, "max_n": 2})[0].check == "k"


def test_allowing_4_capture_layers_is_one_constant(monkeypatch):
    """What `eagle3.CAPTURE_LAYERS` governs follows it: the config's aux_layer_ids, the training check of the
    target's depth, the export's deployable fc. Set to 4 (as editing eagle3.py would), 4 layers pass everywhere."""
    from runtime.algorithms import eagle3
    from runtime.training.algorithm import shape_problems
    from stages.train_draft import Eagle3

    with pytest.raises(ValueError, match="capture exactly 3"):
        Eagle3(kind="eagle3", aux_layer_ids=[0, 1, 2, 3])
    monkeypatch.setattr(eagle3, "CAPTURE_LAYERS", 4)
    a = Eagle3(kind="eagle3", aux_layer_ids=[0, 1, 2, 3])
    assert shape_problems(a, 8, 100, "n", "v") == []
    assert eagle3.deployable_fc(4 * 16, 16) == "" and "4 x hidden" in eagle3.deployable_fc(3 * 16, 16)


def test_renaming_the_capture_key_is_one_constant(monkeypatch):
    """ModelOpt's key read and written through `eagle3.CAPTURE_KEY`: renamed there, the parse, the export check, the
    training config written for ModelOpt and the speculators conversion's check all use the new name."""
    from runtime.algorithms import eagle3
    from runtime.algorithms.export import Export
    from runtime.vllm.speculators_config import check_eagle3_config

    monkeypatch.setattr(eagle3, "CAPTURE_KEY", "capture_ids")
    cfg = {"hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 16, "draft_vocab_size": 16, "num_attention_heads": 2,
           "num_key_value_heads": 1, "intermediate_size": 16,
           "eagle_config": {"capture_ids": [0, 1, 2], "use_aux_hidden_state": True}}
    assert eagle3.EAGLE3.parse(cfg).capture_layers == (0, 1, 2) == tuple(eagle3.EAGLE3.capture_layers(cfg))
    assert not [p for p in eagle3.check_export(Export("x", cfg, {}, None)) if p.check in ("config_keys", "eagle_config")]
    assert check_eagle3_config(cfg, 4, "x") == [0, 1, 2]


def test_the_training_config_for_modelopt_writes_the_renamed_key(monkeypatch):
    """The writer: the config runtime/training/model.py hands ModelOpt's `mtsp.convert` names the capture layers with
    `eagle3.CAPTURE_KEY` (not fast: it imports ModelOpt, ~20 s here)."""
    from runtime.algorithms import eagle3
    from runtime.training.model import convert_config

    monkeypatch.setattr(eagle3, "CAPTURE_KEY", "capture_ids")
    job = {"algorithm": {"name": "eagle3", "draft_layers": 1, "intermediate_size": None, "aux_layer_ids": [0, 1, 2],
                         "draft_vocab_size": 16, "ttt_steps": 2, "loss_decay_factor": 0.9},
           "target": {"intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
                      "vocab_size": 16}, "torch_compile": False, "export_rope_scaling": None}
    mode, mo = convert_config(job, offline=False)
    assert mode == "eagle" and mo["eagle_architecture_config"]["capture_ids"] == [0, 1, 2]
