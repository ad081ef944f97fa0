"""Cross-entropy over bf16 logits without an fp32 copy of them: one read for the loss, one read and
one write for the gradient; or, in training, both in one kernel whose second read of a row comes
from L2 (`head_cross_entropy`).

The head's logits for a 32 x 1024 micro-batch over 50304 columns are 3.3 GB in bf16; upcasting
them to fp32 for `F.cross_entropy` writes and reads 6.6 GB more per pass. Here a Triton kernel
walks each row once with an online max / sum-exp in fp32 registers (forward: loss and logsumexp
per row), and the backward recomputes the softmax from the bf16 logits and writes the gradient
straight in the logits' dtype. Padded vocabulary columns get zero probability and zero gradient.

Registered as torch.library custom ops, so torch.compile treats them as opaque kernels. On the
CPU the same ops run a plain PyTorch implementation (tests, and machines without Triton).
"""

from __future__ import annotations

import torch

from x1_pretrain.ops import cublaslt
from x1_pretrain.ops.kernels import triton_device, triton_ok, wgrad_accumulate

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds have no Triton
    triton = None

# Launch shapes (columns per iteration, as BLOCK // K lanes of K adjacent columns in the forward;
# warps); bench/head_ce.py times these against others on a GPU.
FWD_LAUNCH = {"BLOCK": 4096, "K": 8, "num_warps": 8}
BWD_LAUNCH = {"BLOCK": 4096, "num_warps": 16}
# The forward that also writes the gradient: the same tiles, on a persistent grid of PER_SM
# programs per SM (see _ce_fwd_grad_kernel for why so few).
GRAD_LAUNCH = {"BLOCK": 8192, "K": 8, "num_warps": 32, "PER_SM": 2, "FIRST": "evict_last", "SECOND": "evict_first"}


