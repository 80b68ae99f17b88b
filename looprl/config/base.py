"""What every config section shares: strict validation, no unknown keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # strict: "true" is not a group size and 4.0 is not a rank; no NaN/inf anywhere
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False
    )
