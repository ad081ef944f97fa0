"""The trainer's supported torch range, and what each speed lever needs, probed once at start-up.

    features = probe(device, arch="auto")          # what this torch and this GPU offer
    cfg, table = resolve(cfg, features)            # the config with every unmet lever switched off

The range: `TORCH_FLOOR` is the oldest torch the trainer runs correctly on, with fewer levers
(below it the trainer refuses at launch, exit 2); `TORCH_MEASURED` (+ `CUDA_MEASURED`) is what the
trainer image installs and what every GPU figure in docs/PERFORMANCE.md was measured on. Between
the two, each lever that needs a newer call or another GPU is probed here and, when its need is
unmet, switched off in the run's config with one log line naming it and what it needs; the table
goes to MLflow (tags `x1.lever.NAME`) and the run folder's manifest. No lever is switched off
silently, and none is left on to crash.

The floor is 2.6: the first torch whose `torch.load(weights_only=True)` is safe against a crafted
file (CVE-2025-32434 bypassed it up to 2.5.1), which the checkpoint reader relies on.

float8 is the one lever that changes the run's math (it is in the config hash): when its need is
unmet the trainer refuses at launch (exit 2, naming what is missing) rather than run other math.

`arch="sm80"` probes as if the GPU were an A100 (compute capability 8.0) whatever it is: a Hopper
GPU then runs exactly the lever set an A100 would get (`--set train.gpu_arch=sm80`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

from x1_pretrain.config import RunConfig
from x1_pretrain.ops import cublaslt
from x1_pretrain.ops.kernels import addmm_into_fp32
from x1_pretrain.ops.losses import triton_runs

log = logging.getLogger(__name__)

TORCH_FLOOR = (2, 6)  # oldest torch that trains correctly (fewer levers); refused below, exit 2
TORCH_MEASURED = "2.11.0"  # the trainer image's torch: every GPU figure in docs/PERFORMANCE.md
CUDA_MEASURED = "13.0"  # its CUDA build (PyPI's torch 2.11.0 wheel); needs an R580+ driver
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay CUDA graphs
ARCH_CAPABILITY = {"sm80": (8, 0), "sm90": (9, 0)}  # train.gpu_arch -> the capability probed as


def release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a torch version string: '2.11.0+cu130' and '2.10.0a0+git1' alike."""
    nums = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if nums is None:
        raise ValueError(f"not a torch version: {version!r}")
    return tuple(int(n or 0) for n in nums.groups())


def floor_problem(version: str | None = None) -> str | None:
    """Why this torch cannot run the trainer (below the floor), or None."""
    version = str(torch.__version__ if version is None else version)
    try:
        got = release(version)
    except ValueError:
        return f"torch reports version {version!r}, which is not a release number; the trainer needs torch >= " \
               f"{'.'.join(map(str, TORCH_FLOOR))}"
    if got[:2] < TORCH_FLOOR:
        return (f"torch {version} is below the supported floor {'.'.join(map(str, TORCH_FLOOR))} "
                f"(the trainer image installs {TORCH_MEASURED}; docs/DEPLOY.md, host checks)")
    return None


@dataclass(frozen=True)
class Features:
    """What this process's torch and GPU offer the levers. Each field is one probe's answer."""

    cuda: bool  # training on a CUDA device
    capability: tuple[int, int] | None  # the GPU's compute capability, or the one train.gpu_arch asks to probe as
    bf16: bool  # the device computes in bf16 (CUDA: Ampere, 8.0, and newer)
    triton: bool  # Triton imports and compiles a kernel for this device
    cublaslt: bool  # libcublasLt loads from the torch build (ctypes), with the calls the tuning uses
    addmm_out_dtype: bool  # torch.addmm(..., out_dtype=float32, out=acc) adds a bf16 product into fp32 (torch >= 2.8)
    compiled_autograd: bool  # torch._dynamo.compiled_autograd._enable (torch >= 2.7); False where not asked (probe)
    get_total_norm: bool  # torch.nn.utils.get_total_norm (torch >= 2.6)
    flash_attn: bool  # flash_attn_func imports
    torchao: bool  # torchao.float8 imports

    @property
    def arch(self) -> str:
        return "cpu" if self.capability is None else f"sm{self.capability[0]}{self.capability[1]}"


