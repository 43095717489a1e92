"""The task tables of `layout.build_layout` as three Triton kernels (and a memset, unless the caller keeps the
counters: `build_layout_triton`) instead of ~40 torch kernels.

Same inputs, same `layout.Layout`, the same values in every entry the megakernel reads (the first `meta` entries of each
task table, the first rows of each list; tests/test_tables.py checks them bitwise against `build_layout` under the
interpreter). Entries past those counts are not written (the torch tables hold other, equally unread, values); the
dispatch and combine task tables are zero there.

This module is the host side (`build_layout_triton`); the kernels of its three stages are in tables_scan.py,
tables_bases.py and tables_emit.py.

The tables are counting sorts. Every order `build_layout` sorts into is monotone in the token index within a group,
because a chunk is a monotone function of the token (chunk(t) = t * K // T_s). So an entry's position is

    (entries of earlier groups) + (entries of its group before it) = base[group] + running count along the tokens,

with groups (destination, chunk) for the rows this rank sends, (chunk, source) for the tokens it receives, and
(chunk, local expert, source) for its (token, expert) pairs (ties within a token by top-k slot, as the stable sort of
`build_layout` orders them). Shape legend as in layout.py: P ranks, T = T_max, k top-k, L local experts, MC chunks.

The running counts are built in two levels so that no program walks all tokens: the tokens are cut into NB blocks of
BT tokens (`_block_tokens`: ~128 blocks per source); a count along the tokens = the count in earlier blocks (a block
base) + the count within the block.

    1. `scan_kernel`, P * NB + NB programs:
         (source s, block b):  which tokens of the block have an expert here (rank within the block, the block's
                               count), each (token, expert) pair's rank among the block's pairs of its expert (q, in
                               steps of SUB tokens: a pairwise compare within the step + a running count per expert),
                               the block's pairs per local expert; pairs per (expert, chunk) and rows per chunk
                               added atomically into zeroed counters
         (block b of this rank's tokens): for every destination d, which tokens go to d (rank within the block, the
                               block's count); rows per (d, chunk) added atomically; the destination bit masks
    2. `bases_kernel`, 1 + P * ceil(L / 64) + 1 programs: program 0 the exclusive prefix sums of the counts (the
       group bases), the expert offsets, the M tiles per chunk, the offsets of the GEMM task groups in DAG order,
       `meta`; the others the block bases (exclusive prefix sums down the blocks) of pairs per (source, expert) and
       of received / sent tokens.
    3. `emit_kernel`, many programs: every entry at its position (group base + block base + rank within the block):
       the pairs' gather rows, the received tokens' combine rows (their pair positions and weights), the rows this
       rank sends, and the task rows (dispatch blocks, combine blocks, M tiles -> GEMM0 / GEMM1 tasks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from weave_moe.backends.weave.kernels import sync
from weave_moe.backends.weave.kernels.tables_bases import bases_kernel
from weave_moe.backends.weave.kernels.tables_emit import emit_kernel
from weave_moe.backends.weave.kernels.tables_scan import WAIT_BEFORE_CHUNKS, WAIT_FIRST, WAIT_LAST, scan_kernel
from weave_moe.backends.weave.layout import Layout
from weave_moe.plan.workload import MAX_CHUNKS

__all__ = ["build_layout_triton", "counter_words", "TableBuffers"]

_BLOCK_T = 32          # tokens per emit program
#: build_layout_triton(previous_writes=) -> the scan's WAIT
_WAIT_OF = {"any": WAIT_FIRST.value, "chunks": WAIT_BEFORE_CHUNKS.value, "none": WAIT_LAST.value}


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _block_tokens(T: int, KP: int) -> tuple[int, int]:
    """(tokens per scan block, tokens per step inside it): about 128 blocks per source, 32 to 256 tokens each, so
    a block's scan is a few short steps and the bases' walk down the blocks is a few wide ones; a step holds
    <= 128 (token, slot) pairs (its rank computation compares them pairwise)."""
    step = max(1, 128 // KP)
    return max(step, min(256, max(32, _pow2(-(-T // 128))))), step


def counter_words(world_size: int, num_experts: int) -> int:
    """int32 words of `build_layout_triton`'s atomic counters: pairs per (source, local expert, chunk), rows per
    (source, chunk) received and per (destination, chunk) sent."""
    return world_size * (num_experts // world_size) * MAX_CHUNKS + 2 * world_size * MAX_CHUNKS


@dataclass(frozen=True)
class _TableShapes:
    """What the sizes of `build_layout_triton`'s tables depend on, and those sizes (P ranks, T = T_max, k, L local
    experts; see the module docstring)."""

    P: int
    T: int
    K: int
    L: int
    n0: int
    n1: int
    block_m: int
    dispatch_rows: int
    combine_rows: int
    BT: int
    step: int

    @classmethod
    def of(cls, P, T, K, L, intermediate_size, hidden_size, block_m, block_n0, block_n1, dispatch_rows, combine_rows,
           block_tokens=None) -> "_TableShapes":
        BT, step = _block_tokens(T, _pow2(K))
        if block_tokens is not None:
            BT, step = block_tokens, min(step, block_tokens)
        return cls(P, T, K, L, -(-intermediate_size // block_n0), -(-hidden_size // block_n1), block_m,
                   dispatch_rows, combine_rows, BT, step)

    @property
    def NB(self) -> int:
        return triton.cdiv(self.T, self.BT)

    @property
    def max_pairs(self) -> int:
        return self.P * self.T * min(self.K, self.L)

    @property
    def max_dispatch(self) -> int:
        return self.P * self.T // self.dispatch_rows + self.P * MAX_CHUNKS + 1

    @property
    def max_combine(self) -> int:
        return self.P * self.T // self.combine_rows + MAX_CHUNKS * self.P + 1

    @property
    def max_mtiles(self) -> int:
        return self.max_pairs // self.block_m + MAX_CHUNKS * self.L + 1

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every table: name -> (shape, dtype)."""
        P, T, K, L, NB, MC = self.P, self.T, self.K, self.L, self.NB, MAX_CHUNKS
        i32, block_pmc = torch.int32, _pow2(_pow2(P) * MC)
        return dict(
            # per token and per token block (the scan's)
            q=((P, T, K), i32), recv_local=((P, T), i32), send_local=((P, T), i32),
            pair_hist=((P, NB, L), i32), pair_block_base=((P, NB, L), i32), recv_hist=((P, NB), i32),
            recv_block_base=((P, NB), i32), send_hist=((P, NB), i32), send_block_base=((P, NB), i32),
            # the group bases (the bases kernel's)
            pair_base=((P, L, MC), i32),
            seg_rows=((2 * MC * L,), i32),           # [rows | first row] per segment (chunk, local expert)
            seg_mtiles_end=((MC * L,), i32), chunk_mtiles=((MC,), i32), group_base=((2 * MC,), i32),
            recv_base=((P, MC), i32),
            combine_seg=((3 * block_pmc,), i32),     # [block end | row begin | rows] per segment (chunk, source)
            dispatch_seg=((3 * block_pmc,), i32),    # the same per segment (destination, chunk)
            send_base=((P,), i32),
            # the Layout's tables (no fills: every entry the kernels read is written; padding holds whatever was
            # there)
            meta=((5,), i32), token_dest_mask=((T,), i32), expert_offsets=((L + 1,), i32),
            gemm1_expected=((MC,), i32), arrival_expected=((P, MC), i32), combine_expected=((P,), i32),
            gather_rows=((self.max_pairs,), i32), combine_token=((P * T,), i32), combine_pos=((P * T, K), i32),
            combine_weight=((P * T, K), torch.float32), send_token=((P * T,), i32), send_slot=((P * T,), i32),
            dispatch_tasks=((self.max_dispatch, 4), i32), combine_tasks=((self.max_combine, 4), i32),
            gemm_tasks=((self.max_mtiles * (self.n0 + self.n1), 8), i32))


