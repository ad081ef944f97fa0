"""What machine is this? Printed, logged to MLflow, and checked against the recommended instance
(docs/DEPLOY.md: 1x A100 80GB SXM4 preferred, >= 16 vCPUs, >= 64 GB RAM, ~50 GB free disk for the
data, the tokens and the checkpoints) before a paid hour starts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from x1_pretrain.train.accounting import GPU_PEAK_TFLOPS, detect_gpu_key

INSTANCE_SPEC = {"vcpus": 16, "ram_gb": 64, "disk_free_gb": 50}  # docs/DEPLOY.md, "Check the host"
DISK_FLOOR_GB = 20  # under this, the next checkpoints may not fit at all


def _nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _ram_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def form_factor(gpu_name: str) -> str:
    n = gpu_name.lower()
    if "pcie" in n or " nvl" in n:
        return "PCIe"
    if "sxm" in n or "hbm3" in n or n.endswith("h200") or "gh200" in n:
        return "SXM"
    return "unknown"


def collect(device: torch.device, attention: str, disk_path: str | os.PathLike[str]) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda or "none",
        "vcpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "ram_gb": round(_ram_gb() or 0.0, 1),
        "attention": attention,
        "device": str(device),
    }
    probe = Path(disk_path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    info["disk_path"] = str(probe)
    info["disk_total_gb"] = round(usage.total / 1e9, 1)
    info["disk_free_gb"] = round(usage.free / 1e9, 1)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = props.name
        info.update(
            gpu_name=name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gb=round(props.total_memory / 2**30, 1),
            gpu_form_factor=form_factor(name),
            gpu_capability=f"{props.major}.{props.minor}",
            driver=_nvidia_smi("driver_version") or "unknown",
            gpu_key=detect_gpu_key(name) or "unknown",
        )
        info["peak_bf16_tflops"] = GPU_PEAK_TFLOPS.get(info["gpu_key"], 0.0)
    else:
        info.update(gpu_name="none", gpu_count=0, gpu_key="cpu", peak_bf16_tflops=0.0)
    return info


def warnings_for(info: dict[str, Any]) -> list[str]:
    w = []
    if info["gpu_count"] == 0:
        w.append("no CUDA GPU: training on the CPU (tests and the demo only)")
    else:
        if info["gpu_key"] not in ("a100-80gb", "h100-sxm", "h200"):
            w.append(f"GPU {info['gpu_name']}: the plan assumes an A100 80GB (H100/H200 also fine); re-run `plan` with this GPU's throughput")
        if info["gpu_form_factor"] == "PCIe":
            w.append("PCIe GPU: expect 5-10% lower throughput than SXM")
    if (info["vcpus"] or 0) < INSTANCE_SPEC["vcpus"]:
        w.append(f"{info['vcpus']} vCPUs < {INSTANCE_SPEC['vcpus']}: tokenizing and data loading may starve the GPU")
    if info["ram_gb"] and info["ram_gb"] < INSTANCE_SPEC["ram_gb"]:
        w.append(f"{info['ram_gb']} GB RAM < the {INSTANCE_SPEC['ram_gb']} GB recommended (docs/DEPLOY.md)")
    if info["disk_free_gb"] < DISK_FLOOR_GB:
        w.append(f"only {info['disk_free_gb']} GB free at {info['disk_path']}: checkpoints may not fit")
    elif info["disk_free_gb"] < INSTANCE_SPEC["disk_free_gb"]:
        w.append(f"{info['disk_free_gb']} GB free at {info['disk_path']} < the ~{INSTANCE_SPEC['disk_free_gb']} GB the "
                 "data, the tokens and the checkpoints need (docs/DEPLOY.md)")
    if info["gpu_count"] and info["attention"] != "flash-attn":
        w.append("flash-attn not importable: using PyTorch SDPA (same math; on H100/H200 SDPA's flash backend is as fast)")
    return w


def render(info: dict[str, Any], warnings: list[str]) -> str:
    gpu = (f"{info['gpu_count']}x {info['gpu_name']} ({info.get('gpu_form_factor', '?')}, "
           f"{info.get('gpu_memory_gb', 0)} GiB, driver {info.get('driver', '?')}, CUDA {info['cuda_runtime']})"
           if info["gpu_count"] else "no GPU")
    lines = [
        f"preflight: {gpu}; torch {info['torch']}; attention {info['attention']}",
        f"preflight: {info['vcpus']} vCPUs, {info['ram_gb']} GB RAM, {info['disk_free_gb']} of "
        f"{info['disk_total_gb']} GB free at {info['disk_path']}",
    ]
    lines += [f"preflight WARNING: {w}" for w in warnings]
    return "\n".join(lines)


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version, read where the driver publishes it (no CUDA call)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    match = re.search(r"Kernel Module(?: for [\w]+)?\s+([\d.]+)", text)
    return match.group(1) if match else None


def cuda_init_problem() -> str | None:
    """On a machine with an NVIDIA driver and a CUDA build of torch, why CUDA does not initialise
    (a driver older than this torch's CUDA needs, above all), or None. Elsewhere (a CPU build, no
    driver) None: there is nothing to initialise."""
    driver = driver_version()
    if torch.version.cuda is None or driver is None:
        return None
    try:
        torch.cuda.init()
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError or its own error types here
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        return (f"CUDA {torch.version.cuda} (this torch's build, {torch.__version__}) does not initialise with the "
                f"NVIDIA driver {driver}: {first}. CUDA 13 needs a driver of the R580 branch or newer "
                "(docs/DEPLOY.md, host checks)")
    return None