@dataclass(frozen=True)
class Lever:
    """One row of the table: a lever the config asked for, and whether it runs."""

    name: str
    needs: str  # what it needs, in a user's words
    on: bool
    note: str = ""  # why it is off, or how it runs when a part of it is missing


@dataclass
class LeverTable:
    rows: list[Lever] = field(default_factory=list)

    def add(self, name: str, needs: str, on: bool, note: str = "") -> bool:
        self.rows.append(Lever(name, needs, on, note))
        return on

    def tags(self) -> dict[str, str]:
        """MLflow tags (and through them the manifest): `x1.lever.NAME` = on | off: why."""
        return {f"x1.lever.{r.name}": ("on" if r.on else "off") + (f": {r.note}" if r.note else "") for r in self.rows}

    def log(self) -> None:
        for r in self.rows:
            if not r.on or r.note:
                log.warning("lever %s %s: %s (needs %s)", r.name, "on" if r.on else "off", r.note, r.needs)
        log.info("levers: %s", ", ".join(f"{r.name} {'on' if r.on else 'off'}" for r in self.rows))


def _probe_triton(device: torch.device) -> bool:
    return triton_runs(device)


def _probe_cublaslt() -> bool:
    return cublaslt.available()


def _probe_addmm_out_dtype(device: torch.device) -> bool:
    return addmm_into_fp32(device)


def _probe_flash_attn() -> bool:
    try:
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]  # noqa: F401
    except Exception:  # noqa: BLE001 - an ImportError, or a CUDA/driver mismatch at import
        return False
    return True


def _probe_torchao() -> bool:
    try:
        import torchao.float8  # type: ignore[import-not-found]  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def float8_problem(f: Features) -> str | None:
    """Why train.float8 cannot run with these features (the architecture part; torchao's import
    is float8.unsupported's), or None."""
    if f.capability is not None and f.capability < (8, 9):
        return f"{f.arch} has no float8 tensor cores (compute capability 8.9+: H100, H200, L4, L40S)"
    return None


def _probe_compiled_autograd() -> bool:
    from torch._dynamo import compiled_autograd as ca

    return hasattr(ca, "_enable")


def probe(device: torch.device, arch: str = "auto", compiled_autograd: bool = True) -> Features:
    """Ask this torch and this device what each lever needs (once, at start-up: a few seconds of
    Triton compile on a GPU). `arch` sm80/sm90: judge the architecture-bound levers as if the GPU
    had that compute capability (on a CPU there is no GPU to pretend for). `compiled_autograd`
    False: a run that does not compile is not asked about it (its probe imports torch._dynamo,
    2 s of a start that nothing else there needs); the answer is then False."""
    cuda = device.type == "cuda"
    capability = None
    if cuda:
        capability = ARCH_CAPABILITY.get(arch) or tuple(torch.cuda.get_device_capability(device))
    return Features(
        cuda=cuda,
        capability=capability,
        bf16=(capability is not None and capability >= (8, 0)) if cuda else True,
        triton=cuda and _probe_triton(device),
        cublaslt=cuda and _probe_cublaslt(),
        addmm_out_dtype=cuda and _probe_addmm_out_dtype(device),
        compiled_autograd=compiled_autograd and _probe_compiled_autograd(),
        get_total_norm=hasattr(torch.nn.utils, "get_total_norm"),
        flash_attn=cuda and _probe_flash_attn(),
        torchao=cuda and _probe_torchao(),
    )


