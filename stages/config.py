"""The whole config file, declared: the shared sections (`run`, `hardware`, `vllm`: pipeline/config.py) and one
section per stage, each the stage module's own `Config`, in run order. `ctx.config` is an instance of this class;
`pipeline.registry.root_config()` loads it and checks it names exactly the registered stages (a stage added to
the registry without its section here, or the other way round, is an error at start)."""
from __future__ import annotations

import warnings

from pydantic import Field

from pipeline.config import HardwareConfig, RunConfig, VllmConfig
from pipeline.stage import Strict
from stages import build as build_stage
from stages import data as data_stage
from stages import export as export_stage
from stages import quantize as quantize_stage
from stages import target as target_stage
from stages import train_draft as train_draft_stage
from stages import tune as tune_stage
from stages import validate as validate_stage

with warnings.catch_warnings():   # the section `validate` shadows pydantic's deprecated BaseModel.validate
    warnings.filterwarnings("ignore", message='Field name "validate"', category=UserWarning)

    class PipelineConfig(Strict):
        """A specpipe config file. Only `target` is required (what to load or build); every other section has full
        defaults (the tiny route's)."""
        run: RunConfig = Field(default_factory=RunConfig)
        hardware: HardwareConfig = Field(default_factory=HardwareConfig)
        vllm: VllmConfig = Field(default_factory=VllmConfig)
        target: target_stage.Config
        data: data_stage.Config = Field(default_factory=data_stage.Config)
        train_draft: train_draft_stage.Config = Field(default_factory=train_draft_stage.Config)
        quantize: quantize_stage.Config = Field(default_factory=quantize_stage.Config)
        validate: validate_stage.Config = Field(default_factory=validate_stage.Config)
        tune: tune_stage.Config = Field(default_factory=tune_stage.Config)
        build: build_stage.Config = Field(default_factory=build_stage.Config)
        export: export_stage.Config = Field(default_factory=export_stage.Config)
