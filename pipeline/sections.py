"""The bases of every config model (pipeline/config.py's shared sections, each stage's `Config`): strict pydantic
models. They live apart from pipeline/stage.py so that the stage contract can name the whole config's type
(`StageContext.config: pipeline.config.PipelineConfig`) while pipeline/config.py builds on these bases, without an
import cycle; pipeline/stage.py re-exports them, where stage modules import them from."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base for every config model: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class StageSection(Strict):
    """Base for a stage's config section. Every stage can be switched off."""

    enabled: bool = True