def resolve(cfg: RunConfig, f: Features, world_size: int = 1) -> tuple[RunConfig, LeverTable]:
    """The config with each lever whose need `f` does not meet switched off, and the table of
    every lever asked for. Pure: the same config and features give the same answer."""
    t, m = cfg.train, cfg.model
    table = LeverTable()
    train: dict = {}
    model: dict = {}
    one_process = world_size == 1

    if t.compile_mode in CUDA_GRAPH_MODES and t.compile:
        # Off the GPU torch.compile runs the mode without graphs (the same kernels as default),
        # and the loop's bookkeeping for graphs stays the same math: nothing to switch.
        table.add("cuda-graphs", "a CUDA GPU", f.cuda, "" if f.cuda else
                  f"compile_mode {t.compile_mode} compiles without CUDA graphs on this device")
    if t.kernels != "torch":
        ok = f.cuda and f.triton
        table.add("fused-kernels", "Triton compiling for a CUDA GPU (the loss, RoPE and SwiGLU kernels)", ok,
                  "" if ok else "PyTorch's ops instead" + ("" if f.cuda else " (not a CUDA device)"))
        if not ok:
            train["kernels"] = "torch"
    if t.cublaslt != "off":
        ok = f.cuda and f.cublaslt
        table.add("cublaslt-tuning", "a CUDA GPU and the libcublasLt of the torch build", ok,
                  "" if ok else "cuBLAS's first algorithm for every matmul (PyTorch's)")
        if not ok:
            train["cublaslt"] = "off"
    weight_casts = t.weight_casts
    if t.weight_casts == "per-step" and t.precision == "bf16-mixed":
        graphs = t.compile_mode in CUDA_GRAPH_MODES
        why = ("not in one process" if not one_process else "float8 casts its own weights" if t.float8 != "off"
               else "CUDA graphs copy their inputs" if graphs else "no bf16 on this GPU" if not f.bf16 else "")
        if not table.add("bf16-step-weights", "bf16-mixed on a bf16 device, one process, no float8, no CUDA graphs",
                         not why, f"{why}: autocast's cast at each micro-step" if why else ""):
            weight_casts = train["weight_casts"] = "per-micro-step"
    if t.grad_accumulation == "in-matmul" and t.precision == "bf16-mixed":
        if weight_casts != "per-step":
            table.add("in-matmul-accumulation", "bf16 step weights", False, "autograd adds the micro-steps' gradients")
            train["grad_accumulation"] = "autograd"
        else:
            inside = train.get("cublaslt", t.cublaslt) != "off" and f.cublaslt or f.addmm_out_dtype
            table.add("in-matmul-accumulation", "a matmul that adds into fp32 (cuBLASLt, or torch >= 2.8's "
                      "addmm out_dtype)", True, "" if inside else "each product in bf16, then an fp32 add: the same "
                      "sums as autograd's accumulation, without the fusion")
    if t.compiled_autograd:
        why = ("train.compile is off" if not t.compile else "not in one process" if not one_process
               else f"compile_mode {t.compile_mode}" if t.compile_mode != "default"
               else "this torch has no torch._dynamo.compiled_autograd._enable (torch >= 2.7)"
               if not f.compiled_autograd else "")
        if not table.add("compiled-autograd", "torch >= 2.7, compile mode default, one process", not why,
                         f"{why}: the backward compiles without the accumulation" if why else ""):
            train["compiled_autograd"] = False
    if t.float8 != "off":  # part of the run's math (its config hash): refused at launch when unmet, never switched
        table.add("float8", "torchao and a GPU of compute capability 8.9+", True, "")
    if m.attention == "flash-attn":
        why = ("not a CUDA device" if not f.cuda else "flash-attn does not import" if not f.flash_attn
               else f"{f.arch} is older than Ampere" if f.capability < (8, 0) else "")
        if not table.add("flash-attn", "flash-attn importing on an Ampere or newer GPU", not why,
                         f"{why}: PyTorch SDPA" if why else "asked for by model.attention; SDPA is what was measured"):
            model["attention"] = "sdpa"
    table.add("get-total-norm", "torch >= 2.6", f.get_total_norm,
              "" if f.get_total_norm else "the norm of the per-tensor norms (the same number)")

    if train or model:
        cfg = cfg.model_copy(update={"train": t.model_copy(update=train), "model": m.model_copy(update=model)})
    return cfg, table
