"""The deployment records: tuning.json (tune), deployment.json (build), export.json (export) as frozen types that
write themselves (`to_json`) and read themselves back (`from_json`), so each schema is spelled here once
(docs/architecture.md "Artifact contracts"). The readers that check the files and name the stage to rerun are
pipeline/artifacts/tune.py, build.py and export.py.

Draft-length names: `max_draft_len` here is the deployed schedule's largest draft length (TensorRT-LLM's
`max_draft_len` in the options build writes); the length validate measured at is acceptance.json's
`measured_draft_len` (runtime/records_validate.py). The schedule itself is one `DraftSchedule`
(runtime/algorithms/schedule.py), written up to the deployment's `max_batch_size`."""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.algorithms.schedule import DraftSchedule


def _schedule_json(schedule: DraftSchedule, max_batch: int | None) -> dict:
    """The schedule up to `max_batch` (where a document has none: up to its last run's first batch size)."""
    return schedule.to_json(max_batch or max(a for a, _, _ in schedule.runs))


@dataclass(frozen=True)
class TuningInfo:
    """tuning.json: the draft-length schedule the deployment runs, its limits, what was priced, the predicted table."""

    deployment: dict                      # trtllm_version, mode, algorithm, the schedule policy (name, note, ...)
    draft_schedule: DraftSchedule
    max_batch_size: int                   # 64 where tuning.json holds none
    speculation: bool = True              # some batch size gets a draft (max_draft_len > 0)
    max_draft_len: int | None = None      # the deployed schedule's largest k
    max_num_tokens: int | None = None
    cuda_graph_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])   # where tuning.json holds none
    context_length: int | None = None
    kv_capacity_sequences: int | None = None
    hardware: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)       # shapes and precisions the cost model priced
    acceptance: dict = field(default_factory=dict)   # the curves priced: per_position, weights, draft_len, measured_draft_len
    predicted: list = field(default_factory=list)    # the per-batch table
    prediction_check: dict | None = None
    sa_enhancer: dict | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def note(self) -> str:
        return self.deployment.get("note") or "see tuning.json"

    def to_json(self) -> dict:
        return {"deployment": self.deployment, "speculation": self.speculation, "max_draft_len": self.max_draft_len,
                "draft_schedule": _schedule_json(self.draft_schedule, self.max_batch_size),
                "max_batch_size": self.max_batch_size, "max_num_tokens": self.max_num_tokens,
                "cuda_graph_batch_sizes": list(self.cuda_graph_batch_sizes), "context_length": self.context_length,
                "kv_capacity_sequences": self.kv_capacity_sequences, "hardware": self.hardware, "models": self.models,
                "acceptance": self.acceptance, "predicted": self.predicted, "prediction_check": self.prediction_check,
                "sa_enhancer": self.sa_enhancer}

    @classmethod
    def from_json(cls, doc: dict) -> TuningInfo:
        acc = doc.get("acceptance") or {}
        if "K" in acc:     # written before the glossary's renames: `report` of an old workdir
            acc = {("draft_len" if k == "K" else "measured_draft_len" if k == "source_max_draft_len" else k): v
                   for k, v in acc.items()}
            doc = {**doc, "acceptance": acc}
        schedule = DraftSchedule.from_json(doc["draft_schedule"])
        mbs = int(doc["max_batch_size"] or 64)
        return cls(deployment=dict(doc["deployment"] or {}), draft_schedule=schedule, max_batch_size=mbs,
                   speculation=bool(doc.get("speculation", True)),
                   max_draft_len=doc["max_draft_len"] if "max_draft_len" in doc else schedule.max_draft_len(mbs),
                   max_num_tokens=doc.get("max_num_tokens"),
                   cuda_graph_batch_sizes=[int(b) for b in doc.get("cuda_graph_batch_sizes") or [1, 2, 4, 8]],
                   context_length=doc.get("context_length"), kv_capacity_sequences=doc.get("kv_capacity_sequences"),
                   hardware=doc.get("hardware") or {}, models=doc.get("models") or {}, acceptance=acc,
                   predicted=list(doc.get("predicted") or []), prediction_check=doc.get("prediction_check"),
                   sa_enhancer=doc.get("sa_enhancer"), raw=doc)


