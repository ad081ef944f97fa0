"""The Triton kernels, checked on a machine without a GPU.

- Compiled ahead of time for Ampere (A100) and Hopper (H100/H200) with the constants the ops
  launch them with: a type error or a kernel that does not fit shows here, not first on a rented
  GPU.
- Run through Triton's interpreter (TRITON_INTERPRET=1, CPU tensors, numpy) against the PyTorch
  paths: the op tests of test_kernels.py and test_losses.py, in a child process, since Triton
  reads the variable when a kernel is defined.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what the GPU builds of Triton do by default
triton = pytest.importorskip("triton", reason="Triton is not installed")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from x1_pretrain.ops import kernels as kernels  # noqa: E402
from x1_pretrain.ops import losses as losses  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_MEMORY_PER_BLOCK = {80: 163 * 1024, 90: 227 * 1024}  # bytes: A100, H100/H200 (CUDA's opt-in maximum)
P = "*bf16"  # tensors as the training step passes them


def _sig(names: str, types: dict[str, str]) -> dict[str, str]:
    return {n: types.get(n, "i32") for n in names.split()}


def _launch(shape: dict, **constants) -> tuple[dict, int]:
    """A kernel's constexprs and warps as an op launches it: its launch shape plus the model's sizes."""
    shape = dict(shape)
    warps = shape.pop("num_warps")
    return {**constants, **shape}, warps


# (kernel, signature by parameter, (constexprs, num_warps)): the launches of kernels.py and
# losses.py, with their own launch shapes, for the 50M model (12 heads, 4 KV heads, head dim 64,
# d_ff 2048); RoPE and SwiGLU with the row scale of the folded norms, as the training step runs them...
ROPE = _launch(kernels.ROPE_LAUNCH, H=12, HKV=4, HD=64, HAS_SCALE=True)
SWIGLU = _launch(kernels.SWIGLU_LAUNCH, F_=2048, HAS_SCALE=True)
SCALE = {"scale_ptr": "*fp32"}
LAUNCHES = [
    (kernels._rope_fwd_kernel, _sig("qkv_ptr cos_ptr sin_ptr q_ptr k_ptr v_ptr scale_ptr N T",
                                    {"qkv_ptr": P, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_ptr": P, "k_ptr": P, "v_ptr": P,
                                     **SCALE}),
     ROPE),
    (kernels._rope_bwd_kernel, _sig("dq_ptr dk_ptr dv_ptr cos_ptr sin_ptr scale_ptr out_ptr N T qb qt qh qd kb kt kh kd vb vt vh vd",
                                    {"dq_ptr": P, "dk_ptr": P, "dv_ptr": P, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": P,
                                     **SCALE}),
     ROPE),
    (kernels._swiglu_fwd_kernel, _sig("gu_ptr h_ptr scale_ptr total", {"gu_ptr": P, "h_ptr": P, **SCALE}), SWIGLU),
    (kernels._swiglu_bwd_kernel, _sig("gu_ptr dh_ptr dgu_ptr scale_ptr total", {"gu_ptr": P, "dh_ptr": P, "dgu_ptr": P, **SCALE}),
     SWIGLU),
    (losses._ce_fwd_kernel, _sig("logits_ptr stride targets_ptr loss_ptr lse_ptr V Vp",
                                 {"logits_ptr": P, "targets_ptr": "*i64", "loss_ptr": "*fp32", "lse_ptr": "*fp32"}),
     _launch(losses.FWD_LAUNCH)),
    (losses._ce_bwd_kernel, _sig("logits_ptr stride grad_ptr targets_ptr lse_ptr dloss_ptr V Vp",
                                 {"logits_ptr": P, "grad_ptr": P, "targets_ptr": "*i64", "lse_ptr": "*fp32", "dloss_ptr": "*fp32"}),
     _launch(losses.BWD_LAUNCH)),
    (losses._ce_fwd_grad_kernel, _sig("logits_ptr stride grad_ptr targets_ptr loss_ptr scale_ptr n_rows V Vp",
                                      {"logits_ptr": P, "grad_ptr": P, "targets_ptr": "*i64", "loss_ptr": "*fp32",
                                       "scale_ptr": "*fp32"}),
     _launch({k: v for k, v in losses.GRAD_LAUNCH.items() if k != "PER_SM"})),
]
# ...and RoPE and SwiGLU without the scale, as the ops run them when given none (SwiGLU's in generation).
LAUNCHES += [(kernel, signature, ({**constants, "HAS_SCALE": False}, warps))
             for kernel, signature, (constants, warps) in LAUNCHES if constants.get("HAS_SCALE")]


@pytest.mark.skipif(kernels.INTERPRET, reason="under TRITON_INTERPRET the kernels are interpreted functions")
@pytest.mark.parametrize("arch", [80, 90], ids=["ampere", "hopper"])
def test_every_kernel_compiles_for_ampere_and_hopper_within_its_shared_memory(arch):
    for kernel, signature, (constants, warps) in LAUNCHES:
        signature = dict(signature, **{name: "constexpr" for name in constants})
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        assert compiled.asm.get("cubin"), f"{kernel.__name__}: no cubin for sm_{arch}"
        # What one program may take: an A100 has 164 KB of shared memory per SM (163 KB for one
        # block), an H100/H200 228 KB (227 KB). A kernel tuned on the H200 must still launch on an A100.
        assert compiled.metadata.shared <= SHARED_MEMORY_PER_BLOCK[arch], \
            f"{kernel.__name__}: {compiled.metadata.shared} bytes of shared memory on sm_{arch}"
        assert warps * 32 <= 1024


@pytest.mark.skipif(kernels.INTERPRET, reason="under TRITON_INTERPRET the kernels are interpreted functions")
@pytest.mark.parametrize(("kernel", "narrow_loads"),
                         [(losses._ce_fwd_kernel, 1), (losses._ce_bwd_kernel, 0), (losses._ce_fwd_grad_kernel, 1)],
                         ids=["forward", "backward", "forward-and-gradient"])
def test_the_cross_entropy_kernels_read_the_logits_16_bytes_at_a_time(kernel, narrow_loads):
    # As the JIT sees the 50M run: pointers 16-byte aligned, the row stride and the padded width
    # 50304 multiples of 16, the vocabulary 50257 not. A load masked at 50257 compiles to 2-byte
    # loads (the forward kernel of 0b1d327 did: 1.07 ms against 0.73 with 16-byte ones, call 14).
    # The forward's one 2-byte load left is the target's logit.
    _, signature, (constants, warps) = next(launch for launch in LAUNCHES if launch[0] is kernel)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
               if signature[name].startswith("*") or name in ("stride", "Vp")}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=dict(signature, **{n: "constexpr" for n in constants}), constexprs=constants,
                  attrs=aligned),
        target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = compiled.asm["ptx"]
    loads = re.findall(r"ld\.global(?:\.L[12]::[a-z_]+)*\.(v4\.b32|b16)\b", ptx)  # with or without cache hints
    assert "v4.b32" in loads
    assert loads.count("b16") == narrow_loads


def test_kernels_pass_the_op_tests_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests/test_kernels.py", "tests/test_losses.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    # The kernels ran, not the CPU fallbacks:
    assert "PASSED tests/test_losses.py::test_the_interpreter_sends_cpu_tensors_through_the_triton_kernels" in out.stdout
