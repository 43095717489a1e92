"""The task tables' third stage: `emit_kernel`, every entry at its position (group base + block base + rank within
the block; kernels/tables.py's module docstring, step 3). Shape legend as there."""

from __future__ import annotations

import triton
import triton.language as tl

from weave_moe.backends.weave.kernels import sync
from weave_moe.backends.weave.kernels.tables_scan import chunk_of

__all__ = ["emit_kernel"]


@triton.jit
def _segment_of(end_ptr, j, S, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr):
    """For task slots j [BLOCK_J]: the segment whose blocks hold j (searchsorted(block_end, j, right=True), clamped
    to S - 1, as layout._segment_blocks), by a binary search over the non-decreasing block ends: log2(BLOCK_S)
    dependent loads (cached in L1) instead of a [BLOCK_J, BLOCK_S] comparison, ~1000 unrolled instructions at 4
    warps and 512 segments (measured neutral in the call on an H200: bench/results/h200-0586e60)."""
    count = tl.zeros([BLOCK_J], dtype=tl.int32)   # ends <= j among the first `count`: grows by halving steps
    for i in tl.static_range(20):
        if (BLOCK_S >> (i + 1)) > 0:
            probe = count + (BLOCK_S >> (i + 1))
            end = tl.load(end_ptr + probe - 1, mask=probe <= S, other=2 ** 30)
            count = tl.where(end <= j, probe, count)
    return tl.minimum(count, S - 1)


@triton.jit
def _token_block(pid, T, BLOCK_T: tl.constexpr):
    """(rank, token indices) of program `pid` of a grid with cdiv(T, BLOCK_T) token blocks per rank."""
    per_rank = tl.cdiv(T, BLOCK_T)
    return pid // per_rank, (pid % per_rank) * BLOCK_T + tl.arange(0, BLOCK_T)


@triton.jit
def _received_ahead(ids_ptr, weights_ptr, ids_stride, tokens_ptr, tokens_stride, chunks_ptr, q_ptr, recv_local_ptr,
                    pid, rank, T, L, K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr):
    """`_emit_received`'s loads of what the routing exchange, the plan and the scan wrote, issued before the kernel
    waits for the bases kernel (`sync.pdl_ahead`): (source s, tokens t of block b, their ids, which pairs have their
    expert here, which tokens have one, their chunk, each pair's rank within the block's pairs of its expert, each
    token's rank within the block's tokens received, the pairs' weights)."""
    jj = tl.arange(0, KP)
    s, t = _token_block(pid, T, BLOCK_T)
    valid = t < tl.load(tokens_ptr + s * tokens_stride)
    element = s.to(tl.int64) * ids_stride + t[:, None] * K + jj[None, :]
    # the ids up to T_max, cut at T_s afterwards (one round of loads with T_s's, not one after it)
    ids = tl.load(ids_ptr + element, mask=(t < T)[:, None] & (jj[None, :] < K), other=-1)
    ids = tl.where(valid[:, None], ids, -1)
    mine = (ids >= rank * L) & (ids < (rank + 1) * L)
    hit = tl.sum(mine.to(tl.int32), axis=1) > 0
    c = chunk_of(t, chunks_ptr, rank, tokens_ptr, tokens_stride, s)
    q_in_block = tl.load(q_ptr + (s * T + t).to(tl.int64)[:, None] * K + jj[None, :], mask=mine, other=0)
    local = tl.load(recv_local_ptr + s * T + t, mask=hit, other=0)
    w = tl.load(weights_ptr + element, mask=mine, other=0.0)
    return s, t, ids, mine, hit, c, q_in_block, local, w