if triton is not None:

    @triton.jit
    def _lanes_update(x, m, s):
        # x: (lanes, K) logits; m, s: each lane's running max and sum of exp(x - m). The max is
        # taken over the lane's K columns first, so rescaling s costs one exponential per K
        # elements and each element only its own exponential and an add.
        LOG2E: tl.constexpr = 1.4426950408889634  # exp(x - m) = exp2(x * LOG2E - m * LOG2E): one FMA
        m_new = tl.maximum(m, tl.max(x, 1))
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2(x * LOG2E - (m_new * LOG2E)[:, None]), 1)
        return m_new, s

    @triton.jit
    def _ce_fwd_kernel(logits_ptr, stride, targets_ptr, loss_ptr, lse_ptr, V, Vp, BLOCK: tl.constexpr, K: tl.constexpr):
        # One row per program, walked once: an online max / sum-exp over tiles of (BLOCK // K
        # lanes) x (K adjacent columns, one thread's 16-byte load), one cross-lane reduction at
        # the end. Whole tiles load unmasked; the last, partial tile loads up to the padded width
        # (a multiple of 16, so its loads stay 16 bytes wide too) and drops the padded columns
        # itself. The kernel before this one masked every load at the odd width 50257, which made
        # them 2 bytes wide, and spent ~13 instructions per element to this one's ~7: 1.27 ->
        # 0.74 ms per micro-batch in the step, 4.5 TB/s (call 14).
        R: tl.constexpr = BLOCK // K
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        offs = tl.arange(0, R)[:, None] * K + tl.arange(0, K)[None, :]
        m = tl.full([R], -1e30, tl.float32)  # finite: -inf - -inf would be NaN
        s = tl.zeros([R], tl.float32)
        full = V // BLOCK * BLOCK
        for start in range(0, full, BLOCK):
            m, s = _lanes_update(tl.load(base + start + offs).to(tl.float32), m, s)
        if full < V:
            cols = full + offs
            x = tl.load(base + cols, mask=cols < Vp, other=0.0).to(tl.float32)
            m, s = _lanes_update(tl.where(cols < V, x, float("-inf")), m, s)
        row_max = tl.max(m, 0)
        lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), 0))
        target = tl.load(targets_ptr + row)
        x_t = tl.load(base + target).to(tl.float32)
        tl.store(loss_ptr + row, lse - x_t)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _ce_fwd_grad_kernel(logits_ptr, stride, grad_ptr, targets_ptr, loss_ptr, scale_ptr, n_rows, V, Vp,
                            BLOCK: tl.constexpr, K: tl.constexpr, FIRST: tl.constexpr, SECOND: tl.constexpr):
        # The forward and the backward of a row in one program, for a training step. Apart, the
        # loss's two kernels read the 6.6 GB of logits of a 64 x 1024 micro-batch twice from HBM;
        # here the second read of a row comes from L2. So the grid is persistent, a few programs
        # per SM, each holding one 100 KB row between its two passes: a few hundred rows live,
        # inside the 60 MB L2 (ncu: 6.7 GB read and 6.6 GB written per micro-batch, call 25).
        # With so few programs, latency is hidden by warps, not programs: many warps per program,
        # few registers per thread, nothing per element that can be done once per row: whole tiles
        # load unmasked, the target's gradient is fixed up after its tile is written. A build with
        # 116 registers per thread fitted one program per SM and took 5.6 ms against 3.8 (call 24).
        # The second pass starts from the last, partial tile, still in registers, then walks back.
        #
        # One exponential per element (call 54; the build with two, an online sum-exp in the first
        # pass, is in git at e6b61af): the first pass takes only the row's max m; the second writes
        # e = exp(x - m), which is in (0, 1], and sums it: s = sum(e), lse = m + log(s). The row's
        # gradient softmax - onehot is (e - s * onehot) / s, so the kernel writes e - s * onehot
        # and returns 1 / s per row, which the caller folds into the per-row factor it already
        # applies to the head's matmul operands. In bf16, e and e_t - s carry the relative
        # rounding that p and p_t - 1 carried.
        R: tl.constexpr = BLOCK // K
        LOG2E: tl.constexpr = 1.4426950408889634
        offs = tl.arange(0, R)[:, None] * K + tl.arange(0, K)[None, :]
        full = V // BLOCK * BLOCK  # columns in whole tiles: all real, none padded
        for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):  # int64: row x stride > 2^31
            base = logits_ptr + row * stride
            out = grad_ptr + row * stride
            target = tl.load(targets_ptr + row)
            x_t = tl.load(base + target).to(tl.float32)  # issued early, used after the second pass
            m = tl.full([R], -1e30, tl.float32)  # per lane: a lane's K columns are one thread's
            for start in range(0, full, BLOCK):
                m = tl.maximum(m, tl.max(tl.load(base + start + offs, eviction_policy=FIRST).to(tl.float32), 1))
            tail = full + offs  # the last tile: up to the padded width (a multiple of 16: 16-byte loads)
            x = tl.load(base + tail, mask=tail < Vp, other=0.0, eviction_policy=FIRST).to(tl.float32)
            x = tl.where(tail < V, x, float("-inf"))  # padded columns: e exactly 0
            m_log2 = tl.max(tl.maximum(m, tl.max(x, 1)), 0) * LOG2E
            e = tl.exp2(x * LOG2E - m_log2)
            s = tl.sum(e, 1)
            tl.store(out + tail, e.to(grad_ptr.dtype.element_ty), mask=tail < Vp, eviction_policy="evict_first")
            for i in range(0, full // BLOCK):
                cols = full - (i + 1) * BLOCK + offs
                e = tl.exp2(tl.load(base + cols, eviction_policy=SECOND).to(tl.float32) * LOG2E - m_log2)
                s += tl.sum(e, 1)
                tl.store(out + cols, e.to(grad_ptr.dtype.element_ty), eviction_policy="evict_first")
            total = tl.sum(s, 0)
            lse = (m_log2 + tl.log2(total)) / LOG2E
            tl.store(loss_ptr + row, lse - x_t)
            tl.store(scale_ptr + row, 1.0 / total)
            # the target's column: e_t - s, once every thread's store of the row is issued (the
            # barrier orders them within the program)
            tl.debug_barrier()
            tl.store(out + target, (tl.exp2(x_t * LOG2E - m_log2) - total).to(grad_ptr.dtype.element_ty))

    @triton.jit
    def _ce_bwd_kernel(logits_ptr, stride, grad_ptr, targets_ptr, lse_ptr, dloss_ptr, V, Vp, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        out = grad_ptr + row * stride
        lse = tl.load(lse_ptr + row)
        target = tl.load(targets_ptr + row)
        dloss = tl.load(dloss_ptr + row)
        for start in range(0, Vp, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            # Masked at the padded width, a multiple of 16, the loads are 16 bytes wide (at 50257
            # they were 2: 1.70 -> 1.61 ms, call 14); the padded columns are dropped after.
            x = tl.load(base + cols, mask=cols < Vp, other=0.0).to(tl.float32)
            x = tl.where(cols < V, x, float("-inf"))
            p = tl.exp(x - lse)  # softmax; exactly 0 on padded columns
            g = tl.where(cols == target, p - 1.0, p) * dloss
            tl.store(out + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < Vp)


def _torch_fwd(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits[:, :vocab].float()
    lse = torch.logsumexp(x, dim=-1)
    return lse - x.gather(1, targets[:, None]).squeeze(1), lse


@torch.library.custom_op("x1::ce_fwd", mutates_args=())
def ce_fwd(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and logsumexp (fp32) of logits (N, Vp) against targets (N,), over the first `vocab` columns."""
    if not triton_ok(logits):
        return _torch_fwd(logits, targets, vocab)
    n = logits.size(0)
    loss = torch.empty(n, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(loss)
    _ce_fwd_kernel[(n,)](logits, logits.stride(0), targets, loss, lse, vocab, logits.size(1), **FWD_LAUNCH)
    return loss, lse


@ce_fwd.register_fake
def _(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = logits.size(0)
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


def _torch_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor, vocab: int) -> torch.Tensor:
    p = torch.exp(logits[:, :vocab].float() - lse[:, None])
    p.scatter_add_(1, targets[:, None], -torch.ones_like(p[:, :1]))
    grad = torch.zeros_like(logits)
    grad[:, :vocab] = (p * dloss[:, None]).to(logits.dtype)
    return grad


@torch.library.custom_op("x1::ce_bwd", mutates_args=())
def ce_bwd(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor, vocab: int) -> torch.Tensor:
    """d loss / d logits, in the logits' dtype: (softmax - onehot) x dloss per row; 0 on padded columns."""
    if not triton_ok(logits):
        return _torch_grad(logits, targets, lse, dloss, vocab)
    grad = torch.empty_like(logits)
    _ce_bwd_kernel[(logits.size(0),)](logits, logits.stride(0), grad, targets, lse, dloss.contiguous(), vocab,
                                      logits.size(1), **BWD_LAUNCH)
    return grad


@ce_bwd.register_fake
def _(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.empty_like(logits)


def _setup(ctx, inputs, output) -> None:
    logits, targets, vocab = inputs
    ctx.save_for_backward(logits, targets, output[1])
    ctx.vocab = vocab


def _backward(ctx, dloss: torch.Tensor, dlse: torch.Tensor):
    logits, targets, lse = ctx.saved_tensors
    return ce_bwd(logits, targets, lse, dloss, ctx.vocab), None, None


ce_fwd.register_autograd(_backward, setup_context=_setup)


def grad_programs(device: torch.device) -> int:
    """How many programs the persistent forward-and-gradient kernel runs."""
    if device.type != "cuda":
        return 3  # the interpreter: a few programs, each looping over several rows
    return torch.cuda.get_device_properties(device).multi_processor_count * GRAD_LAUNCH["PER_SM"]


@torch.library.custom_op("x1::ce_fwd_grad", mutates_args=())
def ce_fwd_grad(logits: torch.Tensor, targets: torch.Tensor, vocab: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss (fp32), a gradient g (the logits' dtype, 0 on padded columns) and a per-row
    scale (fp32), in one kernel: d loss_row / d logits = scale_row * g_row = softmax - onehot."""
    n = logits.size(0)
    if not triton_ok(logits):
        loss, lse = _torch_fwd(logits, targets, vocab)
        ones = torch.ones_like(lse)
        return loss, _torch_grad(logits, targets, lse, ones, vocab), ones
    loss = torch.empty(n, device=logits.device, dtype=torch.float32)
    scale = torch.empty_like(loss)
    grad = torch.empty_like(logits)
    launch = {k: v for k, v in GRAD_LAUNCH.items() if k != "PER_SM"}
    # the registers per thread that let PER_SM programs share an SM's 64K (ptxas would otherwise
    # take up to 38 for this kernel at 32 warps, and fit one program per SM)
    launch["maxnreg"] = min(255, 65536 // (GRAD_LAUNCH["PER_SM"] * GRAD_LAUNCH["num_warps"] * 32))
    grid = (min(n, grad_programs(logits.device)),)
    _ce_fwd_grad_kernel[grid](logits, logits.stride(0), grad, targets, loss, scale, n, vocab, logits.size(1), **launch)
    return loss, grad, scale


@ce_fwd_grad.register_fake
def _(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = logits.size(0)
    return logits.new_empty(n, dtype=torch.float32), torch.empty_like(logits), logits.new_empty(n, dtype=torch.float32)


class _HeadLoss(torch.autograd.Function):
    """Per-row cross-entropy of the head's logits h @ w.T whose forward also computes the logits'
    gradient, so that the backward is the head's two matmuls alone. The gradient of each row's
    loss, times the kernel's per-row scale, scales that row of the logits' gradient; it is applied
    to the matmuls' inputs and outputs (N x d_model, Vp x d_model) rather than to the N x Vp
    gradient, which would cost another pass over it."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab: int,
                acc: torch.Tensor | None, lt: bool) -> torch.Tensor:
        loss, grad, scale = ce_fwd_grad(cublaslt.matmul(h, w.t(), lt), targets, vocab)
        ctx.save_for_backward(h, w, grad, scale, acc)
        ctx.lt = lt
        return loss

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        h, w, grad, scale, acc = ctx.saved_tensors
        d = (dloss * scale)[:, None]
        dh = (cublaslt.matmul(grad, w, ctx.lt) * d).to(h.dtype)
        hd = (h * d).to(h.dtype)
        if acc is not None:  # the weight gradient added into the fp32 buffer by its matmul
            wgrad_accumulate(acc, grad, hd, ctx.lt)
            return dh, None, None, None, None, None
        return dh, grad.t() @ hd, None, None, None, None


def head_cross_entropy(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab: int,
                       acc: torch.Tensor | None = None, lt: bool = False) -> torch.Tensor:
    """Mean cross-entropy (fp32) of h (..., d_model) @ w.T against targets (...), padded columns of
    w excluded: the head and the loss of a training step, its backward two matmuls.

    h and w go in as they are: under autocast, the caller casts them as the head's matmul would.
    `acc`: an fp32 buffer (w's shape) to add w's gradient into, instead of returning it. `lt`: the
    two matmuls at their tuned cuBLASLt algorithm (train.cublaslt)."""
    return _HeadLoss.apply(h.reshape(-1, h.size(-1)), w, targets.reshape(-1), vocab, acc, lt).mean()


def fused_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Mean cross-entropy (fp32) of logits (..., Vp) against targets (...), padded columns excluded."""
    loss, _ = ce_fwd(logits.reshape(-1, logits.size(-1)).contiguous(), targets.reshape(-1), vocab)
    return loss.mean()


def fused_available(device: torch.device) -> bool:
    return triton_device(device)


def triton_runs(device: torch.device) -> bool:
    """The fused-kernels lever's probe: Triton compiles and runs the loss kernel on `device` and
    agrees with PyTorch (a Triton too old for a launch option, or no C compiler for its launcher,
    fails here at start-up instead of at the first step)."""
    if not fused_available(device):
        return False
    try:
        logits = torch.randn(4, 128, device=device, dtype=torch.bfloat16)
        targets = torch.randint(0, 100, (4,), device=device)
        loss, _ = ce_fwd(logits, targets, 100)
        loss_ref, _ = _torch_fwd(logits, targets, 100)
        return bool(torch.allclose(loss, loss_ref, atol=1e-2, rtol=1e-2))
    except Exception:  # noqa: BLE001 - any failure to compile or launch means: not on this machine
        return False
