"""How long the synthetic benchmark tools pause (a setting of the agent worker)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class SyntheticPauses(BaseModel):
    """A lognormal body, and a share of long pauses drawn uniformly (slow APIs)."""

    median_s: float = Field(default=0.4, gt=0)
    sigma: float = Field(default=0.6, ge=0)
    long_share: float = Field(default=0.0, ge=0, le=1)
    long_min_s: float = Field(default=20.0, ge=0)
    long_max_s: float = Field(default=60.0, ge=0)
    max_s: float = Field(default=3.0, gt=0)
