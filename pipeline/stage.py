"""The one small contract every stage module in `stages/` follows.

A stage module is plain Python with these module-level names (checked by `pipeline.registry`):

    NAME: str                      # "quantize"; also the name of its config section
    CONSUMES: tuple[str, ...]      # stages whose committed artifacts it reads, e.g. ("target", "data")
    VERSION: str                   # bump when the artifact's meaning or format changes (`--keep` then refuses
                                   # to carry an old artifact; the code counts too: the stage module and every
                                   # runtime/ and pipeline/artifacts/ file it imports, pipeline/codehash.py)
    PACKAGES: tuple[str, ...]      # distributions whose versions enter the fingerprint
    Config: type[StageSection]     # pydantic model of its config section (extra="forbid")
    def run(ctx: StageContext) -> dict:   # writes only into ctx.out_dir, returns JSON-able metrics

and optionally (every hook the pipeline reads; `pipeline.registry` picks them up by name)

    USES: tuple[str, ...]          # shared sections (e.g. "hardware", "build") that enter its fingerprint; with
                                   # "hardware", a `hardware.profile` file's content enters it too
    EXECUTION_ONLY: tuple[str, ...]  # dotted fields of its own section that say where it runs, not what it
                                   # produces (a rendezvous host, a node rank): kept out of its fingerprint
    EXECUTION_ONLY_CODE: dict[str, str]  # {dotted runtime module: why} that says how it runs, not what it
                                   # produces (data: the vLLM server it may start): its code fingerprint does not
                                   # follow those imports (pipeline/codehash.py; a test checks each is reached)
    REQUIRED: bool                 # its config section must be given (it has required fields; `target`)
    def check(cfg) -> list[tuple[str, str]]   # cross-section checks before anything runs: (dotted path, message)
    def fingerprint_extra(section) -> dict | None   # local inputs the section points at (a model directory, a
                                   # JSONL file): their sizes and mtimes enter the fingerprint
    def resolved(section, device_type) -> dict   # what the section resolves to on this machine where that changes
                                   # the artifact (train_draft: its auto dtypes, bf16 only where the CPU runs it
                                   # natively fast); `device_type()` the device the stages will run on. It enters
                                   # the fingerprint: a machine that resolves it otherwise reruns the stage
    def report(artifact: Artifact) -> str     # an HTML fragment for `specpipe report`
    def report_failed(metrics: dict) -> str   # the fragment for a failed run's metrics (`StageError.metrics`);
                                   # used only by a stage that also has `report`
                                   # imports inside these two (and under TYPE_CHECKING) stay out of the
                                   # code fingerprint: report-only code never reruns a stage

Config reads across sections: a stage reads `ctx.config.<section>` only for its own section, `run` (never
fingerprinted), a section in USES, or the section of a stage it consumes (directly or not: that stage's
fingerprint holds it). tests/unit/test_architecture.py checks this. `run.device` is resolved once by the runner
(`pipeline.device`): a stage reads `ctx.device`, never `run.device`.

Rules that keep the pipeline honest:
- Import heavy libraries (torch, transformers, modelopt, datasets) inside `run`, never at module top:
  `plan`, `status` and a fully-skipped `build` must not pay for them.
- Stages never import each other. Shared code lives in `runtime/` (executing models and artifacts) or in
  `pipeline/` (infrastructure).
- Read inputs only through `ctx.inputs[name]` (an `Artifact`: its directory, manifest and metrics), and their
  files through the contract's reader in `pipeline.artifacts` where it has one.
- Write only into `ctx.out_dir`. It becomes the committed artifact after `run` returns; on any exception
  it is thrown away. Long work that must survive an interruption (checkpoints, hidden-state dumps)
  goes into `ctx.scratch_dir`, which is keyed by the stage's fingerprint and kept until commit.
- Raise `pipeline.errors.StageError` for expected failures (a gate, a check) with a message that says
  what was expected, what was found and what to do; the runner logs it and exits 1. `runtime/` raises its own
  `runtime.errors.RuntimeFailure` (it never imports `pipeline`); the runner reports those the same way.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.sections import StageSection, Strict  # noqa: F401 - the stage modules' bases, imported from here

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig
    from pipeline.device import ResolvedDevice
    from pipeline.progress import Progress


@dataclass
class Artifact:
    """A committed stage output, as a later stage sees it."""

    stage: str
    path: Path            # the artifact directory (files the stage wrote, plus manifest.json)
    manifest: dict

    @property
    def metrics(self) -> dict:
        return self.manifest.get("metrics", {})

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    def read_json(self, rel: str) -> Any:
        return json.loads((self.path / rel).read_text())


@dataclass
class StageContext:
    name: str
    config: PipelineConfig         # the whole validated config (stages/config.py's root class)
    section: Any                   # this stage's own section (an instance of the module's Config)
    out_dir: Path                  # write here only
    scratch_dir: Path              # resumable work (checkpoints); survives a crash, removed after commit
    inputs: dict[str, Artifact]    # consumed stage name -> committed artifact
    workdir: Path
    fingerprint: str
    log: logging.Logger
    device: ResolvedDevice         # run.device resolved once by the runner (pipeline.device.resolve_device)

    def progress(self, iterable: Iterable | None = None, *, total: int | None = None, desc: str = "") -> Progress:
        """A progress bar on a terminal, periodic log lines otherwise. Use as a context manager:

            with ctx.progress(total=steps, desc="train") as bar:
                for step in ...: bar.update(1, loss=f"{loss:.3f}")
        """
        from pipeline.progress import Progress

        return Progress(self.log, total=total, desc=desc or self.name, iterable=iterable)

    def input(self, name: str) -> Artifact:
        try:
            return self.inputs[name]
        except KeyError:  # a contract bug, not a user error
            raise RuntimeError(f"stage {self.name} reads '{name}' but does not list it in CONSUMES") from None


def iter_files(root: Path) -> Iterator[Path]:
    """Every regular file under root, sorted, as paths relative to root."""
    for p in sorted(root.rglob("*")):
        if p.is_file():
            yield p.relative_to(root)
