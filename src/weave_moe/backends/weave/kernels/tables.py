"""The task tables of `layout.build_layout` as three Triton kernels instead of a chain of ~40 torch kernels.

Same inputs, same `layout.Layout`, the same values in every entry the megakernel reads (the first `meta` entries of each
task table, the first rows of each list; tests/test_tables.py checks them bitwise against `build_layout` under the
interpreter). Entries past those counts are not written (the torch tables hold other, equally unread, values); the
dispatch and combine task tables are zero there.

The tables are counting sorts. Every order `build_layout` sorts into is monotone in the token index within a group,
because a chunk is a monotone function of the token (chunk(t) = t * K // T_s). So an entry's position is

    (entries of earlier groups) + (entries of its group before it) = base[group] + running count along the tokens,

with groups (destination, chunk) for the rows this rank sends, (chunk, source) for the tokens it receives, and
(chunk, local expert, source) for its (token, expert) pairs (ties within a token by top-k slot, as the stable sort of
`build_layout` orders them). Shape legend as in layout.py: P ranks, T = T_max, k top-k, L local experts, MC chunks.

    1. `_scan_kernel`, P * L + 2 * P programs, each one scan along the tokens of one source:
         (source s, expert e):  running count of s's pairs on local expert e (q), pairs per chunk of this rank
         (source s):            slot of each token of s that has an expert here (its row in recv), rows per chunk
         (destination d):       slot of each of this rank's tokens that goes to d, rows per chunk of d; program 0
                                also writes every token's destination bit mask
    2. `_bases_kernel`, one program: exclusive prefix sums of those counts (the group bases), the expert offsets, the
       M tiles per chunk, the offsets of the GEMM task groups in DAG order, `meta`.
    3. `_emit_kernel`, many programs: every entry at its position: the pairs' gather rows, the received tokens'
       combine rows (their pair positions and weights), the rows this rank sends, and the task rows (dispatch blocks,
       combine blocks, M tiles -> GEMM0 / GEMM1 tasks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weave_moe.backends.weave.layout import Layout
from weave_moe.plan.workload import MAX_CHUNKS

__all__ = ["build_layout_triton"]

_BLOCK = 1024          # flat (token, slot) elements per scan step
_BLOCK_T = 256         # tokens per scan / emit step


@triton.jit
def _chunk_of(t, chunks_ptr, d, tokens_ptr, tokens_stride, s):
    """chunk(t) = t * K_d // max(T_s, 1), as layout.py computes it."""
    K = tl.load(chunks_ptr + d * 4)   # chunks are column 1 of the [P, 4] plans: stride 4 (host checks)
    Ts = tl.maximum(tl.load(tokens_ptr + s * tokens_stride), 1)
    return (t * K) // Ts


@triton.jit
def _scan_pairs(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, q_ptr, pair_counts_ptr, s, local,
                rank, T, L, K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr, BLOCK: tl.constexpr):
    """(source s, local expert): q = running count of s's pairs on that expert in (token, slot) order; pairs per
    chunk of this rank."""
    mc = tl.arange(0, MC)
    expert = rank * L + local
    n_tok = tl.load(tokens_ptr + s * tokens_stride)
    counts = tl.zeros([MC], dtype=tl.int32)
    running = 0
    offs = tl.arange(0, BLOCK)
    for start in range(0, n_tok * KP, BLOCK):
        flat = start + offs
        t = flat // KP
        j = flat % KP
        valid = (t < n_tok) & (j < K)
        ids = tl.load(ids_ptr + s.to(tl.int64) * ids_stride + t * K + j, mask=valid, other=-1)
        hit = (ids == expert).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit
        tl.store(q_ptr + (s * T + t).to(tl.int64) * K + j, running + before, mask=hit != 0)
        running += tl.sum(hit, axis=0)
        c = _chunk_of(t, chunks_ptr, rank, tokens_ptr, tokens_stride, s)
        counts += tl.sum(((c[:, None] == mc[None, :]) & (hit[:, None] != 0)).to(tl.int32), axis=0)
    tl.store(pair_counts_ptr + (s * L + local) * MC + mc, counts)


