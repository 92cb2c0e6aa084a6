"""Base classes for wire models: strict for what we own and save, lenient for OpenAI payloads."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A message we own: unknown fields are an error, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class OpenModel(BaseModel):
    """An OpenAI-shaped payload we pass through: unknown fields are kept."""

    model_config = ConfigDict(extra="allow")