@dataclass(frozen=True)
class CheckRow:
    """One named check build ran on what it wrote (runtime/trtllm/checks.py)."""

    name: str
    ok: bool
    message: str

    def to_json(self) -> dict:
        return {"name": self.name, "ok": self.ok, "message": self.message}


@dataclass(frozen=True)
class DeploymentInfo:
    """deployment.json: what build deployed (the LLM-API options file, the draft TensorRT-LLM loads, the schedule)."""

    trtllm_version: str
    serving_image: str
    target_dir: str                       # absolute, as build resolved them
    draft_dir: str | None                 # the draft as train_draft/quantize wrote it; None without speculation
    options_file: str                     # relative to the artifact
    draft_schedule: DraftSchedule         # as the written options run it
    trtllm_draft_dir: str | None = None   # the draft TensorRT-LLM loads (renamed layers); an old document: `draft_dir`
    algorithm: str | None = None          # eagle3 | dflash; None where deployment.json does not say
    mode: str | None = None
    speculation: bool = True              # whether a draft is deployed (True where deployment.json does not say)
    decoding_type: str | None = None
    backend: str = "pytorch"
    draft_weight_names: dict | None = None   # the layer renaming of deployment/draft, when one was needed
    eagle3_layers_to_capture: list[int] | None = None   # as the options write it (TensorRT-LLM's name)
    max_draft_len: int | None = None      # the deployed schedule's largest k
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_seq_len: int | None = None
    enable_chunked_prefill: bool = False
    schedule_note: str | None = None
    acceptance_guard: dict | None = None
    acceptance_guard_note: str | None = None
    bench: dict = field(default_factory=dict)    # prompts, requests, concurrency, model_name of bench.sh
    load: dict = field(default_factory=dict)     # whether TensorRT-LLM loaded the options here, or why not
    checks: tuple[CheckRow, ...] = ()
    workdir: str | None = None
    ngram: dict | None = None             # the n-gram deployment beside it (build.ngram)
    sa_enhancer: dict | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def schedule(self) -> DraftSchedule:
        """The draft length per batch size the deployment runs (`k_at(batch)`)."""
        return self.draft_schedule

    def schedule_json(self) -> dict:
        """The schedule as deployment.json writes it: `{"runs": [[first, last, k], ...]}` up to max_batch_size."""
        return _schedule_json(self.draft_schedule, self.max_batch_size)

    def to_json(self) -> dict:
        return {"trtllm_version": self.trtllm_version, "serving_image": self.serving_image, "backend": self.backend,
                "algorithm": self.algorithm, "mode": self.mode, "speculation": self.speculation,
                "decoding_type": self.decoding_type, "target_dir": self.target_dir, "draft_dir": self.draft_dir,
                "trtllm_draft_dir": self.trtllm_draft_dir, "draft_weight_names": self.draft_weight_names,
                "eagle3_layers_to_capture": self.eagle3_layers_to_capture, "max_draft_len": self.max_draft_len,
                "max_batch_size": self.max_batch_size, "max_num_tokens": self.max_num_tokens,
                "max_seq_len": self.max_seq_len, "enable_chunked_prefill": self.enable_chunked_prefill,
                "draft_schedule": self.schedule_json(), "schedule_note": self.schedule_note,
                "acceptance_guard": self.acceptance_guard,
                "acceptance_guard_note": self.acceptance_guard_note, "options_file": self.options_file,
                **{f"bench_{k}": v for k, v in self.bench.items()}, "load": self.load,
                "checks": [c.to_json() for c in self.checks], "workdir": self.workdir, "ngram": self.ngram,
                "sa_enhancer": self.sa_enhancer}

    @classmethod
    def from_json(cls, doc: dict) -> DeploymentInfo:
        return cls(trtllm_version=doc["trtllm_version"], serving_image=doc["serving_image"], target_dir=doc["target_dir"],
                   draft_dir=doc["draft_dir"], options_file=doc["options_file"],
                   draft_schedule=DraftSchedule.from_json(doc["draft_schedule"]),
                   trtllm_draft_dir=doc["trtllm_draft_dir"] if "trtllm_draft_dir" in doc else doc["draft_dir"],
                   algorithm=doc.get("algorithm"), mode=doc.get("mode"), speculation=bool(doc.get("speculation", True)),
                   decoding_type=doc.get("decoding_type"), backend=doc.get("backend") or "pytorch",
                   draft_weight_names=doc.get("draft_weight_names"),
                   eagle3_layers_to_capture=doc.get("eagle3_layers_to_capture"), max_draft_len=doc.get("max_draft_len"),
                   max_batch_size=doc.get("max_batch_size"), max_num_tokens=doc.get("max_num_tokens"),
                   max_seq_len=doc.get("max_seq_len"), enable_chunked_prefill=bool(doc.get("enable_chunked_prefill")),
                   schedule_note=doc.get("schedule_note"), acceptance_guard=doc.get("acceptance_guard"),
                   acceptance_guard_note=doc.get("acceptance_guard_note"),
                   bench={k[len("bench_"):]: v for k, v in doc.items() if k.startswith("bench_")},
                   load=doc.get("load") or {}, workdir=doc.get("workdir"), ngram=doc.get("ngram"),
                   checks=tuple(CheckRow(str(c["name"]), bool(c["ok"]), str(c.get("message", "")))
                                for c in doc.get("checks") or []),
                   sa_enhancer=doc.get("sa_enhancer"), raw=doc)