@triton.jit
def _scan_received(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, recv_slot_ptr, arrival_ptr, s, rank,
                   T, L, K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr, BLOCK_T: tl.constexpr):
    """(source s): which of s's tokens have an expert on this rank, their slot in s's rows for this rank, rows per
    chunk."""
    mc = tl.arange(0, MC)
    n_tok = tl.load(tokens_ptr + s * tokens_stride)
    counts = tl.zeros([MC], dtype=tl.int32)
    running = 0
    offs = tl.arange(0, BLOCK_T)
    jj = tl.arange(0, KP)
    for start in range(0, n_tok, BLOCK_T):
        t = start + offs
        valid = t < n_tok
        ids = tl.load(ids_ptr + s.to(tl.int64) * ids_stride + t[:, None] * K + jj[None, :],
                      mask=valid[:, None] & (jj[None, :] < K), other=-1)
        mine = (ids >= rank * L) & (ids < (rank + 1) * L)
        hit = (tl.sum(mine.to(tl.int32), axis=1) > 0).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit
        tl.store(recv_slot_ptr + s * T + t, running + before, mask=hit != 0)
        running += tl.sum(hit, axis=0)
        c = tl.minimum(_chunk_of(t, chunks_ptr, rank, tokens_ptr, tokens_stride, s), MC - 1)
        counts += tl.sum(((c[:, None] == mc[None, :]) & (hit[:, None] != 0)).to(tl.int32), axis=0)
    tl.store(arrival_ptr + s * MC + mc, counts)


