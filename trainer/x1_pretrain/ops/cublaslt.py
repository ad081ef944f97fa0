"""Matmuls through cuBLASLt with the algorithm chosen by timing, not by the heuristic's first answer.

PyTorch asks cuBLAS for one algorithm per shape: the first its heuristic returns. The heuristic
ranks a list of candidates (tile shapes, cluster shapes, split-K, raster orders), and its first is
not always the fastest on a given GPU under a given power cap: the head's forward, for one, runs
at 84% of the rate of its weight gradient, a matmul of the same FLOPs (docs/PERFORMANCE.md). Here
the first call of a shape times the heuristic's `CANDIDATES` best on that call's own operands and
keeps the fastest for every later call of the shape: a training run calls each shape hundreds of
thousands of times, the search costs a few seconds at start. Where `CACHE_ENV` names a file (the
trainer's is on the workspace volume, beside torch.compile's caches), each choice is kept there: a
relaunch after a preemption runs the same algorithms as the process before it, without timing them.

cuBLASLt is reached through ctypes, in the libcublasLt that PyTorch itself loaded: no build step,
no second copy of the library. CUDA only; `available()` says whether this process can use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

CANDIDATES = 16  # how many of the heuristic's algorithms the first call of a shape times
WORKSPACE_BYTES = 32 * 2**20  # what PyTorch gives cuBLAS on Hopper
TIMED_CALLS = 5  # per candidate, after two untimed ones
CACHE_ENV = "X1_CUBLASLT_CACHE"  # a JSON file of the choices made, read at a shape's first call

# cuBLASLt's enums (cublasLt.h, library_types.h, cublas_api.h)
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT_BYTES = (5, 6, 7, 8)  # of A, B, C, D
_OP_N, _OP_T = 0, 1
_DTYPES = {torch.float32: _R_32F, torch.float16: _R_16F, torch.bfloat16: _R_16BF}


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_P = ctypes.c_void_p
_SIGNATURES = {
    "cublasLtCreate": [ctypes.POINTER(_P)],
    "cublasLtMatmulDescCreate": [ctypes.POINTER(_P), ctypes.c_int, ctypes.c_int],
    "cublasLtMatmulDescSetAttribute": [_P, ctypes.c_int, _P, ctypes.c_size_t],
    "cublasLtMatrixLayoutCreate": [ctypes.POINTER(_P), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
    "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(_P)],
    "cublasLtMatmulPreferenceSetAttribute": [_P, ctypes.c_int, _P, ctypes.c_size_t],
    "cublasLtMatmulAlgoGetHeuristic": [_P, _P, _P, _P, _P, _P, _P, ctypes.c_int, ctypes.POINTER(_HeuristicResult),
                                       ctypes.POINTER(ctypes.c_int)],
    "cublasLtMatmul": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, ctypes.POINTER(_Algo), _P, ctypes.c_size_t, _P],
    "cublasLtGetVersion": [],
}
_lib: ctypes.CDLL | None = None
_handle = _P()
_workspaces: dict[int, torch.Tensor] = {}


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        x = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
        x @ x  # PyTorch loads cuBLAS and cuBLASLt at its first matmul
        paths = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                 if "libcublasLt.so" in line]
        lib = ctypes.CDLL(paths[0] if paths else "libcublasLt.so")
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = ctypes.c_size_t if name == "cublasLtGetVersion" else ctypes.c_int
        _lib = lib
        _check("cublasLtCreate", _lib.cublasLtCreate(ctypes.byref(_handle)))
    return _lib


def _check(what: str, status: int) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt: {what} returned status {status}")


_available: bool | None = None
# Whether this process's torch runs the CUDA addmm with a bf16 product added into an fp32 matrix
# in place (aten::addmm.dtype_out: torch >= 2.8; some versions require the added matrix in the
# inputs' dtype). A probe's answer per device type, not a switch.
_ADDMM_INTO_FP32: bool | None = None


def addmm_into_fp32(device: torch.device) -> bool:
    """Whether torch.addmm(acc, a, b, out_dtype=float32, out=acc) adds a bf16 product into fp32
    on `device` (probed once, on CUDA; never on a CPU)."""
    global _ADDMM_INTO_FP32
    if device.type != "cuda":
        return False
    if _ADDMM_INTO_FP32 is None:
        c = torch.zeros(8, 8, device=device)
        a = torch.ones(16, 8, device=device, dtype=torch.bfloat16)
        try:
            out = torch.addmm(c, a.t(), a, out_dtype=torch.float32, out=c)
            _ADDMM_INTO_FP32 = out.data_ptr() == c.data_ptr() and bool((c == 16).all())
        except (RuntimeError, TypeError):
            _ADDMM_INTO_FP32 = False
    return _ADDMM_INTO_FP32


def _pytorch_runs(a: torch.Tensor, out: torch.Tensor, beta: float) -> bool:
    """Whether PyTorch's own call can stand among the candidates: a plain product always; an add
    into a matrix of another dtype only where this torch's addmm takes out_dtype."""
    return not beta or out.dtype == a.dtype or addmm_into_fp32(out.device)