@dataclass(frozen=True)
class ExportInfo:
    """export.json: what export wrote (the Triton repositories, the speculators draft for vLLM, the speculation
    profile and its alerts) and the identity of the exported files `specpipe monitor` compares the served ones with."""

    model_name: str
    trtllm_version: str
    serving_image: str
    triton_image: str | None              # None: no Triton image ships that TensorRT-LLM version
    decoupled: bool
    container_path: str
    speculation: bool
    prompt_format: dict                   # runtime/serving/prompt_format.py's, plus the file it is in
    cpu_repository: str | None            # "triton_cpu", or None when not written
    config_pbtxt: dict                    # each config.pbtxt (relative) -> "parsed" or why not
    speculators: dict | None = None       # the speculators draft for vLLM (runtime/vllm/speculators_format.py), or None
    speculation_profile: dict | None = None
    monitoring: dict | None = None        # the alert rules and dashboard written beside the profile
    served_identity: dict | None = None   # role -> sha256 of config/tokenizer/weights (pipeline/monitor_diagnosis.py)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def to_json(self) -> dict:
        return {"model_name": self.model_name, "trtllm_version": self.trtllm_version, "triton_image": self.triton_image,
                "serving_image": self.serving_image, "decoupled": self.decoupled, "container_path": self.container_path,
                "speculation": self.speculation, "prompt_format": self.prompt_format,
                "cpu_repository": self.cpu_repository, "config_pbtxt": self.config_pbtxt, "speculators": self.speculators,
                "speculation_profile": self.speculation_profile, "monitoring": self.monitoring,
                "served_identity": self.served_identity}

    @classmethod
    def from_json(cls, doc: dict) -> ExportInfo:
        return cls(model_name=doc["model_name"], trtllm_version=doc["trtllm_version"], serving_image=doc["serving_image"],
                   triton_image=doc.get("triton_image"), decoupled=bool(doc.get("decoupled")),
                   container_path=doc.get("container_path") or "", speculation=bool(doc.get("speculation")),
                   prompt_format=doc.get("prompt_format") or {}, cpu_repository=doc.get("cpu_repository"),
                   config_pbtxt=doc.get("config_pbtxt") or {}, speculators=doc.get("speculators"),
                   speculation_profile=doc.get("speculation_profile"), monitoring=doc.get("monitoring"),
                   served_identity=doc.get("served_identity"), raw=doc)
