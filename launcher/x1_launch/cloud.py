"""What `x1` asks of the provider: the price now, a new instance, where its SSH server is, the end.

Thin over x1_common.providers' clients (the same ones the budget sidecar and the watchdog use), so
errors are ProviderErrors that never contain the API key.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from x1_common.providers import GpuOffer, Instance, LambdaClient, ProviderError, RunPodClient, ssh_address

# Each provider's defaults for what a launch needs: the GPU, the login, the image or region.
# Lambda: chosen from its own listing (preferred_lambda_type); RunPod: its single A100 80GB.
DEFAULT_TYPE = {"lambda": None, "runpod": "NVIDIA A100 80GB PCIe"}
DEFAULT_REGION = {"lambda": "us-east-1", "runpod": None}
DEFAULT_USER = {"lambda": "ubuntu", "runpod": "root"}
# What each provider sells, the first being what `x1 plan` plans by default (its MARKETS): Lambda
# on-demand only; RunPod interruptible (its spot market, resumed by the off-host watchdog after an
# interruption) or on-demand.
MARKETS = {"lambda": ("on-demand",), "runpod": ("interruptible", "on-demand")}
# RunPod's price field per market: the community cloud, where the fallback of the price rule rents.
RUNPOD_PRICE_FIELD = {"interruptible": "communitySpotPrice", "on-demand": "communityPrice"}
# A RunPod Ubuntu base image (Python 3.10+, git, and RunPod's /start.sh, which starts sshd with the
# PUBLIC_KEY the pod gets). Its own CUDA and torch do not matter: the boot script installs the
# measured torch (TORCH_VERSION, TORCH_CUDA of .env: 2.11.0, CUDA 13.0) in a virtual environment on
# the volume, as docs/DEPLOY.md section 9 does by hand.
DEFAULT_RUNPOD_IMAGE = "runpod/base:1.0.2-ubuntu2204"
# CUDA 13.0 needs an NVIDIA driver of the R580 branch or newer: RunPod places the pod only on a
# host whose driver runs it (its create input's minCudaVersion).
RUNPOD_MIN_CUDA = "13.0"
# The pod's start command, again after every resume: RunPod's /start.sh (sshd), then the X1 stack
# when `x1 launch` has put it on the volume (the boot script starts `stack up -d`).
BOOT_SCRIPT = "/workspace/x1-boot.sh"
RUNPOD_START = (f"bash -c '(/start.sh &); sleep 3; if [ -f {BOOT_SCRIPT} ]; then bash {BOOT_SCRIPT}; fi; "
                "sleep infinity'")


def offers(client: LambdaClient | RunPodClient, market: str) -> dict[str, GpuOffer]:
    """What the provider offers now in `market`, by the name its create call takes."""
    if isinstance(client, LambdaClient):
        return client.instance_types()
    return client.gpu_offers(RUNPOD_PRICE_FIELD[market])


def preferred_lambda_type(listing: dict[str, GpuOffer]) -> tuple[str, str]:
    """Lambda's single-GPU A100 instance type, and why: the 80 GB card where Lambda offers it alone,
    else the single A100 it does offer (the 40 GB SXM4 today: its 80 GB A100s come eight to an
    instance), which the 50M run fits in."""
    singles = [o for o in listing.values() if o.gpus == 1 and "a100" in o.gpu_description.lower()]
    for o in sorted(singles, key=lambda o: -(o.memory_gb or 0)):
        if (o.memory_gb or 0) >= 80:
            return o.name, f"Lambda's single A100 80GB ({o.description})"
    if singles:
        best = max(singles, key=lambda o: o.memory_gb or 0)
        eighty = [o.description for o in listing.values() if "a100" in o.gpu_description.lower()
                  and (o.memory_gb or 0) >= 80]
        only = f" (its 80 GB A100s: {', '.join(eighty)})" if eighty else ""
        why = (f"Lambda offers no single A100 80GB{only}; its single A100 is {best.description}, planned with "
               f"plan's figure for it; the 50M run fits in {best.memory_gb:g} GB" if best.memory_gb
               else f"Lambda's single A100: {best.description}")
        return best.name, why
    raise ValueError("Lambda offers no single-GPU A100 instance type now: name one with --instance-type "
                     f"(offered: {', '.join(sorted(listing))})")


def plan_gpu_key(offer: GpuOffer) -> str | None:
    """plan's GPU key (a100-40gb, a100-80gb, h100-sxm, h100-pcie, h200) for the provider's own
    description of the GPU, or None when plan has no figure for it."""
    text = f"{offer.gpu_description} {offer.name}".lower().replace(" ", "")
    if "h200" in text:
        return "h200"
    if "h100" in text:
        return "h100-pcie" if "pcie" in text else "h100-sxm"
    if "a100" in text:
        memory = offer.memory_gb
        if memory is None:
            return "a100-40gb" if "40gb" in text else "a100-80gb" if "80gb" in text else None
        return "a100-40gb" if memory < 60 else "a100-80gb"
    return None


def price_now(client: LambdaClient | RunPodClient, instance_type: str, market: str = "on-demand") -> float:
    """$/h of `instance_type` now in `market` (RunPod: the community cloud's price of that market).
    ValueError when the provider does not offer the type."""
    listing = offers(client, market)
    if instance_type not in listing:
        raise ValueError(f"--instance-type: {instance_type!r} is not offered (offered: {', '.join(sorted(listing))})")
    return listing[instance_type].price_usd_per_hr


@dataclass(frozen=True)
class LaunchRequest:
    provider: str
    instance_type: str
    region: str | None
    name: str
    ssh_key_name: str | None  # Lambda: a key registered in the dashboard
    public_key: str | None  # RunPod: the key its images authorize (PUBLIC_KEY)
    image: str
    volume_gb: int
    market: str = "on-demand"  # RunPod: interruptible bids the price read
    price_usd_per_hr: float | None = None  # RunPod interruptible: the bid per GPU


def launch(client: LambdaClient | RunPodClient, req: LaunchRequest) -> str:
    """The new instance's id. Never retried after an unclear answer (two instances bill twice):
    the caller looks the instance up by `req.name` instead."""
    if isinstance(client, LambdaClient):
        return client.launch(req.instance_type, req.region or DEFAULT_REGION["lambda"], name=req.name,
                             ssh_key_names=[req.ssh_key_name] if req.ssh_key_name else [])
    env = {"PUBLIC_KEY": req.public_key} if req.public_key else {}
    bid = req.price_usd_per_hr if req.market == "interruptible" else None
    if req.market == "interruptible" and bid is None:
        raise ValueError("an interruptible pod needs its bid (the price read)")
    pod = client.create(req.instance_type, req.image, name=req.name, cloud_type="COMMUNITY", env=env,
                        docker_args=RUNPOD_START, volume_gb=req.volume_gb, bid_per_gpu=bid,
                        min_cuda_version=RUNPOD_MIN_CUDA)
    return pod.id


def named(client: LambdaClient | RunPodClient, name: str) -> list[Instance]:
    """The account's instances called `name` that the provider lists as not terminated."""
    return [i for i in client.list_instances() if i.raw.get("name") == name and i.status != "terminated"]


def wait_for_address(client: LambdaClient | RunPodClient, instance_id: str, timeout: float,
                     on_wait: Callable[[Instance], None] = lambda inst: None,
                     every: float = 2.0) -> tuple[Instance, tuple[str, int]]:
    """Polls until the instance runs and shows where its SSH server is."""
    deadline = time.monotonic() + timeout
    while True:
        inst = client.get_instance(instance_id)
        if inst.status == "terminated":
            raise ProviderError(f"{client.provider}: instance {instance_id} was terminated while booting "
                                f"({inst.raw_status})", kind="not-found")
        address = ssh_address(inst) if inst.status == "running" else None
        if address is not None:
            return inst, address
        if time.monotonic() > deadline:
            raise ProviderError(f"{client.provider}: instance {instance_id} is still {inst.raw_status} after "
                                f"{timeout:g} s", kind="timeout")
        on_wait(inst)
        time.sleep(every)
