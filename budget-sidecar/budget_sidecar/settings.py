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
    instance_id: str = Field(
        "", description="Lambda instance id or RunPod pod id (not needed for static); a run on several hosts lists "
        "every host's, comma-separated (id1,id2): each is priced and the spend is their sum"
    )
    nodes: int = Field(
        1, ge=1, description="hosts the run bills (NNODES). static: the rate is per host and counted this many times; "
        "a provider: the number of instance ids must match (a host left out of --instance-id would not be counted)"
    )
    poll_seconds: float = Field(300.0, gt=0, description="seconds between polls (5 min: the lab's cadence)")
    output: Path = Field(Path("/workspace/budget.json"), description="budget.json, rewritten atomically every poll")
    cap_usd: float = Field(35.0, gt=0, description="the hard cap, written into budget.json and /metrics")
    alert_usd: float = Field(30.0, gt=0, description="the alert line (informative here; the trainer alerts)")
    planned_hours: float | None = Field(
        None, gt=0, description="billed hours planned: projected = spent + rate x rest. None: projected = the spend so "
        "far (no remaining-time term; budget.json says so in `projection`), and the trainer's guard alone projects "
        "the rest, from its own steps and measured throughput"
    )
    rate_usd_per_hr: float | None = Field(None, gt=0, description="static provider only: the hourly rate of one host")
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
            ids = self.instance_id.split(",")
            if any(not i.strip() or i != i.strip() for i in ids) or len(set(ids)) != len(ids):
                raise ValueError(f"instance_id: {self.instance_id!r} must be ids separated by single commas, each once")
            if self.nodes > 1 and len(ids) != self.nodes:
                raise ValueError(f"instance_id: {self.nodes} nodes (NNODES) but {len(ids)} instance id(s) given; list "
                                 "every host's id, comma-separated, so that each one's price is counted")
        if self.api_url is not None and not self.api_url.startswith(("http://", "https://")):
            raise ValueError(f"api_url: {self.api_url!r} must start with http:// or https://")
        if self.alert_usd > self.cap_usd:
            raise ValueError(f"alert_usd: {self.alert_usd:g} is above cap_usd={self.cap_usd:g}")
        return self

    @property
    def instance_ids(self) -> list[str]:
        """The provider's ids of the run's hosts (one for a single host); [] for static."""
        return self.instance_id.split(",") if self.instance_id else []

    @property
    def parts(self) -> list[str]:
        """What budget.json itemizes for a run on several hosts: each instance id, or for static
        node-1..node-N; [] for one host (its figures are the total's)."""
        names = self.instance_ids if self.provider != "static" else [f"node-{n}" for n in range(1, self.nodes + 1)]
        return names if len(names) > 1 else []

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
