"""What `x1` asks of the provider: the price now, a new instance, where its SSH server is, the end.

Thin over x1_common.providers' clients (the same ones the budget sidecar and the watchdog use), so
errors are ProviderErrors that never contain the API key.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from x1_common.providers import Instance, LambdaClient, ProviderError, RunPodClient, ssh_address

# Each provider's defaults for what a launch needs: the GPU, the login, the image or region.
DEFAULT_TYPE = {"lambda": "gpu_1x_a100_sxm4", "runpod": "NVIDIA A100 80GB PCIe"}
DEFAULT_REGION = {"lambda": "us-east-1", "runpod": None}
DEFAULT_USER = {"lambda": "ubuntu", "runpod": "root"}
# RunPod's own PyTorch image: sshd started by its /start.sh from the PUBLIC_KEY the pod gets.
DEFAULT_RUNPOD_IMAGE = "runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04"
# The pod's start command, again after every resume: RunPod's /start.sh (sshd), then the X1 stack
# when `x1 launch` has put it on the volume (the boot script starts `stack up -d`).
BOOT_SCRIPT = "/workspace/x1-boot.sh"
RUNPOD_START = (f"bash -c '(/start.sh &); sleep 3; if [ -f {BOOT_SCRIPT} ]; then bash {BOOT_SCRIPT}; fi; "
                "sleep infinity'")


def price_now(client: LambdaClient | RunPodClient, instance_type: str) -> float:
    """$/h of `instance_type` now (RunPod: on-demand community, the market a created pod bills at
    when community has it). ValueError when the provider does not offer the type."""
    prices = client.instance_type_prices() if isinstance(client, LambdaClient) else client.gpu_type_prices("community")
    if instance_type not in prices:
        raise ValueError(f"--instance-type: {instance_type!r} is not offered (offered: {', '.join(sorted(prices))})")
    return prices[instance_type]


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


def launch(client: LambdaClient | RunPodClient, req: LaunchRequest) -> str:
    """The new instance's id. Never retried after an unclear answer (two instances bill twice)."""
    if isinstance(client, LambdaClient):
        return client.launch(req.instance_type, req.region or DEFAULT_REGION["lambda"], name=req.name,
                             ssh_key_names=[req.ssh_key_name] if req.ssh_key_name else [])
    env = {"PUBLIC_KEY": req.public_key} if req.public_key else {}
    pod = client.create(req.instance_type, req.image, name=req.name, cloud_type="COMMUNITY", env=env,
                        docker_args=RUNPOD_START, volume_gb=req.volume_gb)
    return pod.id


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