def constant_under_compile(fn):
    """`torch.compiler.assume_constant_result` (torch.compile runs `fn` once and keeps the answer)
    without importing torch._dynamo at import time: that import is 2 s of every process's start,
    most of which never compile. The mark is the one torch sets (tests/test_cublaslt.py checks)."""
    fn._dynamo_marked_constant = True
    return fn


@constant_under_compile
def available() -> bool:
    """Whether this process can run matmuls here (a CUDA GPU and the libcublasLt PyTorch loaded)."""
    global _available
    if _available is None:
        _available = torch.cuda.is_available() and torch.version.cuda is not None
        if _available:
            try:
                _load()
            except (OSError, AttributeError, RuntimeError):
                _available = False
    return _available


def use_for(x: torch.Tensor) -> bool:
    """Whether matmuls on x can go through here: on CUDA, 16-bit operands."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and available()


def matmul(x: torch.Tensor, w: torch.Tensor, tuned: bool = True) -> torch.Tensor:
    """x (..., k) @ w (k, n): a linear layer's product (w a weight or its transposed view), at the
    tuned algorithm where `tuned` (the run's train.cublaslt) and `use_for(x)`, else PyTorch's."""
    if not (tuned and use_for(x)):
        return x @ w
    a = x.reshape(-1, x.size(-1))
    if a.stride(-1) != 1:
        a = a.contiguous()
    return lt_mm(a, w).view(*x.shape[:-1], w.size(1))


def _transposed_col_major(x: torch.Tensor) -> tuple[int, int, int, int]:
    """x (r, c) as cuBLASLt's column-major operand x^T (c, r): (op, rows, cols, ld) of the matrix
    as stored. A row-major x is x^T stored column-major; a column-major x (a transposed view) is
    x itself, to be transposed by the op."""
    r, c = x.shape
    if x.stride(1) == 1 and (r == 1 or x.stride(0) >= c):
        return _OP_N, c, r, max(x.stride(0), c)
    if x.stride(0) == 1 and (c == 1 or x.stride(1) >= r):
        return _OP_T, r, c, max(x.stride(1), r)
    raise ValueError(f"cuBLASLt matmul: operand of shape {tuple(x.shape)} and strides {x.stride()} is neither "
                     "row- nor column-major")


def _alignment(ptr: int) -> int:
    return min(256, ptr & -ptr) if ptr else 256


@dataclass
class _Plan:
    """One shape's descriptors, its candidates and the algorithm chosen."""
    desc: _P
    layouts: tuple[_P, _P, _P]  # the stored A, the stored B (cuBLASLt's order: ours swapped), C = D
    candidates: list[_HeuristicResult]
    chosen: int | None = None  # a candidate's rank, or PYTORCH
    timings_ms: list[float] = field(default_factory=list)  # per candidate, in the heuristic's order
    pytorch_ms: float | None = None  # PyTorch's own call of the same product, timed beside them
    stored_as: str = ""  # its entry in the file of choices: the GPU, the library and the shape
    source: str = ""  # how `chosen` was reached: "timed", "kept" (from the file) or "captured" (untimed)


PYTORCH = -1  # the tuning's answer when PyTorch's own call (cuBLAS's first algorithm) was the fastest


_plans: dict[tuple, _Plan] = {}


def _layout(dtype: int, rows: int, cols: int, ld: int) -> _P:
    out = _P()
    _check("cublasLtMatrixLayoutCreate", _load().cublasLtMatrixLayoutCreate(ctypes.byref(out), dtype, rows, cols, ld))
    return out


def _plan(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, out_align: int = 256) -> tuple[tuple, _Plan]:
    lib = _load()
    (m, k), n = a.shape, b.size(1)
    # D = A @ B row-major is D^T = B^T @ A^T column-major: cuBLASLt's first operand is our B.
    op_b, rb, cb, ldb = _transposed_col_major(b)
    op_a, ra, ca, lda = _transposed_col_major(a)
    # the pointers' alignment, which the heuristic otherwise assumes to be 256 bytes
    align = [_alignment(t.data_ptr()) for t in (b, a)] + [out_align] * 2
    key = (a.device.index, a.dtype, out_dtype, m, n, k, op_a, lda, op_b, ldb, *align)
    if key in _plans:
        return key, _plans[key]
    desc = _P()
    _check("cublasLtMatmulDescCreate", lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F))
    for attr, op in ((_DESC_TRANSA, op_b), (_DESC_TRANSB, op_a)):
        value = ctypes.c_int32(op)
        _check("cublasLtMatmulDescSetAttribute",
               lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)))
    layouts = (_layout(_DTYPES[b.dtype], rb, cb, ldb), _layout(_DTYPES[a.dtype], ra, ca, lda),
               _layout(_DTYPES[out_dtype], n, m, n))
    pref = _P()
    _check("cublasLtMatmulPreferenceCreate", lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)))
    for attr, value in zip((_PREF_MAX_WORKSPACE_BYTES, *_PREF_MIN_ALIGNMENT_BYTES), (WORKSPACE_BYTES, *align),
                           strict=True):
        v = ctypes.c_uint64(value) if attr == _PREF_MAX_WORKSPACE_BYTES else ctypes.c_uint32(value)
        _check("cublasLtMatmulPreferenceSetAttribute",
               lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(v), ctypes.sizeof(v)))
    results = (_HeuristicResult * CANDIDATES)()
    found = ctypes.c_int(0)
    _check("cublasLtMatmulAlgoGetHeuristic",
           lib.cublasLtMatmulAlgoGetHeuristic(_handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref,
                                              CANDIDATES, results, ctypes.byref(found)))
    candidates = [results[i] for i in range(found.value) if results[i].state == 0]
    if not candidates:
        raise RuntimeError(f"cuBLASLt: no algorithm for {m} x {n} x {k} ({a.dtype} -> {out_dtype})")
    device = torch.cuda.get_device_properties(a.device)
    stored_as = "|".join(map(str, (device.name, f"sm_{device.major}{device.minor}", lib.cublasLtGetVersion(),
                                   *key[1:])))
    _plans[key] = plan = _Plan(desc, layouts, candidates, stored_as=stored_as)
    return key, plan


