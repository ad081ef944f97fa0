"""The sidecar's settings: from the command line, or X1_BUDGET_* environment variables.

The provider's API key is not a setting: it is read from LAMBDA_API_KEY / RUNPOD_API_KEY when the
client is built and is never stored, logged or written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

STATE_SUFFIX = "-state.json"


class SidecarSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="X1_BUDGET_", extra="forbid", frozen=True)

    provider: Literal["lambda", "runpod", "static"] = Field(
        description="where the spend comes from: a cloud's API, or a fixed rate (static, on-prem)"
    )
    api_url: str | None = Field(None, description="provider base URL without the API path; None = the real API")
    instance_id: str = Field("", description="Lambda instance id or RunPod pod id (not needed for static)")
    poll_seconds: float = Field(300.0, gt=0, description="seconds between polls (5 min: the lab's cadence)")
    output: Path = Field(Path("/workspace/budget.json"), description="budget.json, rewritten atomically every poll")
    cap_usd: float = Field(35.0, gt=0, description="the hard cap, written into budget.json and /metrics")
    alert_usd: float = Field(30.0, gt=0, description="the alert line (informative here; the trainer alerts)")
    planned_hours: float | None = Field(
        None, gt=0, description="billed hours planned: projected = spent + rate x rest. None: projected = the spend so "
        "far (no remaining-time term; budget.json says so in `projection`), and the trainer's guard alone projects "
        "the rest, from its own steps and measured throughput"
    )
    rate_usd_per_hr: float | None = Field(None, gt=0, description="static provider only: the hourly rate")
    initial_hours: float = Field(
        0.0, ge=0, description="hours billed before the first poll (Lambda reports no launch time): charged at the first rate"
    )
    time_scale: float = Field(1.0, gt=0, description="TESTS AND DEMO ONLY: the billed-time clock runs this many times faster")
    stale_after_failures: int = Field(2, ge=1, description="failed polls in a row before budget.json says stale")
    http_timeout_s: float = Field(10.0, gt=0, description="timeout of one provider request")
    host: str = Field("127.0.0.1", description="bind address of /budget, /healthz, /metrics (0.0.0.0 inside compose)")
    port: int = Field(9792, ge=0, le=65535, description="HTTP port; 0 = no HTTP, budget.json only")

    @model_validator(mode="after")
    def _provider_needs(self) -> SidecarSettings:
        if self.provider == "static":
            if self.rate_usd_per_hr is None:
                raise ValueError("rate_usd_per_hr: the static provider needs --rate-usd-per-hr")
        else:
            if not self.instance_id:
                raise ValueError(f"instance_id: the {self.provider} provider needs --instance-id")
            if self.rate_usd_per_hr is not None:
                raise ValueError(f"rate_usd_per_hr: only for the static provider; {self.provider} reads its price")
        if self.api_url is not None and not self.api_url.startswith(("http://", "https://")):
            raise ValueError(f"api_url: {self.api_url!r} must start with http:// or https://")
        if self.alert_usd > self.cap_usd:
            raise ValueError(f"alert_usd: {self.alert_usd:g} is above cap_usd={self.cap_usd:g}")
        return self

    @property
    def projection_basis(self) -> str:
        """What projected_total_usd counts, in words (budget.json's `projection`, the poll log line)."""
        if self.planned_hours is None:
            return "spent only: no planned hours"
        return f"spent + rate x the rest of {self.planned_hours:g} planned hours"

    @property
    def state_path(self) -> Path:
        """Where the ledger persists between restarts: budget.json → budget-state.json beside it."""
        return self.output.with_name(self.output.stem + STATE_SUFFIX)
