"""preflight's host warnings say what docs/DEPLOY.md asks of the host, in the same numbers."""

from __future__ import annotations

import re

from conftest import REPO
from x1_pretrain.train.preflight import INSTANCE_SPEC, warnings_for


def host(**over: object) -> dict[str, object]:
    info = {"gpu_count": 1, "gpu_key": "a100-80gb", "gpu_name": "NVIDIA A100-SXM4-80GB", "gpu_form_factor": "SXM",
            "vcpus": 30, "ram_gb": 200, "disk_total_gb": 140, "disk_free_gb": 120, "disk_path": "/workspace",
            "attention": "flash-attn"}
    return {**info, **over}


def test_preflights_disk_warning_matches_the_disk_deploy_asks_for() -> None:
    deploy = (REPO / "docs" / "DEPLOY.md").read_text()
    asked = re.search(r"df -h /\s+# ~(\d+) GB free", deploy)
    assert asked and int(asked[1]) == INSTANCE_SPEC["disk_free_gb"]
    assert warnings_for(host()) == []  # a 140 GB disk with 120 GB free is enough: no "500 GB" demanded
    [low] = warnings_for(host(disk_free_gb=40))
    assert f"< the ~{asked[1]} GB the data, the tokens and the checkpoints need (docs/DEPLOY.md)" in low
    [full] = warnings_for(host(disk_free_gb=10))
    assert "checkpoints may not fit" in full
