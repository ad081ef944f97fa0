#!/usr/bin/env python3
"""The trainer image's torch check: the build fails unless torch is the pinned release with the
pinned CUDA (or the CPU build the Docker tests' stand-in base names, with --cuda none).

    python trainer/torch_pin.py --version 2.11.0 --cuda 13.0

Exit 0 when both match, 1 (naming what is installed) when either differs. Standard library and
torch only: it runs inside the image build, before the project is installed.
"""

from __future__ import annotations

import argparse
import sys


def problem(installed_version: str, installed_cuda: str | None, version: str, cuda: str) -> str | None:
    """What differs between the installed torch and the pin, or None. The local tag (+cu130,
    +cpu) is compared through --cuda, not through the version."""
    release = installed_version.split("+", 1)[0]
    wanted_cuda = None if cuda.lower() in ("none", "cpu", "") else cuda
    if release != version:
        return f"torch {installed_version} is installed, the image pins {version}"
    if (installed_cuda or None) != wanted_cuda:
        return (f"torch {installed_version} is built for CUDA {installed_cuda or 'none (CPU build)'}, "
                f"the image pins CUDA {wanted_cuda or 'none (CPU build)'}")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", required=True, help="the torch release the image must carry, e.g. 2.11.0")
    parser.add_argument("--cuda", required=True, help="its CUDA version, e.g. 13.0; none for a CPU build")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"x1-torch-pin: torch does not import: {e}", file=sys.stderr)
        return 1
    why = problem(torch.__version__, torch.version.cuda, args.version, args.cuda)
    if why is not None:
        print(f"x1-torch-pin: {why}", file=sys.stderr)
        return 1
    print(f"x1-torch-pin: torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}) as pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
