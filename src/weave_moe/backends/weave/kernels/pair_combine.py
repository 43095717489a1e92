"""The combine of a paired call at EP = 1 (KernelConfig.pair_dispatch): out[t] = sum_j w[t, j] * y[row(t, j)].

Why. After the pair dispatch (kernels/early_dispatch.py, `pair_dispatch_kernel`) each (token, expert) pair has its
own row in expert order, and that kernel wrote the row of pair (t, j) into a [T, k] table. At EP = 1 every pair is
this rank's, so the combine needs nothing else: no task tables (scan, bases, emit), no combine region, no reduce
phase. The megakernel's combine + reduce at EP = 1 computes the same value: its combine sums weight * y over a
token's top-k slots in slot order in fp32 and rounds once to bf16 (`tiles.combine_rows`); its reduce then adds that
one bf16 row into an fp32 zero and rounds again, which changes nothing (`tiles.reduce_rows`). So the two agree bit
for bit wherever the compiler forms the products and sums the same way.

Work. Items (token, BLOCK_H columns) of the call's T tokens are dealt round-robin to the programs; an item loads the
token's k rows and weights, sums in slot order and stores one bf16 row into out (its address from `io`, as the
megakernel reads it). A slot with no expert (row -1) adds nothing; a token with none gets a zero row. A refused call
(the status word set by the counts' verdict) writes NaN rows instead (`tiles.poison_rows`' rule: a caller who ignores
the deferred error cannot mistake them for an answer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weave_moe.backends.weave.kernels import sync
from weave_moe.backends.weave.kernels.early_dispatch import check_plan_gate
from weave_moe.backends.weave.kernels.peers import call_io_ptr

__all__ = ["PairCombine", "pair_combine_kernel"]

NUM_WARPS = 2   # 64 threads x 8 bf16 = one BLOCK_H of 512 columns: 16-byte accesses


@triton.jit(do_not_specialize=["rank", "num_sms"])
def pair_combine_kernel(y_ptr, rows_ptr, weights_ptr, weights_stride, tokens_ptr, tokens_stride, io_ptr, status_ptr,
                        plan_ptr, num_sms, rank, H, K: tl.constexpr, BLOCK_H: tl.constexpr, PLANNED: tl.constexpr):
    """out[t, cols] for the items (t, column block) dealt to this program; y: [pairs, H] bf16; rows: int32 [*, K]
    (`pair_dispatch_kernel`'s); weights: fp32, this rank's [T_max, K] at `weights_ptr + rank * weights_stride`.
    PLANNED: `plan_ptr` holds this rank's device plan's c; under a plan that is not serial (c < num_sms) nothing is
    written (that call's kernel combines)."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    n_tok = tl.load(tokens_ptr + rank * tokens_stride)
    if PLANNED:
        n_tok = tl.where(tl.load(plan_ptr) >= num_sms, n_tok, 0)
    blocks = tl.cdiv(H, BLOCK_H)
    out = call_io_ptr(io_ptr, 1, True)
    refused = sync.status_set(status_ptr)
    weights = weights_ptr + rank * weights_stride
    offs_h = tl.arange(0, BLOCK_H)
    for item in range(pid, n_tok * blocks, grid):
        token = item // blocks
        cols = (item % blocks) * BLOCK_H + offs_h
        mask_h = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        if refused == 0:
            for j in tl.static_range(K):
                row = tl.load(rows_ptr + token * K + j)
                weight = tl.load(weights + token * K + j)
                values = tl.load(y_ptr + tl.maximum(row, 0).to(tl.int64) * H + cols, mask=mask_h & (row >= 0),
                                 other=0.0)
                acc += weight * values.to(tl.float32)
        else:
            acc += float("nan")
        # the conversion `tiles.combine_rows` makes (round to nearest even on the GPU; the interpreter truncates)
        tl.store(out + tl.cast(token, tl.int64) * H + cols, acc.to(tl.bfloat16), mask=mask_h)


class PairCombine:
    """`pair_combine_kernel`'s launch for one layer at EP = 1: `launch(...)` after GEMM1 of a paired call."""

    def __init__(self, hidden_size: int, top_k: int, max_call_tokens: int, num_programs: int):
        self.hidden_size, self.top_k = hidden_size, top_k
        block_h = min(512, triton.next_power_of_2(hidden_size))
        # no more programs than items of the longest call
        self.num_programs = max(1, min(num_programs, max_call_tokens * triton.cdiv(hidden_size, block_h)))
        self.constants = dict(K=top_k, BLOCK_H=block_h)

    def _arguments(self, y, rows, all_weights, tokens, io, status, rank, plan, num_sms) -> tuple:
        H, K = self.hidden_size, self.top_k
        if y.dtype != torch.bfloat16 or y.dim() != 2 or y.shape[1] != H or not y.is_contiguous():
            raise ValueError(f"y must be contiguous bf16 [pairs, {H}], got {y.dtype} {tuple(y.shape)}")
        if rows.dtype != torch.int32 or rows.dim() != 2 or rows.shape[1] != K or not rows.is_contiguous():
            raise ValueError(f"rows must be contiguous int32 [tokens, {K}], got {rows.dtype} {tuple(rows.shape)}")
        if all_weights.dtype != torch.float32 or all_weights.dim() != 3 or all_weights.shape[2] != K \
                or all_weights.stride(2) != 1 or all_weights.stride(1) != K:
            raise ValueError(f"all_weights must be fp32 [EP, T_max, {K}] with contiguous rows, got "
                             f"{all_weights.dtype} {tuple(all_weights.shape)}")
        check_plan_gate(plan, num_sms)
        return (y, rows, all_weights, all_weights.stride(0), tokens, tokens.stride(0), io, status,
                rows if plan is None else plan, num_sms, rank, H)

    def launch(self, y: torch.Tensor, rows: torch.Tensor, all_weights: torch.Tensor, tokens: torch.Tensor,
               io: torch.Tensor, status: torch.Tensor, rank: int, plan: torch.Tensor | None = None,
               num_sms: int = 0) -> None:
        """Enqueue out = the call's combine (out at `io[1]`, this rank's T tokens from `tokens`). `plan`: int32 [1],
        this rank's device plan's c: the launch writes only if c >= `num_sms` (serial)."""
        pair_combine_kernel[(self.num_programs,)](
            *self._arguments(y, rows, all_weights, tokens, io, status, rank, plan, num_sms), **self.constants,
            PLANNED=plan is not None, num_warps=NUM_WARPS)

    def warmup(self, y, rows, all_weights, tokens, io, status, rank, plan=None, num_sms=0) -> None:
        """Compile for these arguments' specialisation without launching."""
        pair_combine_kernel.warmup(*self._arguments(y, rows, all_weights, tokens, io, status, rank, plan, num_sms),
                                   **self.constants, PLANNED=plan is not None, grid=(self.num_programs,),
                                   num_warps=NUM_WARPS)