def _run(plan: _Plan, index: int, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, beta: float) -> None:
    if index == PYTORCH:
        if beta:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out=out)
        return
    ws = _workspaces.get(out.device.index)
    if ws is None:
        ws = _workspaces[out.device.index] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=out.device)
    alpha_, beta_ = ctypes.c_float(1.0), ctypes.c_float(beta)
    algo = plan.candidates[index].algo
    stream = torch.cuda.current_stream(out.device).cuda_stream
    _check("cublasLtMatmul", _lib.cublasLtMatmul(
        _handle, plan.desc, ctypes.byref(alpha_), b.data_ptr(), plan.layouts[0], a.data_ptr(), plan.layouts[1],
        ctypes.byref(beta_), out.data_ptr(), plan.layouts[2], out.data_ptr(), plan.layouts[2], ctypes.byref(algo),
        ws.data_ptr(), WORKSPACE_BYTES, stream))


def _choose(plan: _Plan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, beta: float) -> int:
    """The fastest candidate on these operands, PyTorch's own call among them; with beta = 1 into
    a scratch buffer of out's shape, so that the tuning's calls do not add into out."""
    if plan.chosen is not None:
        return plan.chosen
    if torch.cuda.is_current_stream_capturing():  # no timing inside a CUDA graph: the heuristic's first
        plan.source = "captured"
        return 0
    pytorch = _pytorch_runs(a, out, beta)
    plan.chosen = _stored_choice(plan)
    if plan.chosen == PYTORCH and not pytorch:  # kept by a torch that had the call; this one has not
        plan.chosen = None
    if plan.chosen is not None:
        plan.source = "kept"
        return plan.chosen
    scratch = torch.empty_like(out) if beta else out  # out is overwritten by the call the tuning precedes
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    timings = []
    for i in [PYTORCH, *range(len(plan.candidates))] if pytorch else range(len(plan.candidates)):
        for _ in range(2):
            _run(plan, i, a, b, scratch, beta)
        start.record()
        for _ in range(TIMED_CALLS):
            _run(plan, i, a, b, scratch, beta)
        end.record()
        end.synchronize()
        timings.append(start.elapsed_time(end) / TIMED_CALLS)
    plan.pytorch_ms, plan.timings_ms = (timings[0], timings[1:]) if pytorch else (None, timings)
    fastest = min(range(len(plan.timings_ms)), key=plan.timings_ms.__getitem__)
    plan.chosen = fastest if plan.pytorch_ms is None or plan.timings_ms[fastest] < plan.pytorch_ms else PYTORCH
    plan.source = "timed"
    _store_choice(plan)
    return plan.chosen


def _algo_hex(result: _HeuristicResult) -> str:
    return bytes(result.algo).hex()


