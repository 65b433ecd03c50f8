"""Small helpers the stage tests and their real-model counterparts (tests/e2e) share: a config file, JSONL inputs,
the `-o` overrides that stop a build after a stage, a committed split's rows, train_draft's AL invariant."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml


def only_upto(stage: str) -> list[str]:
    """`-o <later stage>.enabled=false` for every registered stage after `stage`."""
    from pipeline import registry

    names = registry.names()
    return [x for n in names[names.index(stage) + 1:] for x in ("-o", f"{n}.enabled=false")]


def config_file(tmp_path: Path, target: dict, data: dict | None = None) -> Path:
    """A config file with these `target` (and `data`) sections, the rest defaults."""
    p = tmp_path / "cfg.yaml"
    doc = {"target": target}
    if data is not None:
        doc["data"] = data
    p.write_text("# test config\n" + yaml.safe_dump(doc))
    return p


def jsonl(tmp_path: Path, rows: list, name: str = "train.jsonl", raw_lines: list[str] = ()) -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(x + "\n" for x in raw_lines))
    return p


def parquet_rows(wd: Path, split: str) -> list[dict]:
    """The rows of the data stage's committed `<split>.parquet`."""
    import pyarrow.parquet as pq

    return pq.read_table(wd / "artifacts" / "data" / f"{split}.parquet").to_pylist()


def assert_al_is_the_counts(acc: dict) -> None:
    """The runtime estimate's AL is (steps + accepted) / steps of its own counts, overall and per domain (not just
    inside the definitional [1, 1 + k]); accepted tokens never exceed drafted ones."""
    doms = acc["domains"].values()
    steps, accepted = sum(d["steps"] for d in doms), sum(d["accepted"] for d in doms)
    assert steps > 0 and acc["acceptance_length"] == pytest.approx((steps + accepted) / steps, abs=1e-6)
    for d in doms:
        assert 0 <= d["accepted"] <= d["drafted"] and d["acceptance_length"] == pytest.approx(
            (d["steps"] + d["accepted"]) / d["steps"], abs=1e-6)
