"""The run config: one typed section per concern, loaded from YAML, overridden from the command line.

    cfg = load_config("configs/x1-50m-a100.yaml", sets=["optim.lr=1e-3"])

Every field says its unit and why its default. Unknown keys, wrong types and impossible values
raise ConfigError naming the field (the commands turn it into exit 2): every number must be finite
(no .inf, no .nan), a key repeated in one YAML mapping is an error (YAML would keep the last one
silently), and a file that is not UTF-8 text is named as such. Derived values (head dim,
padded vocab, gradient accumulation) are computed here and nowhere else. `config_hash` covers what
defines the run's math, so a resume with a different optimizer, schedule or model is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from x1_common.contracts import read_file_bytes


class ConfigError(ValueError):
    """A config that cannot run. The message starts with the dotted field name."""


def _yaml_word(v: object) -> object:
    """A bare on / off, in a file or in --set, is a boolean to YAML: give the word back."""
    return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class _Section(BaseModel):
    # allow_inf_nan: `lr: .inf` is a float to YAML and would otherwise pass `gt=0`.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def flag(name: str, group: str = "run") -> dict[str, Any]:
    """`Field(..., json_schema_extra=flag("--log-every"))`: the field is also one of the trainer's flags.
    train/parser.py makes the flag from the field (its type, its description as the help, its
    default shown), so a flag is one edit here. group: "run", "budget" or "ops" (--help's sections)."""
    return {"flag": name, "group": group}


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key repeated in one mapping (YAML keeps the last one silently:
    a section written twice loses the first's settings without a word)."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` may be overridden by the keys after it
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node)
        except TypeError:  # an unhashable key: the base constructor names it
            continue
        if first is not key_node:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark,
                f"key {key!r} appears twice (first on line {first.start_mark.line + 1}); YAML would keep only the last",
                key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def yaml_load(text: str) -> Any:
    """yaml.safe_load, refusing duplicated keys."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


class ModelConfig(_Section):
    """The 50M Llama-style decoder of docs/DESIGN.md §4, under the lab's hyperparameter names."""

    n_layer: int = Field(8, ge=1, description="transformer blocks")
    d_model: int = Field(768, ge=8, description="residual width")
    n_head: int = Field(12, ge=1, description="query heads; head dim = d_model / n_head")
    n_kv_head: int = Field(4, ge=1, description="key/value heads (GQA): groups of n_head / n_kv_head share K/V")
    d_ff: int = Field(2048, ge=1, description="SwiGLU hidden width (~2.7 x d_model)")
    seq_len: int = Field(1024, ge=2, description="context length in tokens")
    vocab_size: int = Field(50257, ge=2, description="GPT-2 BPE")
    pad_vocab_to_multiple_of: int = Field(
        64, ge=1, description="embedding rows padded up (50257 -> 50304) for tensor-core-sized matmuls; padded logits never count"
    )
    norm: Literal["rmsnorm"] = "rmsnorm"
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon (Llama's)")
    act: Literal["swiglu"] = "swiglu"
    pos_enc: Literal["rope"] = "rope"
    rope_base: float = Field(10000.0, gt=0, description="RoPE theta")
    init_std: float = Field(0.02, gt=0, description="std of the normal init of every matrix (GPT-2 / Llama)")
    scaled_residual_init: bool = Field(
        False, description="GPT-2's std / sqrt(2 n_layer) for the residual output projections; off = the lab's plain 0.02"
    )
    tie_embeddings: Literal[True] = Field(True, description="output head shares the input embedding (88.9M total)")
    attention: Literal["sdpa", "flash-attn"] = Field(
        "sdpa", description="PyTorch SDPA (cuDNN attention on an H100/H200: what every GPU figure measured); "
        "flash-attn: flash_attn_func, the same math, only when asked for (and logged), where it imports"
    )

    @field_validator("attention", mode="before")
    @classmethod
    def _auto_is_sdpa(cls, v: object) -> object:
        # Configs and checkpoints written before said `auto`, which picked flash-attn wherever it
        # imported: a path never measured. Read now as what was measured.
        return "sdpa" if v == "auto" else v

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def family(self) -> str:
        """What a smaller model of the same family shares with this one, in words (a scaling ladder's
        provenance): the block, the head grouping, the SwiGLU and depth-to-width ratios."""
        groups = self.n_head // self.n_kv_head
        return (f"decoder {self.norm}/{self.act}/{self.pos_enc}/tied, {groups} query heads per kv head, "
                f"d_ff/d_model {self.d_ff / self.d_model:.3f}, d_model/n_layer {self.d_model / self.n_layer:.0f}")

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_to_multiple_of
        return (self.vocab_size + m - 1) // m * m

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.d_model % self.n_head:
            raise ValueError(f"n_head: {self.n_head} does not divide d_model={self.d_model}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head: {self.n_kv_head} does not divide n_head={self.n_head}")
        if self.head_dim % 2:
            raise ValueError(f"n_head: head dim d_model / n_head = {self.head_dim} must be even for RoPE")
        return self


class OptimConfig(_Section):
    """AdamW with linear warmup and cosine decay (the lab's table)."""

    lr: float = Field(3e-4, gt=0, description="peak learning rate (Llama-2's)")
    min_lr: float = Field(3e-5, ge=0, description="floor of the cosine decay, reached at the last step")
    warmup_steps: int = Field(1000, ge=0, description="linear warmup from 0, in optimizer steps")
    schedule: Literal["cosine"] = "cosine"
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1, description="0.95 rather than 0.999: damps spikes faster (PaLM)")
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0, description="on matrices only, never on norms or the embedding")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
    fused: Literal["auto", "on", "off"] = Field("auto", description="fused AdamW kernel: auto = on CUDA")

    @field_validator("fused", mode="before")
    @classmethod
    def _on_off(cls, v: object) -> object:
        return _yaml_word(v)

    @model_validator(mode="after")
    def _lrs(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr: {self.min_lr} is above lr={self.lr}")
        return self


class TrainConfig(_Section):
    tokens_per_step: int = Field(524288, ge=1, description="tokens per optimizer step (512K); fixed whatever the world size")
    micro_batch_size: int = Field(32, ge=1, description="sequences per forward pass on one GPU; accumulation = the rest")
    total_steps: int = Field(84000, ge=1, description="optimizer steps; the cosine ends here",
                             json_schema_extra=flag("--total-steps"))
    seed: int = Field(42, ge=0, description="model init and data order")
    precision: Literal["bf16-mixed", "fp32"] = Field(
        "bf16-mixed", description="bf16 autocast over fp32 master weights; fp32 for CPU tests"
    )
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="auto: cuda when available")
    compile: bool = Field(True, description="torch.compile the model; falls back to eager, and says so, if it fails")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="default: max-autotune measured no faster on this model for minutes more compile; "
        "reduce-overhead (CUDA graphs) runs with accumulation but measured within noise of default"
    )
    kernels: Literal["auto", "torch", "triton"] = Field(
        "auto", description="our Triton kernels for cross-entropy, RoPE and SwiGLU (CUDA); auto = on when Triton runs"
    )
    compiled_autograd: bool = Field(
        False, description="compile the whole backward, gradient accumulation included (one process; off under "
        "torchrun, where DDP and FSDP2 hook the accumulation)"
    )
    log_every: int = Field(10, ge=1, description="steps between metric logs", json_schema_extra=flag("--log-every"))
    eval_every: int = Field(1800, ge=1, description="steps between val evals", json_schema_extra=flag("--eval-every"))
    eval_windows: int = Field(128, ge=1, description="fixed val windows per eval (x seq_len tokens)")
    cooldown_probes: tuple[float, ...] = Field(
        (), description="shares of the run (e.g. [0.025, 0.05, 0.1]) at which a short cooldown is forked from the "
        "run's weights, evaluated and dropped: an annealed point at the run's own size for the final-loss forecast "
        "(docs/FORECAST.md). The run itself continues bit for bit as without them. Empty: off"
    )
    cooldown_probe_share: float = Field(
        0.15, gt=0, le=1, description="a probe's length as a share of the steps (tokens) seen at its fork: Hägele et "
        "al. 2024 find cooldowns of 10-20% land where a full schedule of that length would. Its learning rate goes "
        "from the run's at the fork to optim.min_lr, the schedule's floor"
    )
    expected_tokens_per_sec: float | None = Field(
        None, gt=0, description="tokens/s this run expects over all its GPUs: the figure "
        "you gave `plan --tokens-per-sec`. None: plan's figure for the GPU the trainer finds (accounting.py) x the "
        "world size; none on a CPU. The launch check and the default throughput floor use it",
            json_schema_extra=flag("--expected-tokens-per-sec", "budget")
    )
    min_tokens_per_sec: float | None = Field(
        None, ge=0, description="warn when a steady log interval of the first hour is under this many tokens/s. "
        "None: floor_fraction x the expected throughput (no floor where none is expected, as on a CPU); 0: off"
    )
    floor_fraction: float = Field(
        0.6, gt=0, le=1, description="the default floor as a share of the expected throughput: the lab's ratio "
        "(its 300k floor of its 500k estimate; that estimate is 98% of an A100's peak, the ratio is sound)"
    )
    max_nonfinite_in_row: int = Field(5, ge=1, description="non-finite steps in a row before exit 79")
    spike_factor: float = Field(1.5, gt=1, description="a loss over factor x its EMA is a spike")
    spike_ema_beta: float = Field(0.98, gt=0, lt=1, description="EMA of the loss the detector compares against")
    distributed: Literal["ddp", "fsdp2"] = Field("ddp", description="under torchrun: DDP, or FSDP2 fully_shard")
    residual: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype of the residual stream between blocks under bf16-mixed: fp32 (the embedding's "
        "dtype, as plain autocast leaves it) or bf16 (as TorchTitan's bf16 training keeps it): every norm and "
        "residual add then moves half the bytes; the norms still compute in fp32"
    )
    weight_casts: Literal["per-step", "per-micro-step"] = Field(
        "per-step", description="under bf16-mixed, the weights' bf16 copies for the matmuls: taken once per optimizer "
        "step and shared by its micro-steps, or by autocast at every micro-step. The same values either way (one "
        "process without float8; elsewhere per micro-step)"
    )
    grad_accumulation: Literal["autograd", "in-matmul"] = Field(
        "autograd", description="with weight_casts=per-step, how the micro-steps' weight gradients add up: by "
        "autograd into each .grad (a bf16 gradient per micro-step, cast and added), or in-matmul: each "
        "weight-gradient matmul adds into an fp32 buffer itself, which becomes .grad after the step's last "
        "micro-step (the same sums, without the bf16 rounding of each micro-step's part)"
    )
    cublaslt: Literal["auto", "off"] = Field(
        "auto", description="every matmul of the step at the cuBLASLt algorithm chosen by timing on this GPU "
        "(kept in X1_CUBLASLT_CACHE): +1.4-2.2% on an H200; auto = on a CUDA GPU where libcublasLt loads; off = "
        "cuBLAS's first algorithm (PyTorch's)"
    )
    gpu_arch: Literal["auto", "sm80", "sm90"] = Field(
        "auto", description="the GPU architecture the levers are chosen for: auto = the GPU found; sm80 = the "
        "lever set of an A100 on any newer GPU (to measure an A100's configuration on an H100/H200)"
    )
    float8: Literal["off", "tensorwise", "rowwise"] = Field(
        "off", description="torchao float8 matmuls for the blocks' linear layers (GPUs of compute capability 8.9+: "
        "H100, H200, L4, L40S); the tied head stays bf16. Off in the 50M configs: at d_model 768 it measured "
        "slower (docs/PERFORMANCE.md)"
    )

    @field_validator("float8", "cublaslt", mode="before")
    @classmethod
    def _off(cls, v: object) -> object:
        return _yaml_word(v)

    @field_validator("cooldown_probes", mode="after")
    @classmethod
    def _probe_shares(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        bad = [s for s in v if not 0 < s < 1]
        if bad:
            raise ValueError(f"each is a share of the run in (0, 1), got {bad[0]!r}")
        if len(set(v)) != len(v):
            raise ValueError(f"a share is given twice: {list(v)}")
        return tuple(sorted(v))

    @model_validator(mode="after")
    def _probes_within_run(self) -> TrainConfig:
        late = [s for s in self.cooldown_probes if s * (1 + self.cooldown_probe_share) > 1]
        if late:
            raise ValueError(f"cooldown_probes: a probe at {late[0]:g} of the run, {self.cooldown_probe_share:g} x its "
                             "steps long, would run past the run's last step; fork it earlier or shorten "
                             "train.cooldown_probe_share")
        return self

    @model_validator(mode="after")
    def _accumulation_needs_step_copies(self) -> TrainConfig:
        if self.grad_accumulation == "in-matmul" and self.weight_casts != "per-step":
            raise ValueError("grad_accumulation: in-matmul adds into the buffers of the step's bf16 weights, which "
                             f"weight_casts={self.weight_casts} does not take; use weight_casts=per-step")
        return self

    def grad_accum(self, seq_len: int, world_size: int = 1) -> int:
        per_pass = self.micro_batch_size * seq_len * world_size
        if self.tokens_per_step % per_pass:
            raise ConfigError(
                f"train.tokens_per_step: {self.tokens_per_step} is not divisible by micro_batch_size x seq_len x "
                f"world_size = {self.micro_batch_size} x {seq_len} x {world_size} = {per_pass}"
            )
        return self.tokens_per_step // per_pass


class DataConfig(_Section):
    dir: str = Field("/workspace/data/tokenized", description="holds train.bin, val.bin, meta.json",
                     json_schema_extra=flag("--data-dir"))
    prefetch: int = Field(4, ge=0, description="micro-batches prepared ahead on a background thread")
    pin_memory: bool = Field(True, description="page-locked host buffers so the copy to the GPU overlaps compute")


class CheckpointConfig(_Section):
    dir: str = Field("/workspace/checkpoints", description="step_XXXXXXXX/ folders and the latest pointer",
                     json_schema_extra=flag("--ckpt-dir"))
    every: int = Field(1800, ge=1, description="steps between checkpoints (~30 min on an A100)",
                       json_schema_extra=flag("--ckpt-every"))
    keep_last: int = Field(3, ge=1, description="complete checkpoints kept; older ones are deleted")


class BudgetConfig(_Section):
    """The guard (docs/DESIGN.md §6). It is on only when cap_usd is set (--budget-cap-usd)."""

    cap_usd: float | None = Field(None, gt=0, description="hard cap: projected over it → checkpoint, exit 76; spent "
                                  "over it → exit 77; None = guard off",
                                  json_schema_extra=flag("--budget-cap-usd", "budget"))
    alert_usd: float = Field(30.0, gt=0, description="email + Slack once per crossing",
                             json_schema_extra=flag("--budget-alert-usd", "budget"))
    curr_cost_uri: str = Field("/workspace/budget.json", description="budget.json path or the sidecar's /budget URL",
                               json_schema_extra=flag("--budget-curr-cost-uri", "budget"))
    check_every_min: float = Field(30.0, gt=0, description="minutes between readings",
                                   json_schema_extra=flag("--budget-check-every-min", "budget"))
    stale_after_min: float = Field(15.0, gt=0, description="a reading older than this raises a stale-data alert",
                                   json_schema_extra=flag("--budget-stale-after-min", "budget"))
    max_price_usd_per_hr: float = Field(1.40, gt=0, description="the lab's price ceiling for launch",
                                        json_schema_extra=flag("--max-price-usd-per-hr", "budget"))
    planned_rate_usd_per_hr: float | None = Field(None, gt=0, description="planned price: rate > 1.2x this warns",
                                                  json_schema_extra=flag("--planned-rate-usd-per-hr", "budget"))
    planned_hours: float | None = Field(None, gt=0, description="planned hours for the pre-launch sentence",
                                        json_schema_extra=flag("--planned-hours", "budget"))
    first_reading_timeout_min: float = Field(5.0, gt=0, description="wait this long for a first reading, then exit 78")
    margin: float = Field(
        0.10, ge=0, le=1, description="the trainer's own projection adds this share of the time it still needs "
        "(throughput drifts by a few percent; restarts not seen yet): it shrinks as the run nears its end"
    )


    @model_validator(mode="after")
    def _alert_within_cap(self) -> BudgetConfig:
        # The sidecar refuses the same pair: a line above the cap would never alert before the stop.
        if self.cap_usd is not None and self.alert_usd > self.cap_usd:
            raise ValueError(f"budget.alert_usd: {self.alert_usd:g} is above budget.cap_usd={self.cap_usd:g}: the "
                             "alert would come after the stop; give --budget-alert-usd at or below the cap")
        return self


class TrackingConfig(_Section):
    mlflow_uri: str = Field("file:///workspace/mlruns", description="file://, sqlite:// or http://",
                            json_schema_extra=flag("--mlflow-uri"))
    experiment: str = Field("x1-pretraining", description="MLflow experiment name")
    run_name: str | None = Field(None, description="MLflow run name; default: config name + start time")
    parent_run_id: str | None = Field(None, description="MLflow run this one is a child of (a scaling ladder's rungs "
                                      "are children of the ladder's run)")
    metrics_port: int = Field(9791, ge=0, le=65535, description="Prometheus /metrics; 0 disables",
                              json_schema_extra=flag("--metrics-port", "ops"))
    metrics_host: str = Field("127.0.0.1", description="address /metrics listens on; 0.0.0.0 inside a container",
                              json_schema_extra=flag("--metrics-host", "ops"))
    heartbeat_file: str = Field("/workspace/logs/heartbeat.json", description="read by the watchdog",
                                json_schema_extra=flag("--heartbeat-file", "ops"))


class RunConfig(_Section):
    name: str = Field("x1", description="config name, shown in logs and MLflow")
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    budget: BudgetConfig = BudgetConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _divides(self) -> RunConfig:
        self.train.grad_accum(self.model.seq_len, 1)  # raises ConfigError naming the field
        return self

    @model_validator(mode="after")
    def _warmup_within_run(self) -> RunConfig:
        if self.optim.warmup_steps > self.train.total_steps:
            raise ValueError(
                f"optim.warmup_steps: {self.optim.warmup_steps} is more than train.total_steps={self.train.total_steps}: "
                "the learning rate would never reach its peak nor decay; lower it (--set optim.warmup_steps=N)")
        return self

    def grad_accum(self, world_size: int = 1) -> int:
        return self.train.grad_accum(self.model.seq_len, world_size)

    def math_dict(self) -> dict[str, Any]:
        """What defines the run's math: model, data order, optimizer, schedule (incl. total steps).

        Not the micro-batch (an OOM fallback halves it, same math), nor paths, ports, logging,
        compile or checkpoint cadence.
        """
        t = self.train
        return {
            "model": self.model.model_dump(mode="json", exclude={"attention"}),
            "optim": self.optim.model_dump(mode="json", exclude={"fused"}),
            "train": {"tokens_per_step": t.tokens_per_step, "total_steps": t.total_steps, "seed": t.seed,
                      "precision": t.precision, **({"float8": t.float8} if t.float8 != "off" else {}),
                      **({"residual": t.residual} if t.residual != "fp32" else {})},
        }

    def config_hash(self) -> str:
        blob = json.dumps(self.math_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def resolved(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


@dataclass(frozen=True)
class CliFlag:
    """One field of RunConfig marked with `flag`."""

    name: str  # --total-steps
    path: str  # train.total_steps
    group: str
    type: type
    help: str
    default: Any

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


def flags() -> list[CliFlag]:
    """Every field of the run config that is a flag, in the order the sections declare them."""
    found = []
    for section, sf in RunConfig.model_fields.items():
        model = sf.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        for name, f in model.model_fields.items():
            extra = f.json_schema_extra
            if not (isinstance(extra, dict) and "flag" in extra):
                continue
            kind = next((a for a in get_args(f.annotation) if a is not type(None)), f.annotation)
            found.append(CliFlag(str(extra["flag"]), f"{section}.{name}", str(extra["group"]), kind,
                                 f.description or "", f.default))
    return found


# The trainer's flags of docs/DESIGN.md §3 -> config fields (the train command applies them after
# --set): every field marked with `flag`, dest -> dotted path ("data_dir" -> "data.dir").
CLI_FLAGS = {f.dest: f.path for f in flags()}


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node: Any = tree
    model: type[BaseModel] = RunConfig
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            where = ".".join(parts[:i]) or "the config"
            known = ", ".join(model.model_fields)
            raise ConfigError(f"{dotted}: unknown field {part!r} in {where} (known: {known})")
        if i == len(parts) - 1:
            node[part] = value
            return
        annotation = field.annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            raise ConfigError(f"{dotted}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {'.'.join(parts[: i + 1])} must be a mapping")
        model = annotation


def parse_set(item: str) -> tuple[str, Any]:
    """`section.field=value`, the value read as YAML (so 1e-3, true, null and [1, 2] work)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.field=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot read value {raw!r}: {e}") from e
    return key.strip(), value


def _format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = [str(p) for p in err["loc"]]
        msg = err["msg"].removeprefix("Value error, ")
        # Cross-field checks name their field first ("n_head: 7 does not divide ..."): fold it into loc.
        head, sep, rest = msg.partition(": ")
        if sep and head.replace("_", "").replace(".", "").isalnum() and " " not in head:
            loc, msg = [*loc, head] if "." not in head else [head], rest
        loc = ".".join(loc) or "config"
        got = err.get("input")
        tail = "" if isinstance(got, dict) or err["type"] in ("missing", "value_error") else f" (got {got!r})"
        lines.append(f"{loc}: {msg}{tail}")
    return "; ".join(lines)


def build_config(tree: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def load_config(
    path: str | Path | None = None,
    sets: list[str] | tuple[str, ...] = (),
    overrides: dict[str, Any] | None = None,
) -> RunConfig:
    """YAML file, then `--set` items, then explicit dotted overrides (the lab's flags)."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            raw = read_file_bytes(p, max_bytes=1 << 20)
            loaded = yaml_load(raw.decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {p}: no such file") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
        except (OSError, ValueError) as e:  # a folder, a FIFO, unreadable, too big
            raise ConfigError(f"config file {str(e) if str(p) in str(e) else f'{p}: {e}'}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p}: not valid YAML: {e}") from None
        except RecursionError:
            raise ConfigError(f"config file {p}: nested too deeply") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping of sections")
        tree = loaded
        tree.setdefault("name", p.stem)
    for item in sets:
        key, value = parse_set(item)
        _set_path(tree, key, value)
    for key, value in (overrides or {}).items():
        _set_path(tree, key, value)
    return build_config(tree)


def config_from_dict(resolved: dict[str, Any]) -> RunConfig:
    """Rebuild a config saved by `RunConfig.resolved()` (checkpoints, safetensors metadata)."""
    return build_config(resolved)


def model_config_from_json(text: str) -> ModelConfig:
    try:
        return ModelConfig.model_validate(json.loads(text))
    except (ValidationError, json.JSONDecodeError) as e:
        raise ConfigError(f"model config in weights file: {e}") from None