class TableBuffers:
    """The memory of `build_layout_triton`'s tables for one set of shapes (a layer's: EP, T_max, k, E, tile and
    task sizes), allocated once and rewritten by every call that passes it (`build_layout_triton(buffers=)`).
    Made by `for_layer`, whose arguments are build_layout_triton's of the same names (`world_size` = EP,
    `max_tokens` = T_max). `nbytes`: what it holds (3.2 MiB for Qwen3-30B-A3B, 5.4 MiB for DeepSeek-V3 at EP 2,
    T_max 8192)."""

    def __init__(self, shapes: _TableShapes, device):
        self.shapes, self.device = shapes, torch.device(device)
        self.tensors = {name: torch.empty(shape, dtype=dtype, device=device)
                        for name, (shape, dtype) in shapes.tensors().items()}

    @classmethod
    def for_layer(cls, world_size: int, max_tokens: int, top_k: int, num_experts: int, *, hidden_size: int,
                  intermediate_size: int, block_m: int, block_n0: int, block_n1: int, dispatch_rows: int,
                  combine_rows: int, device, block_tokens: int | None = None) -> "TableBuffers":
        shapes = _TableShapes.of(world_size, max_tokens, top_k, num_experts // world_size, intermediate_size,
                                 hidden_size, block_m, block_n0, block_n1, dispatch_rows, combine_rows, block_tokens)
        return cls(shapes, device)

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors.values())

    def layout(self) -> Layout:
        """The `layout.Layout` of these tables: what `build_layout_triton(buffers=self)` returns, without running it
        (the weave backend compiles its kernels for a call's arguments before the call enqueues anything)."""
        t, shapes = self.tensors, self.shapes
        return Layout(meta=t["meta"], dispatch_tasks=t["dispatch_tasks"], send_token=t["send_token"],
                      send_slot=t["send_slot"], gather_rows=t["gather_rows"], gemm_tasks=t["gemm_tasks"],
                      arrival_expected=t["arrival_expected"], gemm1_expected=t["gemm1_expected"],
                      num_mtiles_bound=shapes.max_mtiles, combine_tasks=t["combine_tasks"],
                      combine_token=t["combine_token"], combine_pos=t["combine_pos"],
                      combine_weight=t["combine_weight"], token_dest_mask=t["token_dest_mask"],
                      combine_expected=t["combine_expected"], max_pairs=shapes.max_pairs,
                      expert_offsets=t["expert_offsets"])


