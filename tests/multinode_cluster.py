"""Two hosts on one machine, for tests/test_multinode.py: each node a container with its own network
namespace on a test network of the real Docker Engine, the nodes joined only by that network and
by a named volume at /shared (the persistent filesystem both hosts would mount; a local volume,
not a network filesystem).

    cluster = Cluster(image)                 # a network and a volume, named x1-i44-<id>-...
    cluster.put(tokenized_dir, "data")       # host folder -> /shared/data
    cluster.node("a", args, NNODES="2", RDZV_ENDPOINT="b:29400", RDZV_ID="r1")
    cluster.watchdog("a", "/shared/r1/a.")   # a's own watchdog (x1_watchdog, docker mode), as on its host
    cluster.wait("a")                        # the container's exit code
    cluster.fetch("ckpt/final.safetensors", dest)
    cluster.remove()                         # containers, network, volume

A node runs the image's `x1-train` (trainer/entrypoint.sh) as a deployment does: NNODES,
RDZV_ENDPOINT and RDZV_ID select torchrun's c10d rendezvous. Its hostname is its name, so the
rendezvous endpoint and gloo's interface are found by name, as on two real hosts.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compose_stack import run

PREFIX = "x1-i44"  # every container, network, volume and image these tests create
SHARED = "/shared"


class Cluster:
    def __init__(self, image: str) -> None:
        self.image = image
        self.name = f"{PREFIX}-{uuid.uuid4().hex[:8]}"
        self.network = f"{self.name}-net"
        self.volume = f"{self.name}-shared"
        self.nodes: dict[str, str] = {}  # node name -> container name
        run(["docker", "network", "create", "--label", f"{PREFIX}=1", self.network])
        run(["docker", "volume", "create", "--label", f"{PREFIX}=1", self.volume])
        # The volume's root belongs to uid 1000, as the trainer image's user.
        run(["docker", "run", "--rm", "--user", "0", "-v", f"{self.volume}:{SHARED}", image,
             "chown", "1000:1000", SHARED], timeout=120)

    # -- the shared volume ---------------------------------------------------------------------

    def put(self, source: Path, dest: str) -> None:
        """Copy a host folder into /shared/dest (a tar stream: no bind mount of a host path)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(source, arcname=dest, filter=lambda t: (setattr(t, "uid", 1000), setattr(t, "gid", 1000), t)[-1])
        subprocess.run(["docker", "run", "--rm", "-i", "-v", f"{self.volume}:{SHARED}", self.image,
                        "tar", "-x", "-C", SHARED], input=buf.getvalue(), check=True, capture_output=True, timeout=300)

    def write(self, relative: str, text: str) -> None:
        """Write a file into the volume atomically (temp file + rename, as the sidecar writes budget.json)."""
        subprocess.run(["docker", "run", "--rm", "-i", "-v", f"{self.volume}:{SHARED}", self.image, "sh", "-c",
                        f'mkdir -p "$(dirname {SHARED}/{relative})" && cat > {SHARED}/{relative}.tmp && '
                        f"mv {SHARED}/{relative}.tmp {SHARED}/{relative}"],
                       input=text.encode(), check=True, capture_output=True, timeout=120)

    def fetch(self, relative: str, dest: Path) -> Path:
        """Copy /shared/relative (a file or a folder) out to the host folder `dest`; returns its path there."""
        proc = subprocess.run(["docker", "run", "--rm", "-v", f"{self.volume}:{SHARED}:ro", self.image,
                               "tar", "-c", "-C", SHARED, relative], capture_output=True, timeout=300)
        if proc.returncode != 0:
            raise FileNotFoundError(f"{SHARED}/{relative}: {proc.stderr.decode()[-500:]}")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
            tar.extractall(dest, filter="data")
        return dest / relative

    def read_json(self, relative: str) -> Any:
        proc = subprocess.run(["docker", "run", "--rm", "-v", f"{self.volume}:{SHARED}:ro", self.image,
                               "cat", f"{SHARED}/{relative}"], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            return None
        return json.loads(proc.stdout)

    # -- nodes ---------------------------------------------------------------------------------

    def node(self, name: str, args: Sequence[str], **env: str) -> str:
        """Start a node's container (detached): `x1-train args` with env; returns the container name."""
        container = self.nodes.get(name) or f"{self.name}-{name}"
        run(["docker", "rm", "-f", container], check=False)
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
        run(["docker", "run", "-d", "--name", container, "--hostname", name, "--network", self.network,
             "--network-alias", name, "--label", f"{PREFIX}=1", "-v", f"{self.volume}:{SHARED}",
             *[x for k, v in env.items() for x in ("-e", f"{k}={v}")], self.image, "x1-train", *args], timeout=120)
        self.nodes[name] = container
        return container

    def watchdog(self, name: str, records: str, *opts: str) -> str:
        """Start node `name`'s watchdog: `python -m x1_watchdog --mode docker` from the watchdog image
        built beside the node's (`<node image>-watchdog`: the Docker SDK is there, not in the trainer), in
        a container of its own with the Engine's socket, as compose.yaml's watchdog service runs beside
        each host's trainer. It adopts the running node container, relaunches it after a crash or a
        kill, and exits with the final code. `records`: the prefix (under /shared) of its heartbeat
        (<records>heartbeat.json, the trainer's), events and state files. Returns the container name."""
        container = f"{self.nodes[name]}-watchdog"
        run(["docker", "rm", "-f", container], check=False)
        # The image's user (uid 1000) reaches the socket through its group, as compose's group_add.
        gid = str(os.stat("/var/run/docker.sock").st_gid)
        run(["docker", "run", "-d", "--name", container, "--network", "none", "--label", f"{PREFIX}=1",
             "--group-add", gid, "-v", "/var/run/docker.sock:/var/run/docker.sock", "-v", f"{self.volume}:{SHARED}",
             "-e", "PYTHONUNBUFFERED=1", f"{self.image}-watchdog", "python", "-m", "x1_watchdog", "--mode", "docker",
             "--container", self.nodes[name], "--heartbeat-file", f"{records}heartbeat.json",
             "--events-file", f"{records}watchdog-events.jsonl", "--state-file", f"{records}watchdog-state.json",
             "--port", "0", *opts], timeout=120)
        self.nodes[f"{name}-watchdog"] = container
        return container

    def events(self, records: str) -> list[dict[str, Any]]:
        """The JSON lines of a watchdog's events file (`records` as given to watchdog())."""
        proc = subprocess.run(["docker", "run", "--rm", "-v", f"{self.volume}:{SHARED}:ro", self.image, "cat",
                               f"{records}watchdog-events.jsonl"], capture_output=True, text=True, timeout=120)
        return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]

    def wait(self, name: str, timeout: float = 300) -> int:
        """The node's exit code once its container has stopped."""
        proc = run(["docker", "wait", self.nodes[name]], timeout=timeout)
        return int(proc.stdout.strip())

    def running(self, name: str) -> bool:
        proc = run(["docker", "inspect", "-f", "{{.State.Running}}", self.nodes[name]], check=False)
        return proc.stdout.strip() == "true"

    def start(self, name: str) -> None:
        """Start the node's stopped container again, same command (its host came back, or its
        host's watchdog relaunched it)."""
        run(["docker", "start", self.nodes[name]], timeout=120)

    def state(self, name: str) -> dict[str, Any]:
        return json.loads(run(["docker", "inspect", "-f", "{{json .State}}", self.nodes[name]]).stdout)

    def pause(self, name: str) -> float:
        """Freeze every process of the node (cgroup freezer): its sockets stay open and answer nothing,
        as a host that hangs or drops off the network; returns the time it froze."""
        run(["docker", "pause", self.nodes[name]])
        return time.time()

    def kill(self, name: str) -> float:
        """SIGKILL the node's container (the host is gone); returns the time it was killed."""
        run(["docker", "kill", self.nodes[name]])
        return time.time()

    def logs(self, name: str, tail: int = 200) -> str:
        proc = run(["docker", "logs", "--tail", str(tail), self.nodes[name]], check=False)
        return proc.stdout + proc.stderr

    def all_logs(self, tail: int = 60) -> str:
        return "\n".join(f"--- {n} ---\n{self.logs(n, tail)}" for n in self.nodes)

    def remove(self) -> None:
        for container in self.nodes.values():
            run(["docker", "rm", "-f", container], check=False, timeout=120)
        run(["docker", "network", "rm", self.network], check=False)
        run(["docker", "volume", "rm", "-f", self.volume], check=False)
