"""Stage `validate` in a whole `specpipe build` of the tiny pipeline (`tiny_run`, tests/integration): an impossible gate
fails the build at validate with the table, keeps the earlier passing artifact and blocks every later stage. The
stage's other tests: test_validate.py."""
from __future__ import annotations

import json
import shutil

import pytest

# ---------------------------------------------------------------------------------------------- end to end


def test_impossible_gate_blocks_later_stages(tiny_run, tmp_path):
    """`specpipe build` on the tiny default: validate commits acceptance.json; with an impossible gate the same
    build fails at validate (exit 1) with the table, and nothing after it runs."""
    from pipeline import registry

    from conftest import TINY_CONFIG, artifact_dir, run_cli, status_json, tiny_overrides

    if "validate" not in registry.names():
        pytest.fail("stages.validate is not registered")
    wd, r = tiny_run
    a = json.loads((artifact_dir(wd, "validate") / "acceptance.json").read_text())
    assert a["lossless"]["passed"] and a["domains"]
    wd2 = tmp_path / "run"
    shutil.copytree(wd, wd2)
    # the 40-step toy target repeats itself, so its draft can be nearly perfect (AL 8.5 of 9 measured at k=8):
    # "impossible" = every draft token accepted everywhere AND the FP8 pair 50 % better than the BF16 pair
    r2 = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd2), *tiny_overrides(), "-o", "validate.max_draft_len=8",
                 "-o", "validate.gates.min_overall_acceptance_length=9", "-o", "validate.gates.min_retention=1.5")
    assert r2.returncode == 1, r2.stderr
    assert "acceptance gate failed" in r2.stderr and "FAIL" in r2.stderr
    st = {s["name"]: s for s in status_json(wd2)["stages"]}
    assert st["validate"]["last_build"] == "failed" and "1.500" in st["validate"]["error"]
    fm = st["validate"]["failed_metrics"]
    assert fm["gates"]["passed"] is False and any(r["required"] == 1.5 and not r["passed"] for r in fm["gates"]["rows"])
    kept = json.loads((wd2 / "artifacts" / "validate" / "acceptance.json").read_text())   # the earlier, passing run
    assert kept == a and kept["measured_draft_len"] != 8                                       # nothing committed now
    after = registry.names()[registry.names().index("validate") + 1:]
    assert all(st[n]["last_build"] == "blocked" for n in after)