@triton.jit
def _emit_received(s, t, ids, mine, hit, c, q_in_block, local, w, pair_base_ptr, recv_base_ptr, pair_block_base_ptr,
                   recv_block_base_ptr, gather_ptr, combine_token_ptr, combine_pos_ptr, combine_weight_ptr, rank, T, L,
                   NB, max_pairs, K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr, BT: tl.constexpr):
    """Received tokens of source s, block b (`_received_ahead`'s values, then what the bases kernel wrote): their
    combine rows, and their pairs' gather rows."""
    jj = tl.arange(0, KP)
    expert = tl.where(mine, ids - rank * L, 0)
    block = t // BT
    # every load of what the bases kernel wrote first, then the stores (a store waits for its data, and a load
    # behind it in issue order would wait too)
    # q: the pair's rank among its block's pairs of its expert + the pairs of that expert in earlier blocks
    q = q_in_block + tl.load(pair_block_base_ptr + (s * NB + block)[:, None] * L + expert, mask=mine, other=0)
    base = tl.load(pair_base_ptr + (s * L + expert) * MC + c[:, None], mask=mine, other=0)
    slot = local + tl.load(recv_block_base_ptr + s * NB + block, mask=hit, other=0)
    row = tl.load(recv_base_ptr + s * MC + tl.minimum(c, MC - 1), mask=hit, other=0) + slot
    pos = tl.where(mine, base + q, -1)
    # a token that repeats one expert more than E_local times (only possible when k > E_local) can exceed the
    # static bound of pairs; those pairs are dropped (the torch tables drop them too, others), never written
    # past the buffers
    pos = tl.where(pos < max_pairs, pos, -1)
    mine = mine & (pos >= 0)
    tl.store(gather_ptr + pos, (s * T + slot)[:, None] + 0 * pos, mask=mine)
    tl.store(combine_token_ptr + row, t, mask=hit)
    tl.store(combine_pos_ptr + row.to(tl.int64)[:, None] * K + jj[None, :], pos,
             mask=hit[:, None] & (jj[None, :] < K))
    tl.store(combine_weight_ptr + row.to(tl.int64)[:, None] * K + jj[None, :], tl.where(mine, w, 0.0),
             mask=hit[:, None] & (jj[None, :] < K))


