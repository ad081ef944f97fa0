"""Cross-entropy over bf16 logits without an fp32 copy of them.

Two ways, both custom ops over one Triton kernel family:

- `linear_cross_entropy` (training): the tied head's matmul and the loss as one op whose forward
  also writes d loss / d logits. The backward then needs no pass over the logits at all, only the
  two matmuls of the head's gradient; the upstream gradient (the 1 / grad_accum of accumulation)
  scales their small outputs, not the 3.3 GB gradient of the logits.
- `fused_cross_entropy` (evaluation, and the benchmark's previous lever): loss over given logits,
  the gradient recomputed in the backward (one read for the loss, one read and one write for the
  gradient).

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

from x1_pretrain.kernels import triton_device, triton_ok

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds have no Triton
    triton = None

_BLOCK = 4096  # backward: columns per iteration
# The forward-with-gradient kernel's shape. One 1024-thread program per row keeps ~2 rows per SM
# in flight, 26 MB on an H200, so the rows stay in its 50 MB L2 between passes. ONLINE=1 trades
# the separate max pass for a second exponential per element. Fixed rather than autotuned, so a
# relaunched run computes bit for bit what the first process did. bench/head_ce.py times others.
CE_GRAD_KERNEL = {"BLOCK": 16384, "ONLINE": 0, "num_warps": 32}


if triton is not None:

    @triton.jit
    def _ce_fwd_vec_kernel(logits_ptr, stride, targets_ptr, loss_ptr, lse_ptr, V, BLOCK: tl.constexpr):
        # Each lane keeps its own running max and sum-exp; one cross-lane reduction at the end
        # instead of two per block (the block version is bound by those reductions, not memory).
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            seen = m_new != float("-inf")  # lanes past V in every block stay empty
            s = tl.where(seen, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
            m = m_new
        row_max = tl.max(m, 0)
        total = tl.sum(tl.where(m != float("-inf"), s * tl.exp(m - row_max), 0.0), 0)
        lse = row_max + tl.log(total)
        target = tl.load(targets_ptr + row)
        x_t = tl.load(base + target).to(tl.float32)
        tl.store(loss_ptr + row, lse - x_t)
        tl.store(lse_ptr + row, lse)

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
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            p = tl.exp(x - lse)  # softmax; exactly 0 on padded columns
            g = tl.where(cols == target, p - 1.0, p) * dloss
            tl.store(out + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < Vp)

    # One program per row. The first pass reads the row from HBM; the later passes find it in L2
    # (a row is 100 KB), so the op costs one read and one write of the logits. Passes alternate
    # direction: each starts where the previous one ended, on the lines read last.
    @triton.jit
    def _ce_fwd_grad_kernel(logits_ptr, stride, grad_ptr, targets_ptr, loss_ptr, V, Vp, scale,
                            BLOCK: tl.constexpr, ONLINE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        out = grad_ptr + row * stride
        n_blocks = tl.cdiv(V, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        if ONLINE:  # one pass, two exponentials per element
            s = tl.zeros([BLOCK], tl.float32)
            for i in range(0, n_blocks):
                cols = i * BLOCK + tl.arange(0, BLOCK)
                x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m, x)
                s = tl.where(m_new != float("-inf"), s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
                m = m_new
            row_max = tl.max(m, 0)
            total = tl.sum(tl.where(m != float("-inf"), s * tl.exp(m - row_max), 0.0), 0)
        else:  # max, then sum-exp backwards over the row: one exponential per element
            for i in range(0, n_blocks):
                cols = i * BLOCK + tl.arange(0, BLOCK)
                m = tl.maximum(m, tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32))
            row_max = tl.max(m, 0)
            acc = tl.zeros([BLOCK], tl.float32)
            for i in range(0, n_blocks):
                cols = (n_blocks - 1 - i) * BLOCK + tl.arange(0, BLOCK)
                x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                acc += tl.exp(x - row_max)
            total = tl.sum(acc, 0)
        lse = row_max + tl.log(total)
        target = tl.load(targets_ptr + row)
        tl.store(loss_ptr + row, lse - tl.load(base + target).to(tl.float32))
        # The gradient, (softmax - onehot) x scale, over every column: padded ones get exactly 0.
        # ONLINE ended at the row's end, so it walks back; the two-pass version ended at its start.
        n_out = tl.cdiv(Vp, BLOCK)
        for i in range(0, n_out):
            j = n_out - 1 - i if ONLINE else i
            cols = j * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            p = tl.exp(x - lse)
            g = tl.where(cols == target, p - 1.0, p) * scale
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
    _ce_fwd_vec_kernel[(n,)](logits, logits.stride(0), targets, loss, lse, vocab, BLOCK=2048, num_warps=8)
    return loss, lse


@ce_fwd.register_fake
def _(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = logits.size(0)
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("x1::ce_bwd", mutates_args=())
def ce_bwd(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor, vocab: int) -> torch.Tensor:
    """d loss / d logits, in the logits' dtype: (softmax - onehot) x dloss per row; 0 on padded columns."""
    if not triton_ok(logits):
        p = torch.exp(logits[:, :vocab].float() - lse[:, None])
        p.scatter_add_(1, targets[:, None], -torch.ones_like(p[:, :1]))
        grad = torch.zeros_like(logits)
        grad[:, :vocab] = (p * dloss[:, None]).to(logits.dtype)
        return grad
    grad = torch.empty_like(logits)
    _ce_bwd_kernel[(logits.size(0),)](logits, logits.stride(0), grad, targets, lse, dloss.contiguous(), vocab,
                                      logits.size(1), BLOCK=_BLOCK, num_warps=16)
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