def _read_choices(path: str) -> dict:
    try:
        choices = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: the file is a cache, its loss costs a re-timing
        return {}
    return choices if isinstance(choices, dict) else {}


def _stored_choice(plan: _Plan) -> int | None:
    """The choice the file of `CACHE_ENV` holds for this plan, if the heuristic still returns the
    same algorithm at that rank (the file may come from another GPU or library: then it is timed)."""
    path = os.environ.get(CACHE_ENV)
    entry = _read_choices(path).get(plan.stored_as) if path else None
    if not isinstance(entry, dict):
        return None
    rank, algo = entry.get("rank"), entry.get("algo")
    if rank == PYTORCH:
        return PYTORCH
    if isinstance(rank, int) and 0 <= rank < len(plan.candidates) and _algo_hex(plan.candidates[rank]) == algo:
        return rank
    return None


def _store_choice(plan: _Plan) -> None:
    """Adds the plan's choice to the file of `CACHE_ENV`, replaced whole (a reader never sees it torn)."""
    path = os.environ.get(CACHE_ENV)
    if not path:
        return
    choices = _read_choices(path)
    choices[plan.stored_as] = {
        "rank": plan.chosen, "algo": None if plan.chosen == PYTORCH else _algo_hex(plan.candidates[plan.chosen]),
        "ms": min(t for t in [plan.pytorch_ms, *plan.timings_ms] if t is not None),
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(tmp).write_text(json.dumps(choices, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:  # a read-only or full volume: the choice holds for this process, the next times again
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def summary() -> str | None:
    """One line on this process's choices so far: how many shapes, how many timed here, how many
    kept from the file of `CACHE_ENV` (a relaunch that finds its file times none); None before any."""
    sources = [plan.source for plan in _plans.values() if plan.source]
    if not sources:
        return None
    counts = {source: sources.count(source) for source in ("timed", "kept", "captured")}
    path = os.environ.get(CACHE_ENV)
    return (f"cuBLASLt: {len(sources)} matmul shapes, {counts['timed']} timed, {counts['kept']} at the "
            f"algorithm kept in {path or f'no file ({CACHE_ENV} unset)'}"
            + (f", {counts['captured']} at the heuristic's first (inside a CUDA graph)" if counts["captured"] else ""))


def tuned_mm(a: torch.Tensor, b: torch.Tensor, *, algo: int | None = None) -> torch.Tensor:
    """a (m, k) @ b (k, n), row-major (m, n) in a's dtype. Operands row- or column-major (a
    transposed view is free). `algo`: the heuristic's candidate to run, by rank (0: its first,
    what PyTorch's cuBLASLt path runs; PYTORCH: torch.mm); None: the fastest, timed at this shape's
    first call."""
    if a.dtype != b.dtype:
        raise ValueError(f"cuBLASLt matmul: operands {a.dtype} and {b.dtype}")
    out = torch.empty(a.size(0), b.size(1), dtype=a.dtype, device=a.device)
    _, plan = _plan(a, b, a.dtype)
    _run(plan, _choose(plan, a, b, out, 0.0) if algo is None else algo, a, b, out, 0.0)
    return out


def tuned_addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, algo: int | None = None) -> None:
    """acc += a @ b, acc row-major fp32 (m, n), a and b in a 16-bit dtype: the sum in fp32 by the
    matmul itself (a weight gradient added into its accumulator)."""
    if not acc.is_contiguous():
        raise ValueError("cuBLASLt addmm: the accumulator must be contiguous")
    _, plan = _plan(a, b, acc.dtype, _alignment(acc.data_ptr()))
    _run(plan, _choose(plan, a, b, acc, 1.0) if algo is None else algo, a, b, acc, 1.0)


def tuning(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> tuple[float | None, list[float]]:
    """PyTorch's time and the candidates' times (ms, in the heuristic's order) measured for this
    shape, once tuned."""
    plan = _plan(a, b, out_dtype or a.dtype)[1]
    return plan.pytorch_ms, plan.timings_ms


def chosen(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> int | None:
    """The candidate's rank this shape runs (PYTORCH: PyTorch's call), None before its first call."""
    return _plan(a, b, out_dtype or a.dtype)[1].chosen


@torch.library.custom_op("x1::lt_mm", mutates_args=())
def lt_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`tuned_mm` as an op torch.compile keeps whole."""
    return tuned_mm(a, b)


@lt_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.size(0), b.size(1))


@torch.library.custom_op("x1::lt_addmm_", mutates_args=("acc",))
def lt_addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`tuned_addmm_` as an op torch.compile keeps whole."""
    tuned_addmm_(acc, a, b)


@lt_addmm_.register_fake
def _(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    return None
