"""The weights of the experts a call uses, prefetched into L2 while the call builds its tables
(KernelConfig.prefetch_mib).

Why. At decode sizes a call's GEMMs stream weights: GEMM0 of Qwen3-30B-A3B at 1 token (one rank's work of EP=2)
reads 50 MB of w13 at ~3.0 TB/s (16.6 us), and before it, from the end of the counts kernel to the first GEMM tile,
~17 us go to kernels that are chains of dependent loads (scan, bases, emit, dispatch, gather) and leave HBM idle
(bench/results/h200-39eda33). Once the counts vector is written, which local experts have rows is known; this
launch, on a side stream right after the counts kernel, asks for the first `budget` bytes of their weights to be
brought into L2 (`cp.async.bulk.prefetch.L2.global`: a bulk request, no registers, no shared memory; the launch ends
as soon as its requests are issued), so that the GEMMs find them there. The H200's L2 holds 60 MiB; the budget is a
setting because how much of it survives until the GEMMs read it is for a GPU run to say.

What, in this order (`prefetch_sizes`, the definition the kernel is tested against): the w13 of every local expert
with at least one row, in expert order (the order of GEMM0's tiles), then the w2 of the same experts in the same
order (GEMM1's), the whole cut at `budget` bytes. Experts without rows are skipped: at 1 token per rank 8 of
Qwen3's 64 local experts have rows.

Work split. One program per local expert; program e loads the pair counts of every local expert, finds its own
ordinal among the experts with rows (an exclusive prefix sum), and so where its w13 and its w2 start in the prefetch
order; it issues its pieces of PIECE bytes that start under the budget (the last one cut there), LANES per step.
Sizes and addresses are multiples of 16 bytes, as the instruction requires: the host checks that H * I is a
multiple of 8 and that the budget and PIECE are multiples of 16.

A prefetch writes nothing: a wrong range costs time, never a result. Under the interpreter (no PTX) TRACE stores
each piece's size at [expert, matrix, piece] of `trace` instead (0: not prefetched), which the tests compare with
`prefetch_sizes`.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from weave_moe.backends.weave.kernels import sync
from weave_moe.models import BYTES_PER_ELEMENT

__all__ = ["WeightPrefetch", "prefetch_kernel", "prefetch_sizes", "PIECE_BYTES"]

#: bytes per prefetch request: 64 KiB, so that the ~50 MB of a small model's active w13 is ~800 requests spread over
#: the programs of its active experts (one step of LANES each for Qwen3-30B-A3B's 6.3 MB per expert)
PIECE_BYTES = 64 * 1024
LANES = 128
NUM_WARPS = 4


def prefetch_sizes(expert_rows, w13_bytes: int, w2_bytes: int, budget: int, piece: int = PIECE_BYTES) -> np.ndarray:
    """The bytes the kernel prefetches (module docstring), as int64 [E_local, 2, pieces per w13]: [e, 0, q] is the
    size of piece q of expert e's w13 (starting at byte q * piece of that expert's matrix), [e, 1, q] of its w2;
    0 where nothing is prefetched. `expert_rows`: rows (pairs) per local expert."""
    rows = np.asarray(expert_rows, dtype=np.int64)
    pieces = -(-w13_bytes // piece)
    sizes = np.zeros((rows.size, 2, pieces), dtype=np.int64)
    active = np.flatnonzero(rows > 0)
    position = 0   # bytes before this matrix in the prefetch order
    for matrix, matrix_bytes in ((0, w13_bytes), (1, w2_bytes)):
        for e in active:
            for q in range(-(-matrix_bytes // piece)):
                start = position + q * piece
                if start >= budget:
                    break
                sizes[e, matrix, q] = min(piece, matrix_bytes - q * piece, budget - start)
            position += matrix_bytes
    return sizes


@triton.jit
def _issue(base_ptr, offsets, sizes, TRACE: tl.constexpr, trace_ptr, trace_offsets):
    """Prefetch `sizes[i]` bytes at `base_ptr + offsets[i]` into L2 where sizes[i] > 0 (TRACE: store the sizes)."""
    if TRACE:
        tl.store(trace_ptr + trace_offsets, sizes.to(tl.int64), mask=sizes > 0)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base_ptr + offsets, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_kernel(counts_ptr, rows_offset, w13_ptr, w2_ptr, trace_ptr,
                    E_LOCAL: tl.constexpr, BLOCK_E: tl.constexpr, W13_BYTES: tl.constexpr, W2_BYTES: tl.constexpr,
                    BUDGET: tl.constexpr, PIECE: tl.constexpr, LANES: tl.constexpr, TRACE: tl.constexpr):
    """Program e: expert e's pieces under the budget (module docstring). counts_ptr: the counts vector, this rank's
    pair counts per local expert at [rows_offset, rows_offset + E_LOCAL); w13_ptr, w2_ptr: the weights as bytes."""
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    rows = tl.load(counts_ptr + rows_offset + experts, mask=experts < E_LOCAL, other=0)
    active = (rows > 0).to(tl.int64)
    before = tl.sum(tl.where(experts < e, active, 0), axis=0)       # experts with rows before e
    mine = tl.sum(tl.where(experts == e, active, 0), axis=0)
    count = tl.sum(active, axis=0)
    pieces13: tl.constexpr = (W13_BYTES + PIECE - 1) // PIECE
    # where e's matrices start in the prefetch order: every active expert's w13, then their w2
    _prefetch_matrix(w13_ptr, e, before * W13_BYTES, mine, W13_BYTES, BUDGET, PIECE, LANES, TRACE, trace_ptr,
                     (e * 2) * pieces13)
    _prefetch_matrix(w2_ptr, e, count * W13_BYTES + before * W2_BYTES, mine, W2_BYTES, BUDGET, PIECE, LANES, TRACE,
                     trace_ptr, (e * 2 + 1) * pieces13)


@triton.jit
def _prefetch_matrix(base_ptr, e, position, mine, MATRIX_BYTES: tl.constexpr, BUDGET: tl.constexpr,
                     PIECE: tl.constexpr, LANES: tl.constexpr, TRACE: tl.constexpr, trace_ptr, trace_row):
    """Expert e's matrix (MATRIX_BYTES each, from `base_ptr`), `position` bytes into the prefetch order: its pieces
    under the budget; none if the expert has no rows (`mine` 0)."""
    room = tl.where(mine > 0, BUDGET - position, 0)                    # bytes of the budget left at its start
    wanted = tl.minimum(tl.maximum(room, 0), MATRIX_BYTES)
    lanes = tl.arange(0, LANES)
    for step in range(0, tl.cdiv(wanted, PIECE * LANES).to(tl.int32)):
        q = step * LANES + lanes
        start = q.to(tl.int64) * PIECE
        sizes = tl.minimum(wanted - start, PIECE).to(tl.int32)
        _issue(base_ptr, e.to(tl.int64) * MATRIX_BYTES + start, sizes, TRACE, trace_ptr, trace_row + q)


class WeightPrefetch:
    """The launch of `prefetch_kernel` for one layer's weights: `launch(counts)` after the counts kernel."""

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, budget_bytes: int,
                 rows_offset: int, piece: int = PIECE_BYTES):
        """`rows_offset`: where this rank's pair counts per local expert start in the counts vector
        (`CountsFormat.expert_pairs_offset + rank * E_local`)."""
        H, I = hidden_size, intermediate_size
        if not self.supports(H, I):
            raise ValueError(f"a prefetched weight matrix must be a multiple of 16 bytes: H * I = {H * I} is not a "
                             f"multiple of {16 // BYTES_PER_ELEMENT}")
        if budget_bytes <= 0 or budget_bytes % 16 or piece <= 0 or piece % 16:
            raise ValueError(f"budget_bytes ({budget_bytes}) and piece ({piece}) must be positive multiples of 16")
        self.num_local_experts, self.budget, self.piece = num_local_experts, budget_bytes, piece
        self.rows_offset = rows_offset
        self.w13_bytes, self.w2_bytes = 2 * I * H * BYTES_PER_ELEMENT, H * I * BYTES_PER_ELEMENT

    @staticmethod
    def supports(hidden_size: int, intermediate_size: int) -> bool:
        """Whether a layer of this shape can prefetch: the bulk prefetch takes multiples of 16 bytes."""
        return hidden_size * intermediate_size * BYTES_PER_ELEMENT % 16 == 0

    @property
    def constants(self) -> dict:
        return dict(E_LOCAL=self.num_local_experts, BLOCK_E=triton.next_power_of_2(self.num_local_experts),
                    W13_BYTES=self.w13_bytes, W2_BYTES=self.w2_bytes, BUDGET=self.budget, PIECE=self.piece,
                    LANES=LANES)

    def trace_shape(self) -> tuple:
        return (self.num_local_experts, 2, -(-self.w13_bytes // self.piece))

    def launch(self, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               trace: torch.Tensor | None = None) -> None:
        """Enqueue the prefetch of `w13` [E_local, 2I, H] and `w2` [E_local, H, I] (contiguous, bf16) for the pair
        counts in `counts`. `trace` (the interpreter's tests): int64 `trace_shape()`, zeroed, gets the sizes."""
        expected = ((self.num_local_experts, self.w13_bytes // 2), (self.num_local_experts, self.w2_bytes // 2))
        for name, weights, (experts, elements) in (("w13", w13, expected[0]), ("w2", w2, expected[1])):
            if weights.dtype != torch.bfloat16 or not weights.is_contiguous() or weights.shape[0] != experts \
                    or weights[0].numel() != elements:
                raise ValueError(f"{name}: expected contiguous bf16 with {experts} experts of {elements} elements, "
                                 f"got {weights.dtype} {tuple(weights.shape)}")
        if (trace is None) != (not sync.INTERPRETER.value):
            raise ValueError("trace: required under the Triton interpreter (it has no PTX), refused otherwise")
        if trace is not None and (trace.dtype != torch.int64 or tuple(trace.shape) != self.trace_shape()):
            raise ValueError(f"trace must be int64 {list(self.trace_shape())}, got {trace.dtype} {tuple(trace.shape)}")
        prefetch_kernel[(self.num_local_experts,)](
            counts, self.rows_offset, w13.view(torch.uint8), w2.view(torch.uint8),
            trace if trace is not None else counts, **self.constants, TRACE=trace is not None, num_warps=NUM_WARPS)


def compile_prefetch(prefetch: WeightPrefetch, capability: int = 90):
    """The kernel compiled for sm_<capability> without a GPU, as `launch` specialises it (tests: its PTX)."""
    from weave_moe.backends.weave.kernels.sm90 import compile_for_sm90

    counts = torch.zeros(16, dtype=torch.int32)
    weights = torch.empty(64, dtype=torch.uint8)
    return compile_for_sm90(prefetch_kernel, (counts, prefetch.rows_offset, weights, weights, counts),
                            dict(prefetch.constants, TRACE=False, num_warps=NUM_WARPS), capability)