def _torch_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    loss, lse = _torch_fwd(logits, targets, vocab)
    p = torch.exp(logits[:, :vocab].float() - lse[:, None])
    p.scatter_add_(1, targets[:, None], -torch.ones_like(p[:, :1]))
    grad = torch.zeros_like(logits)
    grad[:, :vocab] = (p / logits.size(0)).to(logits.dtype)
    return loss.mean(), grad


@torch.library.custom_op("x1::linear_ce", mutates_args=())
def linear_ce(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy (fp32) of h @ w.T (N, Vp) against targets (N,) over the first `vocab`
    columns, and its gradient w.r.t. those logits (in h's dtype; 0 on padded columns)."""
    logits = h @ w.t()
    if not triton_ok(logits):
        return _torch_loss_and_grad(logits, targets, vocab)
    n, vp = logits.shape
    loss = torch.empty(n, device=logits.device, dtype=torch.float32)
    grad = torch.empty_like(logits)
    _ce_fwd_grad_kernel[(n,)](logits, logits.stride(0), grad, targets, loss, vocab, vp, 1.0 / n, **CE_GRAD_KERNEL)
    return loss.mean(), grad


@linear_ce.register_fake
def _(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return h.new_empty((), dtype=torch.float32), h.new_empty(h.size(0), w.size(0))


def _linear_ce_setup(ctx, inputs, output) -> None:
    h, w, _, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero gradient of the (N, Vp) output is ever built
    ctx.save_for_backward(h, w, output[1])


def _linear_ce_backward(ctx, dloss: torch.Tensor, _):
    if dloss is None:
        return None, None, None, None
    h, w, dlogits = ctx.saved_tensors
    dloss = dloss.to(h.dtype)
    return (dlogits @ w) * dloss, (dlogits.t() @ h) * dloss, None, None


linear_ce.register_autograd(_linear_ce_backward, setup_context=_linear_ce_setup)


def linear_cross_entropy(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Mean cross-entropy of the head h (..., D) @ w.T (Vp, D) against targets (...), padded
    columns excluded; h and w are multiplied in h's dtype."""
    loss, _ = linear_ce(h.reshape(-1, h.size(-1)), w.to(h.dtype), targets.reshape(-1), vocab)
    return loss


def fused_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Mean cross-entropy (fp32) of logits (..., Vp) against targets (...), padded columns excluded."""
    loss, _ = ce_fwd(logits.reshape(-1, logits.size(-1)).contiguous(), targets.reshape(-1), vocab)
    return loss.mean()


def fused_available(device: torch.device) -> bool:
    return triton_device(device)