@triton.jit
def _sent_ahead(ids_ptr, ids_stride, tokens_ptr, tokens_stride, send_local_ptr, q_pid, rank, T, L, K: tl.constexpr,
                KP: tl.constexpr, BLOCK_T: tl.constexpr):
    """`_emit_sent`'s loads of what the routing exchange and the scan wrote, before the kernel's wait
    (`sync.pdl_ahead`): (destination d, this rank's tokens t of block b, which go to d, their rank within the
    block's tokens sent to d)."""
    jj = tl.arange(0, KP)
    d, t = _token_block(q_pid, T, BLOCK_T)
    valid = t < tl.load(tokens_ptr + rank * tokens_stride)
    ids = tl.load(ids_ptr + rank.to(tl.int64) * ids_stride + t[:, None] * K + jj[None, :],
                  mask=(t < T)[:, None] & (jj[None, :] < K), other=-1)   # cut at T afterwards, as above
    ids = tl.where(valid[:, None], ids, -1)
    owner = tl.where(ids >= 0, ids // L, -1)
    hit = tl.sum((owner == d).to(tl.int32), axis=1) > 0
    local = tl.load(send_local_ptr + d * T + t, mask=hit, other=0)
    return d, t, hit, local


@triton.jit
def _emit_sent(d, t, hit, local, send_block_base_ptr, send_base_ptr, send_token_ptr, send_out_ptr, NB,
               BT: tl.constexpr):
    """This rank's tokens to destination d, block b (`_sent_ahead`'s values, then what the bases kernel wrote): the
    rows it sends."""
    slot = local + tl.load(send_block_base_ptr + d * NB + t // BT, mask=hit, other=0)
    index = tl.load(send_base_ptr + d) + slot
    tl.store(send_token_ptr + index, t, mask=hit)
    tl.store(send_out_ptr + index, slot, mask=hit)


@triton.jit
def _emit_blocks(seg_ptr, S, num, block_rows, tasks_ptr, max_tasks, j, DIV, MINOR_FIRST: tl.constexpr,
                 BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr):
    """Task slots j of a table of row blocks (layout._segment_blocks): segments described at `seg_ptr` as
    [block end | first row | rows] (BLOCK_S words each), `num` blocks in all. Row j = (seg // DIV, seg % DIV, start,
    count), the first two swapped when MINOR_FIRST; slots past `num` are zero."""
    seg = _segment_of(seg_ptr, j, S, BLOCK_J, BLOCK_S)
    within = j - tl.load(seg_ptr + seg - 1, mask=seg > 0, other=0)
    first = tl.load(seg_ptr + BLOCK_S + seg)
    rows = tl.load(seg_ptr + 2 * BLOCK_S + seg)
    real = j < num
    major = seg // DIV
    minor = seg % DIV
    start = first + within * block_rows
    count = tl.minimum(tl.maximum(rows - within * block_rows, 0), block_rows)
    # the row's 4 words stored whole (one vector store per row, as the GEMM task rows)
    f = tl.arange(0, 4)[None, :]
    fields = tl.where(f == 0, (minor if MINOR_FIRST else major)[:, None], tl.where(
        f == 1, (major if MINOR_FIRST else minor)[:, None], tl.where(f == 2, start[:, None], count[:, None])))
    tl.store(tasks_ptr + j.to(tl.int64)[:, None] * 4 + f, tl.where(real[:, None], fields, 0),
             mask=(j < max_tasks)[:, None])


@triton.jit
def _emit_tasks(seg_rows_ptr, seg_mtiles_end_ptr, group_base_ptr, combine_seg_ptr,
                dispatch_seg_ptr, meta_ptr, dispatch_tasks_ptr, combine_tasks_ptr, gemm_tasks_ptr, plan_ptr, num_sms,
                block_index, P, L, n0, n1, block_m, block_n0, block_n1, dispatch_rows, combine_rows, max_dispatch,
                max_combine, max_pairs, MC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_PMC: tl.constexpr,
                BLOCK_SEG: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, SERIAL_GROUPED: tl.constexpr):
    # task rows: slots j of the dispatch, combine and M-tile tables
    j = block_index * BLOCK_J + tl.arange(0, BLOCK_J)
    PMC = P * MC
    # dispatch blocks: segments (dest, chunk) -> rows (dest, chunk, start, count)
    _emit_blocks(dispatch_seg_ptr, PMC, tl.load(meta_ptr + 0), dispatch_rows, dispatch_tasks_ptr, max_dispatch, j, MC,
                 False, BLOCK_J, BLOCK_PMC)
    # combine blocks: segments (chunk, source) -> rows (source, chunk, start, count)
    _emit_blocks(combine_seg_ptr, BLOCK_PMC, tl.load(meta_ptr + 2), combine_rows, combine_tasks_ptr, max_combine, j,
                 BLOCK_P, True, BLOCK_J, BLOCK_PMC)
    # M tiles -> GEMM0 and GEMM1 task rows in DAG order; none under a serial plan (c >= num_sms) of a layer that runs
    # serial plans through the grouped GEMMs (SERIAL_GROUPED: they read their own tile tables, grouped_tiles)
    if SERIAL_GROUPED:
        if tl.load(plan_ptr) < num_sms:
            _emit_gemm_tasks(seg_rows_ptr, seg_mtiles_end_ptr, group_base_ptr, meta_ptr, gemm_tasks_ptr, block_index,
                             L, n0, n1, block_m, block_n0, block_n1, max_pairs, MC, BLOCK_SEG, BLOCK_J, BLOCK_N)
    else:
        _emit_gemm_tasks(seg_rows_ptr, seg_mtiles_end_ptr, group_base_ptr, meta_ptr, gemm_tasks_ptr, block_index, L,
                         n0, n1, block_m, block_n0, block_n1, max_pairs, MC, BLOCK_SEG, BLOCK_J, BLOCK_N)


@triton.jit
def _emit_gemm_tasks(seg_rows_ptr, seg_mtiles_end_ptr, group_base_ptr, meta_ptr, gemm_tasks_ptr, block_index, L, n0,
                     n1, block_m, block_n0, block_n1, max_pairs, MC: tl.constexpr, BLOCK_SEG: tl.constexpr,
                     BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr):
    """Task slots [block_index * BLOCK_J, +BLOCK_J) of the GEMM task table: M tiles -> GEMM0 and GEMM1 rows."""
    j = block_index * BLOCK_J + tl.arange(0, BLOCK_J)
    num_mtiles = tl.load(meta_ptr + 4)
    S = MC * L
    mseg = _segment_of(seg_mtiles_end_ptr, j, S, BLOCK_J, BLOCK_SEG)
    prev_end = tl.load(seg_mtiles_end_ptr + mseg - 1, mask=mseg > 0, other=0)
    within = j - prev_end
    seg_rows_j = tl.load(seg_rows_ptr + mseg)
    seg_begin = tl.load(seg_rows_ptr + S + mseg)
    m_start = seg_begin + within * block_m
    m_rows = tl.minimum(tl.maximum(seg_rows_j - within * block_m, 0), block_m)
    m_rows = tl.minimum(m_rows, tl.maximum(max_pairs - m_start, 0))   # see max_pairs above
    m_chunk = mseg // L
    m_expert = mseg % L
    first_of_chunk = tl.load(seg_mtiles_end_ptr + m_chunk * L - 1, mask=m_chunk > 0, other=0)
    is_tile = (j < num_mtiles)[:, None]
    # a task row is 8 consecutive words, stored whole (a thread's words are neighbours: vector stores, where one
    # store per field writes 4 bytes every 32); BLOCK_N N tiles at a time keep the [BLOCK_J, BLOCK_N, 8] rows small
    f = tl.arange(0, 8)[None, None, :]
    nc = tl.arange(0, BLOCK_N)
    for kind in tl.static_range(2):
        num_n = n0 if kind == 0 else n1
        block_n = block_n0 if kind == 0 else block_n1
        first = tl.load(group_base_ptr + kind * MC + m_chunk) + (j - first_of_chunk) * num_n   # the tile's N = 0 task
        fields = tl.where(f == 0, kind, tl.where(f == 1, m_chunk[:, None, None], tl.where(
            f == 2, m_expert[:, None, None], tl.where(f == 3, m_start[:, None, None], tl.where(
                f == 4, m_rows[:, None, None], tl.where(f == 6, j[:, None, None], 0))))))   # [BLOCK_J, 1, 8]
        for n_first in range(0, num_n, BLOCK_N):
            nn = n_first + nc
            ok = is_tile & (nn[None, :] < num_n)
            row = tl.where(f == 5, nn[None, :, None] * block_n, fields)
            index = (first[:, None] + nn[None, :]).to(tl.int64)
            tl.store(gemm_tasks_ptr + index[:, :, None] * 8 + f, row, mask=ok[:, :, None])


@triton.jit(do_not_specialize=["rank"])
def emit_kernel(ids_ptr, weights_ptr, ids_stride, tokens_ptr, tokens_stride, chunks_ptr, q_ptr, recv_local_ptr,
                send_local_ptr, pair_base_ptr, recv_base_ptr, send_base_ptr, pair_block_base_ptr,
                recv_block_base_ptr, send_block_base_ptr, seg_rows_ptr, seg_mtiles_end_ptr,
                group_base_ptr, combine_seg_ptr, dispatch_seg_ptr, meta_ptr,
                gather_ptr, combine_token_ptr, combine_pos_ptr, combine_weight_ptr, send_token_ptr, send_out_ptr,
                dispatch_tasks_ptr, combine_tasks_ptr, gemm_tasks_ptr, plan_ptr,
                rank, P, T, L: tl.constexpr, NB, n0, n1, block_m, block_n0, block_n1, dispatch_rows, combine_rows,
                max_dispatch, max_combine, max_pairs, recv_programs, send_programs, num_sms,
                K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr, BLOCK_T: tl.constexpr, BT: tl.constexpr,
                BLOCK_P: tl.constexpr, BLOCK_PMC: tl.constexpr, BLOCK_SEG: tl.constexpr, BLOCK_J: tl.constexpr,
                BLOCK_N: tl.constexpr, SERIAL_GROUPED: tl.constexpr):
    sync.pdl_ahead()
    pid = tl.program_id(0)
    # each program loads what the exchange, the plan and the scan wrote before it waits for the bases kernel, whose
    # CTAs release only after their own wait (sync.pdl_ahead): ids -> q, the ranks within blocks are off the chain
    if pid < recv_programs:
        s, t, ids, mine, hit, c, q_in_block, local, w = _received_ahead(
            ids_ptr, weights_ptr, ids_stride, tokens_ptr, tokens_stride, chunks_ptr, q_ptr, recv_local_ptr, pid, rank,
            T, L, K, KP, BLOCK_T)
        sync.pdl_enter()
        _emit_received(s, t, ids, mine, hit, c, q_in_block, local, w, pair_base_ptr, recv_base_ptr,
                       pair_block_base_ptr, recv_block_base_ptr, gather_ptr, combine_token_ptr, combine_pos_ptr,
                       combine_weight_ptr, rank, T, L, NB, max_pairs, K, KP, MC, BT)
    elif pid < recv_programs + send_programs:
        d, t, hit, local = _sent_ahead(ids_ptr, ids_stride, tokens_ptr, tokens_stride, send_local_ptr,
                                       pid - recv_programs, rank, T, L, K, KP, BLOCK_T)
        sync.pdl_enter()
        _emit_sent(d, t, hit, local, send_block_base_ptr, send_base_ptr, send_token_ptr, send_out_ptr, NB, BT)
    else:
        sync.pdl_enter()
        _emit_tasks(seg_rows_ptr, seg_mtiles_end_ptr, group_base_ptr, combine_seg_ptr,
                    dispatch_seg_ptr, meta_ptr, dispatch_tasks_ptr, combine_tasks_ptr, gemm_tasks_ptr, plan_ptr,
                    num_sms, pid - recv_programs - send_programs, P, L, n0, n1, block_m, block_n0, block_n1,
                    dispatch_rows, combine_rows, max_dispatch, max_combine, max_pairs, MC, BLOCK_P, BLOCK_PMC,
                    BLOCK_SEG, BLOCK_J, BLOCK_N, SERIAL_GROUPED)