def build_layout_triton(all_ids: torch.Tensor, all_weights: torch.Tensor, tokens: torch.Tensor,
                        chunks: torch.Tensor, rank: int, num_experts: int, *, hidden_size: int,
                        intermediate_size: int, block_m: int, block_n0: int, block_n1: int, dispatch_rows: int,
                        combine_rows: int, reduce_rows: int, block_tokens: int | None = None,
                        counters: torch.Tensor | None = None, emit_tokens: int | None = None,
                        previous_writes: str = "any", serial_plan: torch.Tensor | None = None,
                        num_sms: int = 0, beside_emit=None, buffers: "TableBuffers | None" = None) -> Layout:
    """`layout.build_layout` (same arguments) as three Triton launches (and one memset); `chunks` must be a column
    of the [EP, 4] int32 plans (stride 4), as the resident call passes it. No host sync, static shapes (capturable).
    `block_tokens` (a power of two, tests): tokens per scan block instead of `_block_tokens`' choice. `counters`:
    the scan's atomic counters as a caller's buffer (`counter_words` int32, all zero), which the bases kernel zeroes
    again after reading them: no memset in the call (a node less in its graph); None: a zeroed buffer per call.
    `emit_tokens` (a power of two, tests): tokens per emit program instead of 32 (more: fewer programs, each a
    larger one; on an H200 32 were 0.2-0.6 us faster than 64 and up to 4 us faster than 256 with the serial skip
    below, 1 to 2048 tokens, bench/results/h200-42828c2).
    `previous_writes`: what the kernel launched just before (programmatic dependent launch) writes that the tables
    read, so where the scan waits for it (`scan_kernel`): "any" (at its start), "chunks" (only the chunk counts:
    an adaptive policy's planner, alone or inside the counts launch; the scan waits before it reads them) or "none"
    (the resident call's counts kernel under a fixed plan: the routing was complete before it, the chunks are the
    layer's; the scan runs beside it and waits at its end).
    `serial_plan` (int32 device scalar: this rank's c) with `num_sms`: for a layer that runs serial plans through
    the grouped GEMMs, which read their own tile tables (grouped_tiles): under a serial plan (c >= num_sms) no GEMM
    task row is written (`gemm_tasks` holds whatever was there; `meta` still counts them), under another plan
    every one is. Those rows are most of the emit's stores at prefill sizes (72 per M tile at DeepSeek-V3's
    shape).
    `beside_emit`: called between the bases and the emit launches with the `TableBuffers`, whose scan and bases
    entries (expert_offsets, send_local, send_block_base, token_dest_mask, arrival_expected, ...) are final by
    then: what needs only them can be enqueued on another stream, beside the emit (the weave backend's grouped-GEMM
    tile tables, from expert_offsets; the dispatch of a longer call, `early_dispatch.TablesDispatch`).
    `buffers`: the tables' memory (`TableBuffers` for these shapes), kept by the caller and rewritten by every call
    (the entries past each table's counts hold whatever an earlier call left, as in fresh memory); None: allocated
    here. A layer's resident calls pass theirs, so that the CUDA graph of each row count it captures holds no
    tables of its own."""
    device = all_ids.device
    P, T, K = all_ids.shape
    L = num_experts // P
    MC = MAX_CHUNKS
    if all_ids.dtype != torch.int32 or all_ids.stride()[1:] != (K, 1) or all_weights.stride() != all_ids.stride():
        raise ValueError("all_ids (int32) and all_weights must be [EP, T_max, k] views with contiguous rows and one "
                         "stride between ranks (RoutingMessage.unpack's views)")
    if chunks.dtype != torch.int32 or chunks.stride(0) != 4 or chunks.numel() != P:
        raise ValueError("chunks must be the K column of the [EP, 4] int32 plans (stride 4)")
    if tokens.dtype != torch.int32 or tokens.numel() != P:
        raise ValueError("tokens must be int32 [EP]")
    if previous_writes not in _WAIT_OF:
        raise ValueError(f"previous_writes must be one of {', '.join(_WAIT_OF)}, got {previous_writes!r}")
    if serial_plan is not None and (serial_plan.dtype != torch.int32 or serial_plan.numel() != 1 or num_sms < 1):
        raise ValueError("serial_plan must be an int32 device scalar (this rank's c) and num_sms >= 1")
    i32 = dict(dtype=torch.int32, device=device)
    shapes = _TableShapes.of(P, T, K, L, intermediate_size, hidden_size, block_m, block_n0, block_n1,
                             dispatch_rows, combine_rows, block_tokens)
    if buffers is None:
        buffers = TableBuffers(shapes, device)
    elif buffers.shapes != shapes or buffers.device != device:
        raise ValueError(f"buffers are for {buffers.shapes} on {buffers.device}, this call needs {shapes} on {device}")
    t = buffers.tensors
    max_dispatch, max_combine, max_mtiles, max_pairs = (shapes.max_dispatch, shapes.max_combine, shapes.max_mtiles,
                                                        shapes.max_pairs)
    n0, n1, NB, BT, step = shapes.n0, shapes.n1, shapes.NB, shapes.BT, shapes.step
    KP = _pow2(K)
    BLOCK_P = _pow2(P)
    BLOCK_PMC = _pow2(BLOCK_P * MC)
    BLOCK_L = _pow2(L)
    # scratch: what the scan counts with atomics (zeroed), then per token block
    if counters is None:
        counted = torch.zeros(counter_words(P, num_experts), **i32)
    elif counters.dtype != torch.int32 or counters.numel() != counter_words(P, num_experts) or \
            counters.device != device:
        raise ValueError(f"counters: expected int32 [{counter_words(P, num_experts)}] on {device}, given "
                         f"{counters.dtype} {tuple(counters.shape)} on {counters.device}")
    else:
        counted = counters
    pair_counts = counted[:P * L * MC].view(P, L, MC)
    arrival = counted[P * L * MC:P * L * MC + P * MC].view(P, MC)
    key_counts = counted[P * L * MC + P * MC:].view(P, MC)
    q, recv_local, send_local = t["q"], t["recv_local"], t["send_local"]
    pair_hist, pair_block_base = t["pair_hist"], t["pair_block_base"]
    recv_hist, recv_block_base = t["recv_hist"], t["recv_block_base"]
    send_hist, send_block_base = t["send_hist"], t["send_block_base"]
    pair_base, seg_rows, seg_mtiles_end = t["pair_base"], t["seg_rows"], t["seg_mtiles_end"]
    chunk_mtiles, group_base, recv_base = t["chunk_mtiles"], t["group_base"], t["recv_base"]
    combine_seg, dispatch_seg, send_base = t["combine_seg"], t["dispatch_seg"], t["send_base"]
    meta, token_dest_mask, expert_offsets = t["meta"], t["token_dest_mask"], t["expert_offsets"]
    gemm1_expected, arrival_expected, combine_expected = (t["gemm1_expected"], t["arrival_expected"],
                                                          t["combine_expected"])
    gather_rows, combine_token, combine_pos = t["gather_rows"], t["combine_token"], t["combine_pos"]
    combine_weight, send_token, send_slot = t["combine_weight"], t["send_token"], t["send_slot"]
    dispatch_tasks, combine_tasks, gemm_tasks = t["dispatch_tasks"], t["combine_tasks"], t["gemm_tasks"]

    emit_tokens = emit_tokens or _BLOCK_T
    per_block = triton.cdiv(T, emit_tokens)
    task_slots = max(max_dispatch, max_combine, max_mtiles)
    block_c, block_j = min(BLOCK_L, 64), 64
    scan_kernel[(P * NB + NB,)](
        all_ids, all_ids.stride(0), chunks, tokens, tokens.stride(0), q, pair_hist, pair_counts, recv_local,
        recv_hist, arrival, send_local, send_hist, key_counts, token_dest_mask, rank, P, T, L, NB, K=K, KP=KP,
        MC=MC, BT=BT, SUB=step, BLOCK_L=BLOCK_L, BLOCK_P=BLOCK_P, WAIT=_WAIT_OF[previous_writes], **sync.LAUNCH)
    bases_kernel[(1 + P * triton.cdiv(L, block_c) + 1,)](
        pair_counts, arrival, key_counts, tokens, tokens.stride(0), pair_base, seg_rows, seg_mtiles_end,
        expert_offsets, chunk_mtiles, group_base, recv_base, combine_seg, dispatch_seg, send_base, meta,
        gemm1_expected, arrival_expected, combine_expected, pair_hist, pair_block_base, recv_hist,
        recv_block_base, send_hist, send_block_base, rank, P, L, NB, n0, n1, block_m, dispatch_rows, combine_rows,
        reduce_rows,
        MC=MC, BLOCK_L=BLOCK_L, BLOCK_P=BLOCK_P, BLOCK_PMC=BLOCK_PMC, BLOCK_B=64, BLOCK_C=block_c,
        CLEAR_COUNTS=counters is not None, **sync.LAUNCH)
    if beside_emit is not None:
        beside_emit(buffers)
    grid = P * per_block + P * per_block + triton.cdiv(task_slots, block_j)
    emit_kernel[(grid,)](
        all_ids, all_weights, all_ids.stride(0), tokens, tokens.stride(0), chunks, q, recv_local, send_local,
        pair_base, recv_base, send_base, pair_block_base, recv_block_base, send_block_base, seg_rows,
        seg_mtiles_end, group_base, combine_seg, dispatch_seg, meta,
        gather_rows, combine_token, combine_pos, combine_weight, send_token, send_slot, dispatch_tasks,
        combine_tasks, gemm_tasks, meta if serial_plan is None else serial_plan,
        rank, P, T, L, NB, n0, n1, block_m, block_n0, block_n1, dispatch_rows, combine_rows, max_dispatch,
        max_combine, max_pairs, P * per_block, P * per_block, max(num_sms, 1), K=K, KP=KP, MC=MC,
        BLOCK_T=emit_tokens, BT=BT, BLOCK_P=BLOCK_P, BLOCK_PMC=BLOCK_PMC, BLOCK_SEG=_pow2(MC * L), BLOCK_J=block_j,
        BLOCK_N=min(16, _pow2(max(n0, n1))), SERIAL_GROUPED=serial_plan is not None, **sync.LAUNCH)
    return buffers.layout()
