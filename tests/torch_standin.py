"""Runs one of the project's command-line modules under a stand-in for an older torch: the real
torch, reporting another version and lacking the calls named, as a torch of that version lacks them.

    python tests/torch_standin.py --version 2.6.0 --without get_total_norm,compiled_autograd,addmm_out_dtype \
        x1_pretrain.train ARGS...

What each name removes:
  get_total_norm      torch.nn.utils.get_total_norm (torch >= 2.6)
  compiled_autograd   torch._dynamo.compiled_autograd._enable (2.5 had `enable`)
  addmm_out_dtype     torch.addmm's out_dtype= keyword (torch >= 2.8): a TypeError, as torch 2.5 raised
  compile             a working torch.compile: the compiled model raises at its first call, as a
                      compiler that cannot handle the model does
"""

from __future__ import annotations

import argparse
import functools
import runpy
import sys

import torch


def _without_out_dtype(addmm):
    @functools.wraps(addmm)
    def addmm_of_an_older_torch(*args, **kwargs):
        if "out_dtype" in kwargs:
            raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")
        return addmm(*args, **kwargs)

    return addmm_of_an_older_torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", help="what torch.__version__ reports")
    parser.add_argument("--without", default="", help="comma-separated calls to remove (see the module docstring)")
    parser.add_argument("module")
    args, rest = parser.parse_known_args()
    if args.version:
        torch.__version__ = args.version
    missing = {name for name in args.without.split(",") if name}
    if "get_total_norm" in missing:
        del torch.nn.utils.get_total_norm
    if "compiled_autograd" in missing:
        from torch._dynamo import compiled_autograd

        del compiled_autograd._enable
    if "addmm_out_dtype" in missing:
        torch.addmm = _without_out_dtype(torch.addmm)
    if "compile" in missing:
        def compile_that_fails(model=None, **_):
            def compiled(*args, **kwargs):
                raise RuntimeError("this torch.compile cannot compile the model")
            return compiled
        torch.compile = compile_that_fails
    unknown = missing - {"get_total_norm", "compiled_autograd", "addmm_out_dtype", "compile"}
    if unknown:
        sys.exit(f"torch_standin: unknown call(s) {sorted(unknown)}")
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