@triton.jit
def _scan_sent(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, send_slot_ptr, key_counts_ptr,
               send_counts_ptr, mask_ptr, d, rank, T, L, K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
    """(destination d): which of this rank's tokens go to d, their slot in d's rows from this rank, rows per chunk of
    d; d = 0 also writes every token slot's destination bit mask (zeros past this rank's tokens)."""
    mc = tl.arange(0, MC)
    n_tok = tl.load(tokens_ptr + rank * tokens_stride)
    counts = tl.zeros([MC], dtype=tl.int32)
    running = 0
    offs = tl.arange(0, BLOCK_T)
    jj = tl.arange(0, KP)
    pp = tl.arange(0, BLOCK_P)
    end = tl.where(d == 0, T, n_tok)
    for start in range(0, end, BLOCK_T):
        t = start + offs
        valid = t < n_tok
        ids = tl.load(ids_ptr + rank.to(tl.int64) * ids_stride + t[:, None] * K + jj[None, :],
                      mask=valid[:, None] & (jj[None, :] < K), other=-1)
        owner = tl.where(ids >= 0, ids // L, -1)
        hit = (tl.sum((owner == d).to(tl.int32), axis=1) > 0).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit
        tl.store(send_slot_ptr + d * T + t, running + before, mask=hit != 0)
        running += tl.sum(hit, axis=0)
        c = _chunk_of(t, chunks_ptr, d, tokens_ptr, tokens_stride, rank)
        counts += tl.sum(((c[:, None] == mc[None, :]) & (hit[:, None] != 0)).to(tl.int32), axis=0)
        if d == 0:
            goes = tl.sum(((owner[:, :, None] == pp[None, None, :]).to(tl.int32)), axis=1) > 0   # [BLOCK_T, P]
            bits = tl.sum(tl.where(goes, 1 << pp[None, :], 0), axis=1)
            tl.store(mask_ptr + t, bits, mask=t < T)
    tl.store(key_counts_ptr + d * MC + mc, counts)
    tl.store(send_counts_ptr + d, running)


@triton.jit
def _scan_kernel(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, q_ptr, pair_counts_ptr, recv_slot_ptr,
                 arrival_ptr, send_slot_ptr, key_counts_ptr, send_counts_ptr, mask_ptr, rank, P, T, L,
                 K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    if pid < P * L:
        _scan_pairs(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, q_ptr, pair_counts_ptr, pid // L,
                    pid % L, rank, T, L, K, KP, MC, BLOCK)
    elif pid < P * L + P:
        _scan_received(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, recv_slot_ptr, arrival_ptr,
                       pid - P * L, rank, T, L, K, KP, MC, BLOCK_T)
    else:
        _scan_sent(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, send_slot_ptr, key_counts_ptr,
                   send_counts_ptr, mask_ptr, pid - P * L - P, rank, T, L, K, KP, MC, BLOCK_T, BLOCK_P)


@triton.jit
def _exclusive(x):
    return tl.cumsum(x, axis=0) - x


@triton.jit
def _bases_kernel(pair_counts_ptr, arrival_ptr, key_counts_ptr, send_counts_ptr, tokens_ptr, tokens_stride,
                  pair_base_ptr, seg_rows_ptr, seg_mtiles_end_ptr, expert_offsets_ptr, chunk_mtiles_ptr,
                  group_base_ptr, recv_base_ptr, combine_seg_ptr, dispatch_seg_ptr, send_base_ptr, meta_ptr,
                  gemm1_expected_ptr, arrival_out_ptr, combine_expected_ptr,
                  rank, P, L, n0, n1, block_m, dispatch_rows, combine_rows, reduce_rows,
                  MC: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_LP: tl.constexpr,
                  BLOCK_PMC: tl.constexpr):
    # -- pairs: groups (chunk, expert, source) in that order; pair_base[s, e, c] = base of the group minus the pairs
    #    of (s, e) in earlier chunks, so a pair's position is pair_base + its running count q
    flat = tl.arange(0, BLOCK_LP)
    e = flat // BLOCK_P
    s = flat % BLOCK_P
    ok = (e < L) & (s < P)
    running = 0
    earlier = tl.zeros([BLOCK_LP], dtype=tl.int32)       # pairs of (s, e) in chunks before c
    le = tl.arange(0, BLOCK_L)
    mtiles_running = 0
    expert_running = 0
    for c in range(0, MC):
        n = tl.load(pair_counts_ptr + (s * L + e) * MC + c, mask=ok, other=0)
        base = running + _exclusive(n)
        tl.store(pair_base_ptr + (s * L + e) * MC + c, base - earlier, mask=ok)
        earlier += n
        running += tl.sum(n, axis=0)
        # rows of segment (c, e) and its M tiles
        rows = tl.sum(tl.where(e[:, None] == le[None, :], n[:, None], 0), axis=0)          # [BLOCK_L]
        tiles = (rows + block_m - 1) // block_m
        tl.store(seg_rows_ptr + c * L + le, rows, mask=le < L)
        tl.store(seg_mtiles_end_ptr + c * L + le, mtiles_running + tl.cumsum(tiles, axis=0), mask=le < L)
        chunk_tiles = tl.sum(tl.where(le < L, tiles, 0), axis=0)
        tl.store(chunk_mtiles_ptr + c, chunk_tiles)
        tl.store(gemm1_expected_ptr + c, chunk_tiles * n1)
        mtiles_running += chunk_tiles
        if c == 0:
            tl.store(expert_offsets_ptr + le + 1, tl.cumsum(rows, axis=0), mask=le < L)
            tl.store(expert_offsets_ptr, 0)
    num_mtiles = mtiles_running
    # -- GEMM task groups in DAG order: GEMM0 of chunk c has rank 2c, GEMM1 of chunk c rank 2c + 3
    g = tl.arange(0, 2 * MC)
    g_chunk = g % MC
    g_kind = g // MC
    g_rank = 2 * g_chunk + 3 * g_kind
    g_tiles = tl.load(chunk_mtiles_ptr + g_chunk)
    g_size = g_tiles * tl.where(g_kind == 0, n0, n1)
    before_g = tl.sum(tl.where(g_rank[None, :] < g_rank[:, None], g_size[None, :], 0), axis=1)
    tl.store(group_base_ptr + g, before_g)
    # -- received tokens: groups (chunk, source); recv_base[s, c] = base of the group minus s's rows in earlier chunks
    f = tl.arange(0, BLOCK_PMC)
    fc = f // BLOCK_P
    fs = f % BLOCK_P
    fok = (fc < MC) & (fs < P)
    arrivals = tl.load(arrival_ptr + fs * MC + fc, mask=fok, other=0)        # order (chunk, source)
    group_begin = _exclusive(arrivals)
    earlier_s = tl.sum(tl.where((fs[None, :] == fs[:, None]) & (fc[None, :] < fc[:, None]), arrivals[None, :], 0),
                       axis=1)
    tl.store(recv_base_ptr + fs * MC + fc, group_begin - earlier_s, mask=fok)
    tl.store(arrival_out_ptr + fs * MC + fc, arrivals, mask=fok)
    blocks = (arrivals + combine_rows - 1) // combine_rows
    # per segment (padding segments are empty, so the block ends stay a non-decreasing sequence): block end, first
    # row, rows
    tl.store(combine_seg_ptr + f, tl.cumsum(blocks, axis=0))
    tl.store(combine_seg_ptr + BLOCK_PMC + f, group_begin)
    tl.store(combine_seg_ptr + 2 * BLOCK_PMC + f, arrivals)
    num_combine = tl.sum(blocks, axis=0)
    # -- rows this rank sends: groups (destination, chunk)
    gd = f // MC
    gc = f % MC
    gok = gd < P
    keys = tl.load(key_counts_ptr + gd * MC + gc, mask=gok, other=0)                     # order (dest, chunk)
    dblocks = (keys + dispatch_rows - 1) // dispatch_rows
    tl.store(dispatch_seg_ptr + f, tl.cumsum(dblocks, axis=0))
    tl.store(dispatch_seg_ptr + BLOCK_PMC + f, _exclusive(keys))
    tl.store(dispatch_seg_ptr + 2 * BLOCK_PMC + f, keys)
    num_dispatch = tl.sum(dblocks, axis=0)
    pp = tl.arange(0, BLOCK_P)
    sent = tl.load(send_counts_ptr + pp, mask=pp < P, other=0)
    tl.store(send_base_ptr + pp, _exclusive(sent), mask=pp < P)
    tl.store(combine_expected_ptr + pp, sent, mask=pp < P)
    num_reduce = (tl.load(tokens_ptr + rank * tokens_stride) + reduce_rows - 1) // reduce_rows
    tl.store(meta_ptr + 0, num_dispatch)
    tl.store(meta_ptr + 1, num_mtiles * (n0 + n1))
    tl.store(meta_ptr + 2, num_combine)
    tl.store(meta_ptr + 3, num_reduce)
    tl.store(meta_ptr + 4, num_mtiles)


@triton.jit
def _segment_of(end_ptr, j, S, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr):
    """For task slots j [BLOCK_J]: the segment whose blocks hold j (searchsorted(block_end, j, right=True), clamped
    to S - 1, as layout._segment_blocks)."""
    ss = tl.arange(0, BLOCK_S)
    ends = tl.load(end_ptr + ss, mask=ss < S, other=2 ** 30)
    seg = tl.sum((ends[None, :] <= j[:, None]).to(tl.int32), axis=1)
    return tl.minimum(seg, S - 1)


@triton.jit
def _emit_received(ids_ptr, weights_ptr, ids_stride, tokens_ptr, tokens_stride, chunks_ptr, q_ptr, recv_slot_ptr,
                   pair_base_ptr, recv_base_ptr, gather_ptr, combine_token_ptr, combine_pos_ptr, combine_weight_ptr,
                   pid, rank, T, L, max_pairs, K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr,
                   BLOCK_T: tl.constexpr):
    offs = tl.arange(0, BLOCK_T)
    jj = tl.arange(0, KP)
    # received tokens of source s, block b: their combine rows, and their pairs' gather rows
    per_source = tl.cdiv(T, BLOCK_T)
    s = pid // per_source
    t = (pid % per_source) * BLOCK_T + offs
    n_tok = tl.load(tokens_ptr + s * tokens_stride)
    valid = t < n_tok
    element = s.to(tl.int64) * ids_stride + t[:, None] * K + jj[None, :]
    emask = valid[:, None] & (jj[None, :] < K)
    ids = tl.load(ids_ptr + element, mask=emask, other=-1)
    mine = (ids >= rank * L) & (ids < (rank + 1) * L)
    hit = tl.sum(mine.to(tl.int32), axis=1) > 0
    c = _chunk_of(t, chunks_ptr, rank, tokens_ptr, tokens_stride, s)
    expert = tl.where(mine, ids - rank * L, 0)
    q = tl.load(q_ptr + (s * T + t).to(tl.int64)[:, None] * K + jj[None, :], mask=mine, other=0)
    base = tl.load(pair_base_ptr + (s * L + expert) * MC + c[:, None], mask=mine, other=0)
    pos = tl.where(mine, base + q, -1)
    # a token that repeats one expert more than E_local times (only possible when k > E_local) can exceed the
    # static bound of pairs; those pairs are dropped (the torch tables drop them too, others), never written
    # past the buffers
    pos = tl.where(pos < max_pairs, pos, -1)
    mine = mine & (pos >= 0)
    slot = tl.load(recv_slot_ptr + s * T + t, mask=hit, other=0)
    tl.store(gather_ptr + pos, (s * T + slot)[:, None] + 0 * pos, mask=mine)
    cc = tl.minimum(c, MC - 1)
    row = tl.load(recv_base_ptr + s * MC + cc, mask=hit, other=0) + slot
    tl.store(combine_token_ptr + row, t, mask=hit)
    tl.store(combine_pos_ptr + row.to(tl.int64)[:, None] * K + jj[None, :], pos,
             mask=hit[:, None] & (jj[None, :] < K))
    w = tl.load(weights_ptr + element, mask=mine, other=0.0)
    tl.store(combine_weight_ptr + row.to(tl.int64)[:, None] * K + jj[None, :], tl.where(mine, w, 0.0),
             mask=hit[:, None] & (jj[None, :] < K))


@triton.jit
def _emit_sent(ids_ptr, ids_stride, tokens_ptr, tokens_stride, send_slot_ptr, send_base_ptr, send_token_ptr,
               send_out_ptr, q_pid, rank, T, L, K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr):
    offs = tl.arange(0, BLOCK_T)
    jj = tl.arange(0, KP)
    # this rank's tokens to destination d, block b: the rows it sends
    per_dest = tl.cdiv(T, BLOCK_T)
    d = q_pid // per_dest
    t = (q_pid % per_dest) * BLOCK_T + offs
    n_tok = tl.load(tokens_ptr + rank * tokens_stride)
    valid = t < n_tok
    ids = tl.load(ids_ptr + rank.to(tl.int64) * ids_stride + t[:, None] * K + jj[None, :],
                  mask=valid[:, None] & (jj[None, :] < K), other=-1)
    owner = tl.where(ids >= 0, ids // L, -1)
    hit = tl.sum((owner == d).to(tl.int32), axis=1) > 0
    slot = tl.load(send_slot_ptr + d * T + t, mask=hit, other=0)
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
    row = tasks_ptr + j.to(tl.int64) * 4
    live = j < max_tasks
    tl.store(row + 0, tl.where(real, minor if MINOR_FIRST else major, 0), mask=live)
    tl.store(row + 1, tl.where(real, major if MINOR_FIRST else minor, 0), mask=live)
    tl.store(row + 2, tl.where(real, first + within * block_rows, 0), mask=live)
    tl.store(row + 3, tl.where(real, tl.minimum(tl.maximum(rows - within * block_rows, 0), block_rows), 0), mask=live)


@triton.jit
def _emit_tasks(seg_rows_ptr, seg_mtiles_end_ptr, group_base_ptr, combine_seg_ptr,
                dispatch_seg_ptr, meta_ptr, dispatch_tasks_ptr, combine_tasks_ptr, gemm_tasks_ptr, block_index, P, L,
                n0, n1, block_m, block_n0, block_n1, dispatch_rows, combine_rows, max_dispatch, max_combine,
                max_pairs, MC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_PMC: tl.constexpr,
                BLOCK_SEG: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr):
    # task rows: slots j of the dispatch, combine and M-tile tables
    j = block_index * BLOCK_J + tl.arange(0, BLOCK_J)
    PMC = P * MC
    # dispatch blocks: segments (dest, chunk) -> rows (dest, chunk, start, count)
    _emit_blocks(dispatch_seg_ptr, PMC, tl.load(meta_ptr + 0), dispatch_rows, dispatch_tasks_ptr, max_dispatch, j, MC,
                 False, BLOCK_J, BLOCK_PMC)
    # combine blocks: segments (chunk, source) -> rows (source, chunk, start, count)
    _emit_blocks(combine_seg_ptr, BLOCK_PMC, tl.load(meta_ptr + 2), combine_rows, combine_tasks_ptr, max_combine, j,
                 BLOCK_P, True, BLOCK_J, BLOCK_PMC)
    # M tiles -> GEMM0 and GEMM1 task rows in DAG order
    num_mtiles = tl.load(meta_ptr + 4)
    S = MC * L
    mseg = _segment_of(seg_mtiles_end_ptr, j, S, BLOCK_J, BLOCK_SEG)
    prev_end = tl.load(seg_mtiles_end_ptr + mseg - 1, mask=mseg > 0, other=0)
    within = j - prev_end
    seg_rows_j = tl.load(seg_rows_ptr + mseg)
    ss = tl.arange(0, BLOCK_SEG)
    all_rows = tl.load(seg_rows_ptr + ss, mask=ss < S, other=0)
    seg_begin = tl.sum(tl.where(ss[None, :] < mseg[:, None], all_rows[None, :], 0), axis=1)
    m_start = seg_begin + within * block_m
    m_rows = tl.minimum(tl.maximum(seg_rows_j - within * block_m, 0), block_m)
    m_rows = tl.minimum(m_rows, tl.maximum(max_pairs - m_start, 0))   # see max_pairs above
    m_chunk = mseg // L
    m_expert = mseg % L
    first_of_chunk = tl.load(seg_mtiles_end_ptr + m_chunk * L - 1, mask=m_chunk > 0, other=0)
    nn = tl.arange(0, BLOCK_N)
    is_tile = (j < num_mtiles)[:, None]
    for kind in tl.static_range(2):
        num_n = n0 if kind == 0 else n1
        block_n = block_n0 if kind == 0 else block_n1
        base = tl.load(group_base_ptr + kind * MC + m_chunk)
        index = base[:, None] + (j - first_of_chunk)[:, None] * num_n + nn[None, :]
        ok = is_tile & (nn[None, :] < num_n)
        task = gemm_tasks_ptr + index.to(tl.int64) * 8
        tl.store(task + 0, tl.full([BLOCK_J, BLOCK_N], kind, tl.int32), mask=ok)
        tl.store(task + 1, m_chunk[:, None] + 0 * nn[None, :], mask=ok)
        tl.store(task + 2, m_expert[:, None] + 0 * nn[None, :], mask=ok)
        tl.store(task + 3, m_start[:, None] + 0 * nn[None, :], mask=ok)
        tl.store(task + 4, m_rows[:, None] + 0 * nn[None, :], mask=ok)
        tl.store(task + 5, nn[None, :] * block_n + 0 * j[:, None], mask=ok)
        tl.store(task + 6, j[:, None] + 0 * nn[None, :], mask=ok)
        tl.store(task + 7, tl.zeros([BLOCK_J, BLOCK_N], dtype=tl.int32), mask=ok)


@triton.jit
def _emit_kernel(ids_ptr, weights_ptr, ids_stride, tokens_ptr, tokens_stride, chunks_ptr, q_ptr, recv_slot_ptr,
                 send_slot_ptr, pair_base_ptr, recv_base_ptr, send_base_ptr, seg_rows_ptr, seg_mtiles_end_ptr,
                 group_base_ptr, combine_seg_ptr, dispatch_seg_ptr, meta_ptr,
                 gather_ptr, combine_token_ptr, combine_pos_ptr, combine_weight_ptr, send_token_ptr, send_out_ptr,
                 dispatch_tasks_ptr, combine_tasks_ptr, gemm_tasks_ptr,
                 rank, P, T, L, n0, n1, block_m, block_n0, block_n1, dispatch_rows, combine_rows,
                 max_dispatch, max_combine, max_pairs, recv_programs, send_programs,
                 K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_PMC: tl.constexpr, BLOCK_SEG: tl.constexpr, BLOCK_J: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    if pid < recv_programs:
        _emit_received(ids_ptr, weights_ptr, ids_stride, tokens_ptr, tokens_stride, chunks_ptr, q_ptr, recv_slot_ptr,
                       pair_base_ptr, recv_base_ptr, gather_ptr, combine_token_ptr, combine_pos_ptr,
                       combine_weight_ptr, pid, rank, T, L, max_pairs, K, KP, MC, BLOCK_T)
    elif pid < recv_programs + send_programs:
        _emit_sent(ids_ptr, ids_stride, tokens_ptr, tokens_stride, send_slot_ptr, send_base_ptr, send_token_ptr,
                   send_out_ptr, pid - recv_programs, rank, T, L, K, KP, BLOCK_T)
    else:
        _emit_tasks(seg_rows_ptr, seg_mtiles_end_ptr, group_base_ptr, combine_seg_ptr,
                    dispatch_seg_ptr, meta_ptr, dispatch_tasks_ptr, combine_tasks_ptr, gemm_tasks_ptr,
                    pid - recv_programs - send_programs, P, L, n0, n1, block_m, block_n0, block_n1, dispatch_rows,
                    combine_rows, max_dispatch, max_combine, max_pairs, MC, BLOCK_P, BLOCK_PMC, BLOCK_SEG, BLOCK_J,
                    BLOCK_N)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def build_layout_triton(all_ids: torch.Tensor, all_weights: torch.Tensor, tokens: torch.Tensor,
                        chunks: torch.Tensor, rank: int, num_experts: int, *, hidden_size: int,
                        intermediate_size: int, block_m: int, block_n0: int, block_n1: int, dispatch_rows: int,
                        combine_rows: int, reduce_rows: int) -> Layout:
    """`layout.build_layout` (same arguments) as three Triton launches; `chunks` must be a column of the [EP, 4]
    int32 plans (stride 4), as the resident call passes it. No host sync, static shapes (capturable)."""
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
    i32 = dict(dtype=torch.int32, device=device)
    ep_tokens = P * T
    max_pairs = ep_tokens * min(K, L)
    max_dispatch = ep_tokens // dispatch_rows + P * MC + 1
    max_mtiles = max_pairs // block_m + MC * L + 1
    max_combine = ep_tokens // combine_rows + MC * P + 1
    n0 = -(-intermediate_size // block_n0)
    n1 = -(-hidden_size // block_n1)
    KP = _pow2(K)
    BLOCK_P = _pow2(P)
    BLOCK_PMC = _pow2(BLOCK_P * MC)
    # scratch
    q = torch.empty(P, T, K, **i32)
    pair_counts = torch.empty(P, L, MC, **i32)
    recv_slot = torch.empty(P, T, **i32)
    arrival = torch.empty(P, MC, **i32)
    send_slot_of = torch.empty(P, T, **i32)
    key_counts = torch.empty(P, MC, **i32)
    send_counts = torch.empty(P, **i32)
    pair_base = torch.empty(P, L, MC, **i32)
    seg_rows = torch.empty(MC * L, **i32)
    seg_mtiles_end = torch.empty(MC * L, **i32)
    chunk_mtiles = torch.empty(MC, **i32)
    group_base = torch.empty(2 * MC, **i32)
    recv_base = torch.empty(P, MC, **i32)
    combine_seg = torch.empty(3 * BLOCK_PMC, **i32)   # [block end | row begin | rows] per segment (chunk, source)
    dispatch_seg = torch.empty(3 * BLOCK_PMC, **i32)  # the same per segment (destination, chunk)
    send_base = torch.empty(P, **i32)
    # outputs (no fills: every entry the kernel reads is written below; padding holds whatever was there)
    meta = torch.empty(5, **i32)
    token_dest_mask = torch.empty(T, **i32)
    expert_offsets = torch.empty(L + 1, **i32)
    gemm1_expected = torch.empty(MC, **i32)
    arrival_expected = torch.empty(P, MC, **i32)
    combine_expected = torch.empty(P, **i32)
    gather_rows = torch.empty(max_pairs, **i32)
    combine_token = torch.empty(ep_tokens, **i32)
    combine_pos = torch.empty(ep_tokens, K, **i32)
    combine_weight = torch.empty(ep_tokens, K, dtype=torch.float32, device=device)
    send_token = torch.empty(ep_tokens, **i32)
    send_slot = torch.empty(ep_tokens, **i32)
    dispatch_tasks = torch.empty(max_dispatch, 4, **i32)
    combine_tasks = torch.empty(max_combine, 4, **i32)
    gemm_tasks = torch.empty(max_mtiles * (n0 + n1), 8, **i32)

    _scan_kernel[(P * L + 2 * P,)](
        all_ids, all_ids.stride(0), chunks, tokens, tokens.stride(0), q, pair_counts, recv_slot, arrival, send_slot_of,
        key_counts, send_counts, token_dest_mask, rank, P, T, L, K=K, KP=KP, MC=MC, BLOCK=_BLOCK, BLOCK_T=_BLOCK_T,
        BLOCK_P=BLOCK_P)
    _bases_kernel[(1,)](
        pair_counts, arrival, key_counts, send_counts, tokens, tokens.stride(0), pair_base, seg_rows, seg_mtiles_end,
        expert_offsets, chunk_mtiles, group_base, recv_base, combine_seg, dispatch_seg, send_base, meta, gemm1_expected,
        arrival_expected, combine_expected, rank, P, L, n0, n1, block_m, dispatch_rows, combine_rows, reduce_rows,
        MC=MC, BLOCK_L=_pow2(L), BLOCK_P=BLOCK_P, BLOCK_LP=_pow2(L) * BLOCK_P, BLOCK_PMC=BLOCK_PMC)
    per_block = triton.cdiv(T, _BLOCK_T)
    task_slots = max(max_dispatch, max_combine, max_mtiles)
    block_j = 64
    grid = P * per_block + P * per_block + triton.cdiv(task_slots, block_j)
    _emit_kernel[(grid,)](
        all_ids, all_weights, all_ids.stride(0), tokens, tokens.stride(0), chunks, q, recv_slot, send_slot_of,
        pair_base, recv_base, send_base, seg_rows, seg_mtiles_end, group_base, combine_seg, dispatch_seg, meta,
        gather_rows, combine_token, combine_pos, combine_weight, send_token, send_slot, dispatch_tasks, combine_tasks,
        gemm_tasks,
        rank, P, T, L, n0, n1, block_m, block_n0, block_n1, dispatch_rows, combine_rows, max_dispatch, max_combine,
        max_pairs, P * per_block, P * per_block, K=K, KP=KP, MC=MC, BLOCK_T=_BLOCK_T, BLOCK_P=BLOCK_P,
        BLOCK_PMC=BLOCK_PMC, BLOCK_SEG=_pow2(MC * L), BLOCK_J=block_j, BLOCK_N=_pow2(max(n0, n1)))
    return Layout(meta=meta, dispatch_tasks=dispatch_tasks, send_token=send_token, send_slot=send_slot,
                  gather_rows=gather_rows, gemm_tasks=gemm_tasks, arrival_expected=arrival_expected,
                  gemm1_expected=gemm1_expected, num_mtiles_bound=max_mtiles, combine_tasks=combine_tasks,
                  combine_token=combine_token, combine_pos=combine_pos, combine_weight=combine_weight,
                  token_dest_mask=token_dest_mask, combine_expected=combine_expected, max_pairs=max_pairs,
                  expert_offsets=expert_offsets)
