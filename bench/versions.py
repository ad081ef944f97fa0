"""What ran against what is pinned: torch, CUDA, cuDNN and Triton, then each pin of the trainer's
and the watchdog's requirements beside the version this machine imports (a GPU call's
versions.txt; bench/run.py runs it first).

    python3 bench/versions.py
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REQUIREMENTS = (REPO / "trainer" / "requirements.txt", REPO / "watchdog" / "requirements.txt")


def pins(paths: tuple[Path, ...] = REQUIREMENTS) -> list[tuple[str, str]]:
    """(name, pinned version) of each `name==version` line, comments dropped."""
    out = []
    for path in paths:
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                name, _, pin = line.partition("==")
                out.append((name.strip(), pin.strip()))
    return out


def main() -> int:
    try:
        import torch
        import triton

        print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), "
              f"triton {triton.__version__}")
    except ImportError as e:
        print(f"torch or triton does not import: {e}")
    for name, pin in pins():
        try:
            got = version(name)
        except PackageNotFoundError:
            got = "absent"
        print(f"{name:20s} pinned {pin:12s} ran {got:12s} {'' if got == pin else '<- another version'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
