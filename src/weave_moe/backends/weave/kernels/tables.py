"""The task tables of `layout.build_layout` as three Triton kernels (and a memset, unless the caller keeps the
counters: `build_layout_triton`) instead of ~40 torch kernels.

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

The running counts are built in two levels so that no program walks all tokens: the tokens are cut into NB blocks of
BT tokens (`_block_tokens`: ~128 blocks per source); a count along the tokens = the count in earlier blocks (a block
base) + the count within the block.

    1. `_scan_kernel`, P * NB + NB programs:
         (source s, block b):  which tokens of the block have an expert here (rank within the block, the block's
                               count), each (token, expert) pair's rank among the block's pairs of its expert (q, in
                               steps of SUB tokens: a pairwise compare within the step + a running count per expert),
                               the block's pairs per local expert; pairs per (expert, chunk) and rows per chunk
                               added atomically into zeroed counters
         (block b of this rank's tokens): for every destination d, which tokens go to d (rank within the block, the
                               block's count); rows per (d, chunk) added atomically; the destination bit masks
    2. `_bases_kernel`, 1 + P * ceil(L / 64) + 1 programs: program 0 the exclusive prefix sums of the counts (the
       group bases), the expert offsets, the M tiles per chunk, the offsets of the GEMM task groups in DAG order,
       `meta`; the others the block bases (exclusive prefix sums down the blocks) of pairs per (source, expert) and
       of received / sent tokens.
    3. `_emit_kernel`, many programs: every entry at its position (group base + block base + rank within the block):
       the pairs' gather rows, the received tokens' combine rows (their pair positions and weights), the rows this
       rank sends, and the task rows (dispatch blocks, combine blocks, M tiles -> GEMM0 / GEMM1 tasks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weave_moe.backends.weave.kernels import sync
from weave_moe.backends.weave.layout import Layout
from weave_moe.plan.workload import MAX_CHUNKS

__all__ = ["build_layout_triton", "counter_words"]

_BLOCK_T = 32          # tokens per emit program


@triton.jit
def _chunk_of(t, chunks_ptr, d, tokens_ptr, tokens_stride, s):
    """chunk(t) = t * K_d // max(T_s, 1), as layout.py computes it."""
    K = tl.load(chunks_ptr + d * 4)   # chunks are column 1 of the [P, 4] plans: stride 4 (host checks)
    Ts = tl.maximum(tl.load(tokens_ptr + s * tokens_stride), 1)
    return (t * K) // Ts


#: `_scan_kernel`'s WAIT: where it waits for the kernel launched before it (`build_layout_triton(previous_writes=)`)
WAIT_FIRST = tl.constexpr(0)            # before anything: the previous kernel may write anything the scan reads
WAIT_BEFORE_CHUNKS = tl.constexpr(1)    # before the first read of the chunk counts, all the previous kernel writes
WAIT_LAST = tl.constexpr(2)             # at its end: the previous kernel writes nothing the scan reads
_WAIT_OF = {"any": WAIT_FIRST.value, "chunks": WAIT_BEFORE_CHUNKS.value, "none": WAIT_LAST.value}


@triton.jit
def _wait_for_chunks(WAIT: tl.constexpr):
    """The scan's wait for the previous kernel when it writes the chunk counts (WAIT_BEFORE_CHUNKS): called before
    the first read of `chunks_ptr`."""
    if WAIT == WAIT_BEFORE_CHUNKS:
        sync.pdl_wait()


@triton.jit
def _pair_chunk_counts(expert, pair_mine, tt, start, n_tok, K_rank, pair_counts_ptr, s, L,
                       MC: tl.constexpr, SUB: tl.constexpr, BLOCK_L: tl.constexpr):
    """Add the pairs of one step of SUB tokens [start, start + SUB) (local expert `expert` where `pair_mine`, token
    `tt`) into pairs per (expert, chunk): chunks are monotone in the token, so a step spans chunks c_lo..c_hi."""
    le = tl.arange(0, BLOCK_L)
    Ts = tl.maximum(n_tok, 1)
    chunk = (tt * K_rank) // Ts
    c_hi = ((tl.minimum(start + SUB, n_tok) - 1) * K_rank) // Ts
    for c in range((start * K_rank) // Ts, c_hi + 1):
        per_expert = tl.histogram(expert, BLOCK_L, mask=pair_mine & (chunk == c))
        tl.atomic_add(pair_counts_ptr + (s * L + le) * MC + c, per_expert, mask=(per_expert > 0) & (le < L),
                      sem="relaxed")


@triton.jit
def _arrivals(t, hit, chunks_ptr, tokens_ptr, tokens_stride, arrival_ptr, s, rank, MC: tl.constexpr):
    """Add the block's tokens that have an expert here (`hit`) into rows per (source s, chunk)."""
    mc = tl.arange(0, MC)
    arrived = tl.histogram(tl.minimum(_chunk_of(t, chunks_ptr, rank, tokens_ptr, tokens_stride, s), MC - 1), MC,
                           mask=hit != 0)
    tl.atomic_add(arrival_ptr + s * MC + mc, arrived, mask=arrived > 0, sem="relaxed")


@triton.jit
def _step_pairs(row, tt, j, n_tok, rank, L, K: tl.constexpr):
    """The (token, slot) pairs of one step: (local expert or 0, whether the pair's expert is on this rank)."""
    pair_ids = tl.load(row + tt * K + j, mask=(tt < n_tok) & (j < K), other=-1)
    pair_mine = (pair_ids >= rank * L) & (pair_ids < (rank + 1) * L)
    return tl.where(pair_mine, pair_ids - rank * L, 0), pair_mine


@triton.jit
def _scan_received(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, q_ptr, pair_hist_ptr,
                   pair_counts_ptr, recv_local_ptr, recv_hist_ptr, arrival_ptr, s, b, rank, T, L, NB,
                   K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr,
                   BLOCK_L: tl.constexpr, WAIT: tl.constexpr):
    """Token block b of source s: which tokens have an expert on this rank (their rank in the block, the block's
    count, rows per chunk), and each (token, expert) pair's rank among the block's pairs of its expert in (token,
    slot) order (q), the block's pairs per local expert, pairs per (expert, chunk). With WAIT_BEFORE_CHUNKS what
    needs the chunk counts comes last, after the wait (the pairs per (expert, chunk) in a second pass over the
    block's steps)."""
    n_tok = tl.load(tokens_ptr + s * tokens_stride)
    first = b * BT
    t = first + tl.arange(0, BT)
    jj = tl.arange(0, KP)
    row = ids_ptr + s.to(tl.int64) * ids_stride
    ids = tl.load(row + t[:, None] * K + jj[None, :], mask=(t < n_tok)[:, None] & (jj[None, :] < K), other=-1)
    mine = (ids >= rank * L) & (ids < (rank + 1) * L)
    hit = (tl.sum(mine.to(tl.int32), axis=1) > 0).to(tl.int32)
    tl.store(recv_local_ptr + s * T + t, tl.cumsum(hit, axis=0) - hit, mask=hit != 0)
    tl.store(recv_hist_ptr + s * NB + b, tl.sum(hit, axis=0))
    late: tl.constexpr = WAIT == WAIT_BEFORE_CHUNKS
    if not late:
        _arrivals(t, hit, chunks_ptr, tokens_ptr, tokens_stride, arrival_ptr, s, rank, MC)
    # pairs, SUB tokens at a time: rank among the step's earlier pairs of the same expert + the block's running count
    le = tl.arange(0, BLOCK_L)
    ii = tl.arange(0, SUB * KP)
    running = tl.zeros([BLOCK_L], dtype=tl.int32)
    if not late:
        K_rank = tl.load(chunks_ptr + rank * 4)
    for start in range(first, tl.minimum(first + BT, n_tok), SUB):
        tt = start + ii // KP
        j = ii % KP
        expert, pair_mine = _step_pairs(row, tt, j, n_tok, rank, L, K)
        same = (expert[None, :] == expert[:, None]) & pair_mine[None, :] & (ii[None, :] < ii[:, None])
        q = tl.sum(same.to(tl.int32), axis=1) + tl.gather(running, expert, 0)
        tl.store(q_ptr + (s * T + tt).to(tl.int64) * K + j, q, mask=pair_mine)
        running += tl.histogram(expert, BLOCK_L, mask=pair_mine)
        if not late:
            _pair_chunk_counts(expert, pair_mine, tt, start, n_tok, K_rank, pair_counts_ptr, s, L, MC, SUB, BLOCK_L)
    tl.store(pair_hist_ptr + (s * NB + b) * L + le, running, mask=le < L)
    if late:
        _wait_for_chunks(WAIT)
        _arrivals(t, hit, chunks_ptr, tokens_ptr, tokens_stride, arrival_ptr, s, rank, MC)
        K_rank = tl.load(chunks_ptr + rank * 4)
        for start in range(first, tl.minimum(first + BT, n_tok), SUB):
            tt = start + ii // KP
            expert, pair_mine = _step_pairs(row, tt, ii % KP, n_tok, rank, L, K)
            _pair_chunk_counts(expert, pair_mine, tt, start, n_tok, K_rank, pair_counts_ptr, s, L, MC, SUB, BLOCK_L)


@triton.jit
def _scan_sent(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, send_local_ptr, send_hist_ptr,
               key_counts_ptr, mask_ptr, b, rank, P, T, L, NB, K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr,
               BT: tl.constexpr, BLOCK_P: tl.constexpr, WAIT: tl.constexpr):
    """Token block b of this rank: for every destination d, which tokens go to d (their rank in the block, the
    block's count, rows per chunk of d), and every token slot's destination bit mask (zeros past this rank's
    tokens)."""
    n_tok = tl.load(tokens_ptr + rank * tokens_stride)
    t = b * BT + tl.arange(0, BT)
    jj = tl.arange(0, KP)
    pp = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + rank.to(tl.int64) * ids_stride + t[:, None] * K + jj[None, :],
                  mask=(t < n_tok)[:, None] & (jj[None, :] < K), other=-1)
    owner = tl.where((ids >= 0) & (ids < P * L), ids // L, -1)   # ids >= E: none (the counts reject the call)
    goes = tl.sum((owner[:, :, None] == pp[None, None, :]).to(tl.int32), axis=1) > 0      # [BT, P]
    hit = goes.to(tl.int32)
    tl.store(send_local_ptr + pp[None, :] * T + t[:, None], tl.cumsum(hit, axis=0) - hit, mask=goes)
    tl.store(send_hist_ptr + pp * NB + b, tl.sum(hit, axis=0), mask=pp < P)
    tl.store(mask_ptr + t, tl.sum(tl.where(goes, 1 << pp[None, :], 0), axis=1), mask=t < T)
    _wait_for_chunks(WAIT)
    K_dest = tl.load(chunks_ptr + pp * 4, mask=pp < P, other=1)
    chunk = (t[:, None] * K_dest[None, :]) // tl.maximum(n_tok, 1)
    f = tl.arange(0, BLOCK_P * MC)
    keys = tl.histogram(tl.reshape(pp[None, :] * MC + tl.minimum(chunk, MC - 1), [BT * BLOCK_P]), BLOCK_P * MC,
                        mask=tl.reshape(goes, [BT * BLOCK_P]))
    tl.atomic_add(key_counts_ptr + f, keys, mask=(keys > 0) & (f < P * MC), sem="relaxed")


# `rank` differs between ranks: specialised (Triton compiles an int argument equal to 1 as a constant), rank 1 would
# run another binary than rank 0, compiled while its peers wait, and `rank.to(...)` fails to compile on a constant
# (the device-resident call at EP = 2: rank 1 raised CompilationError in its first call while rank 0 waited out its
# deadline for rank 1's rows)
@triton.jit(do_not_specialize=["rank"])
def _scan_kernel(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, q_ptr, pair_hist_ptr, pair_counts_ptr,
                 recv_local_ptr, recv_hist_ptr, arrival_ptr, send_local_ptr, send_hist_ptr, key_counts_ptr, mask_ptr,
                 rank, P, T, L: tl.constexpr, NB, K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr,
                 BT: tl.constexpr, SUB: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr,
                 WAIT: tl.constexpr):
    """WAIT: where the scan waits for the launch before it (WAIT_*). WAIT_LAST: that launch (a fixed plan's counts
    kernel) writes nothing the scan reads (the routing was complete before it started, the plan is the layer's; the
    ids outside [-1, E) it replaces by -1 in place count as -1 here either way), so the scan runs beside it.
    WAIT_BEFORE_CHUNKS: it writes only the chunk counts (an adaptive policy's planner, on its own or inside the
    counts launch: the same holds for the rest), so the scan does all that does not need them beside it, then waits
    (its end waits again, which returns at once: `pdl_finish`)."""
    sync.pdl_start(WAIT != WAIT_FIRST)
    pid = tl.program_id(0)
    if pid < P * NB:
        _scan_received(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, q_ptr, pair_hist_ptr,
                       pair_counts_ptr, recv_local_ptr, recv_hist_ptr, arrival_ptr, pid // NB, pid % NB, rank, T, L,
                       NB, K, KP, MC, BT, SUB, BLOCK_L, WAIT)
    else:
        _scan_sent(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, send_local_ptr, send_hist_ptr,
                   key_counts_ptr, mask_ptr, pid - P * NB, rank, P, T, L, NB, K, KP, MC, BT, BLOCK_P, WAIT)
    sync.pdl_finish(WAIT != WAIT_FIRST)


@triton.jit
def _exclusive(x, axis: tl.constexpr = 0):
    return tl.cumsum(x, axis=axis) - x


@triton.jit
def _bases(pair_counts_ptr, arrival_ptr, key_counts_ptr, tokens_ptr, tokens_stride,
           pair_base_ptr, seg_rows_ptr, seg_mtiles_end_ptr, expert_offsets_ptr, chunk_mtiles_ptr,
           group_base_ptr, recv_base_ptr, combine_seg_ptr, dispatch_seg_ptr, send_base_ptr, meta_ptr,
           gemm1_expected_ptr, arrival_out_ptr, combine_expected_ptr,
           rank, P, L, n0, n1, block_m, dispatch_rows, combine_rows, reduce_rows,
           MC: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_PMC: tl.constexpr,
           CLEAR_COUNTS: tl.constexpr):
    # -- pairs: groups (chunk, expert, source) in that order; pair_base[s, e, c] = base of the group minus the pairs
    #    of (s, e) in earlier chunks, so a pair's position is pair_base + its running count q. All [MC, L, P].
    c3 = tl.arange(0, MC)[:, None, None]
    e3 = tl.arange(0, BLOCK_L)[None, :, None]
    s3 = tl.arange(0, BLOCK_P)[None, None, :]
    ok3 = (e3 < L) & (s3 < P) & (c3 < MC)
    at = (s3 * L + e3) * MC + c3
    n = tl.load(pair_counts_ptr + at, mask=ok3, other=0)
    rows = tl.sum(n, axis=2)                                                   # [MC, L] rows of segment (c, e)
    chunk_rows = tl.sum(rows, axis=1)                                          # [MC]
    base = (_exclusive(chunk_rows)[:, None, None] + _exclusive(rows, 1)[:, :, None] + _exclusive(n, 2))
    tl.store(pair_base_ptr + at, base - _exclusive(n, 0), mask=ok3)
    # segments (c, e) and their M tiles, in that order
    c2 = tl.arange(0, MC)[:, None]
    e2 = tl.arange(0, BLOCK_L)[None, :]
    ok2 = (e2 < L) & (c2 < MC)
    tiles = (rows + block_m - 1) // block_m
    chunk_tiles = tl.sum(tiles, axis=1)                                        # [MC]
    tl.store(seg_rows_ptr + c2 * L + e2, rows, mask=ok2)
    # ... and each segment's first row (seg_rows holds [rows | first row] per segment)
    tl.store(seg_rows_ptr + MC * L + c2 * L + e2, _exclusive(chunk_rows)[:, None] + _exclusive(rows, 1), mask=ok2)
    tl.store(seg_mtiles_end_ptr + c2 * L + e2, (tl.cumsum(chunk_tiles, 0) - chunk_tiles)[:, None]
             + tl.cumsum(tiles, axis=1), mask=ok2)
    mc = tl.arange(0, MC)
    tl.store(chunk_mtiles_ptr + mc, chunk_tiles)
    tl.store(gemm1_expected_ptr + mc, chunk_tiles * n1)
    num_mtiles = tl.sum(chunk_tiles, axis=0)
    le = tl.arange(0, BLOCK_L)
    tl.store(expert_offsets_ptr + le + 1, tl.cumsum(tl.sum(tl.where(c2 == 0, rows, 0), axis=0), axis=0),
             mask=le < L)   # chunk 0's rows (the serial schedule's only chunk)
    tl.store(expert_offsets_ptr, 0)
    # -- GEMM task groups in DAG order: GEMM0 of chunk c has rank 2c, GEMM1 of chunk c rank 2c + 3
    g = tl.arange(0, 2 * MC)
    g_chunk = g % MC
    g_kind = g // MC
    g_rank = 2 * g_chunk + 3 * g_kind
    # from registers: chunk_mtiles was stored above by other threads of this program (no barrier since)
    g_tiles = tl.sum(tl.where(mc[None, :] == g_chunk[:, None], chunk_tiles[None, :], 0), axis=1)
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
    sent = tl.sum(tl.load(key_counts_ptr + pp[:, None] * MC + mc[None, :], mask=(pp < P)[:, None], other=0), axis=1)
    tl.store(send_base_ptr + pp, _exclusive(sent), mask=pp < P)
    tl.store(combine_expected_ptr + pp, sent, mask=pp < P)
    num_reduce = (tl.load(tokens_ptr + rank * tokens_stride) + reduce_rows - 1) // reduce_rows
    tl.store(meta_ptr + 0, num_dispatch)
    tl.store(meta_ptr + 1, num_mtiles * (n0 + n1))
    tl.store(meta_ptr + 2, num_combine)
    tl.store(meta_ptr + 3, num_reduce)
    tl.store(meta_ptr + 4, num_mtiles)
    if CLEAR_COUNTS:  # a caller's persistent counters (build_layout_triton `counters`): zero again for the next call
        tl.debug_barrier()   # every thread has read them
        tl.store(pair_counts_ptr + at, tl.zeros([MC, BLOCK_L, BLOCK_P], dtype=tl.int32), mask=ok3)
        tl.store(arrival_ptr + fs * MC + fc, tl.zeros([BLOCK_PMC], dtype=tl.int32), mask=fok)
        tl.store(key_counts_ptr + pp[:, None] * MC + mc[None, :], tl.zeros([BLOCK_P, MC], dtype=tl.int32),
                 mask=(pp < P)[:, None])


@triton.jit
def _block_bases(hist_ptr, base_ptr, column0, columns, row_stride, column_stride, NB, BLOCK_B: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """base[b, c] = sum over b' < b of hist[b', c] (exclusive prefix down the NB token blocks) for the columns
    [column0, column0 + BLOCK_C) < `columns` of a table with the given strides at hist_ptr / base_ptr."""
    cc = column0 + tl.arange(0, BLOCK_C)
    bb = tl.arange(0, BLOCK_B)
    running = tl.zeros([BLOCK_C], dtype=tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        at = (b0 + bb)[:, None] * row_stride + cc[None, :] * column_stride
        ok = ((b0 + bb) < NB)[:, None] & (cc < columns)[None, :]
        hist = tl.load(hist_ptr + at, mask=ok, other=0)
        tl.store(base_ptr + at, running[None, :] + _exclusive(hist), mask=ok)
        running += tl.sum(hist, axis=0)


@triton.jit(do_not_specialize=["rank"])
def _bases_kernel(pair_counts_ptr, arrival_ptr, key_counts_ptr, tokens_ptr, tokens_stride,
                  pair_base_ptr, seg_rows_ptr, seg_mtiles_end_ptr, expert_offsets_ptr, chunk_mtiles_ptr,
                  group_base_ptr, recv_base_ptr, combine_seg_ptr, dispatch_seg_ptr, send_base_ptr, meta_ptr,
                  gemm1_expected_ptr, arrival_out_ptr, combine_expected_ptr,
                  pair_hist_ptr, pair_block_base_ptr, recv_hist_ptr, recv_block_base_ptr, send_hist_ptr,
                  send_block_base_ptr,
                  rank, P, L: tl.constexpr, NB, n0, n1, block_m, dispatch_rows, combine_rows, reduce_rows,
                  MC: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_PMC: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, CLEAR_COUNTS: tl.constexpr = False):
    """Program 0: the group bases and `meta` from the scan's counts. The others: the token blocks' bases, one
    program per (source, BLOCK_C local experts) of the pairs' [P, NB, L] table, and the last one for the received
    and sent tokens' [P, NB] tables."""
    sync.pdl_enter()
    pid = tl.program_id(0)
    slices = tl.cdiv(L, BLOCK_C)
    if pid == 0:
        _bases(pair_counts_ptr, arrival_ptr, key_counts_ptr, tokens_ptr, tokens_stride,
               pair_base_ptr, seg_rows_ptr, seg_mtiles_end_ptr, expert_offsets_ptr, chunk_mtiles_ptr,
               group_base_ptr, recv_base_ptr, combine_seg_ptr, dispatch_seg_ptr, send_base_ptr, meta_ptr,
               gemm1_expected_ptr, arrival_out_ptr, combine_expected_ptr,
               rank, P, L, n0, n1, block_m, dispatch_rows, combine_rows, reduce_rows, MC, BLOCK_L, BLOCK_P,
               BLOCK_PMC, CLEAR_COUNTS)
    elif pid <= P * slices:   # pairs: [P, NB, L]
        s = (pid - 1) // slices
        _block_bases(pair_hist_ptr + s * NB * L, pair_block_base_ptr + s * NB * L, ((pid - 1) % slices) * BLOCK_C, L,
                     L, 1, NB, BLOCK_B, BLOCK_C)
    else:   # received and sent tokens: [P, NB]
        _block_bases(recv_hist_ptr, recv_block_base_ptr, 0, P, 1, NB, NB, BLOCK_B, BLOCK_P)
        _block_bases(send_hist_ptr, send_block_base_ptr, 0, P, 1, NB, NB, BLOCK_B, BLOCK_P)


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
def _emit_received(ids_ptr, weights_ptr, ids_stride, tokens_ptr, tokens_stride, chunks_ptr, q_ptr, recv_local_ptr,
                   pair_base_ptr, recv_base_ptr, pair_block_base_ptr, recv_block_base_ptr, gather_ptr,
                   combine_token_ptr, combine_pos_ptr, combine_weight_ptr, pid, rank, T, L, NB, max_pairs,
                   K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr, BLOCK_T: tl.constexpr, BT: tl.constexpr):
    jj = tl.arange(0, KP)
    # received tokens of source s, block b: their combine rows, and their pairs' gather rows
    s, t = _token_block(pid, T, BLOCK_T)
    valid = t < tl.load(tokens_ptr + s * tokens_stride)
    element = s.to(tl.int64) * ids_stride + t[:, None] * K + jj[None, :]
    emask = valid[:, None] & (jj[None, :] < K)
    ids = tl.load(ids_ptr + element, mask=emask, other=-1)
    mine = (ids >= rank * L) & (ids < (rank + 1) * L)
    hit = tl.sum(mine.to(tl.int32), axis=1) > 0
    c = _chunk_of(t, chunks_ptr, rank, tokens_ptr, tokens_stride, s)
    expert = tl.where(mine, ids - rank * L, 0)
    block = t // BT
    # q: the pair's rank among its block's pairs of its expert + the pairs of that expert in earlier blocks
    q = (tl.load(q_ptr + (s * T + t).to(tl.int64)[:, None] * K + jj[None, :], mask=mine, other=0)
         + tl.load(pair_block_base_ptr + (s * NB + block)[:, None] * L + expert, mask=mine, other=0))
    base = tl.load(pair_base_ptr + (s * L + expert) * MC + c[:, None], mask=mine, other=0)
    pos = tl.where(mine, base + q, -1)
    # a token that repeats one expert more than E_local times (only possible when k > E_local) can exceed the
    # static bound of pairs; those pairs are dropped (the torch tables drop them too, others), never written
    # past the buffers
    pos = tl.where(pos < max_pairs, pos, -1)
    mine = mine & (pos >= 0)
    slot = (tl.load(recv_local_ptr + s * T + t, mask=hit, other=0)
            + tl.load(recv_block_base_ptr + s * NB + block, mask=hit, other=0))
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
def _emit_sent(ids_ptr, ids_stride, tokens_ptr, tokens_stride, send_local_ptr, send_block_base_ptr, send_base_ptr,
               send_token_ptr, send_out_ptr, q_pid, rank, T, L, NB, K: tl.constexpr, KP: tl.constexpr,
               BLOCK_T: tl.constexpr, BT: tl.constexpr):
    jj = tl.arange(0, KP)
    # this rank's tokens to destination d, block b: the rows it sends
    d, t = _token_block(q_pid, T, BLOCK_T)
    valid = t < tl.load(tokens_ptr + rank * tokens_stride)
    ids = tl.load(ids_ptr + rank.to(tl.int64) * ids_stride + t[:, None] * K + jj[None, :],
                  mask=valid[:, None] & (jj[None, :] < K), other=-1)
    owner = tl.where(ids >= 0, ids // L, -1)
    hit = tl.sum((owner == d).to(tl.int32), axis=1) > 0
    slot = (tl.load(send_local_ptr + d * T + t, mask=hit, other=0)
            + tl.load(send_block_base_ptr + d * NB + t // BT, mask=hit, other=0))
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
def _emit_kernel(ids_ptr, weights_ptr, ids_stride, tokens_ptr, tokens_stride, chunks_ptr, q_ptr, recv_local_ptr,
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
    sync.pdl_enter()
    pid = tl.program_id(0)
    if pid < recv_programs:
        _emit_received(ids_ptr, weights_ptr, ids_stride, tokens_ptr, tokens_stride, chunks_ptr, q_ptr, recv_local_ptr,
                       pair_base_ptr, recv_base_ptr, pair_block_base_ptr, recv_block_base_ptr, gather_ptr,
                       combine_token_ptr, combine_pos_ptr, combine_weight_ptr, pid, rank, T, L, NB, max_pairs, K, KP,
                       MC, BLOCK_T, BT)
    elif pid < recv_programs + send_programs:
        _emit_sent(ids_ptr, ids_stride, tokens_ptr, tokens_stride, send_local_ptr, send_block_base_ptr, send_base_ptr,
                   send_token_ptr, send_out_ptr, pid - recv_programs, rank, T, L, NB, K, KP, BLOCK_T, BT)
    else:
        _emit_tasks(seg_rows_ptr, seg_mtiles_end_ptr, group_base_ptr, combine_seg_ptr,
                    dispatch_seg_ptr, meta_ptr, dispatch_tasks_ptr, combine_tasks_ptr, gemm_tasks_ptr, plan_ptr,
                    num_sms, pid - recv_programs - send_programs, P, L, n0, n1, block_m, block_n0, block_n1,
                    dispatch_rows, combine_rows, max_dispatch, max_combine, max_pairs, MC, BLOCK_P, BLOCK_PMC,
                    BLOCK_SEG, BLOCK_J, BLOCK_N, SERIAL_GROUPED)


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


def build_layout_triton(all_ids: torch.Tensor, all_weights: torch.Tensor, tokens: torch.Tensor,
                        chunks: torch.Tensor, rank: int, num_experts: int, *, hidden_size: int,
                        intermediate_size: int, block_m: int, block_n0: int, block_n1: int, dispatch_rows: int,
                        combine_rows: int, reduce_rows: int, block_tokens: int | None = None,
                        counters: torch.Tensor | None = None, emit_tokens: int | None = None,
                        previous_writes: str = "any", serial_plan: torch.Tensor | None = None,
                        num_sms: int = 0, beside_emit=None) -> Layout:
    """`layout.build_layout` (same arguments) as three Triton launches (and one memset); `chunks` must be a column
    of the [EP, 4] int32 plans (stride 4), as the resident call passes it. No host sync, static shapes (capturable).
    `block_tokens` (a power of two, tests): tokens per scan block instead of `_block_tokens`' choice. `counters`:
    the scan's atomic counters as a caller's buffer (`counter_words` int32, all zero), which the bases kernel zeroes
    again after reading them: no memset in the call (a node less in its graph); None: a zeroed buffer per call.
    `emit_tokens` (a power of two, tests): tokens per emit program instead of 32 (more: fewer programs, each a
    larger one; on an H200 32 were 0.2-0.6 us faster than 64 and up to 4 us faster than 256 with the serial skip
    below, 1 to 2048 tokens, bench/results/h200-42828c2).
    `previous_writes`: what the kernel launched just before (programmatic dependent launch) writes that the tables
    read, so where the scan waits for it (`_scan_kernel`): "any" (at its start), "chunks" (only the chunk counts:
    an adaptive policy's planner, alone or inside the counts launch; the scan waits before it reads them) or "none"
    (the resident call's counts kernel under a fixed plan: the routing was complete before it, the chunks are the
    layer's; the scan runs beside it and waits at its end).
    `serial_plan` (int32 device scalar: this rank's c) with `num_sms`: for a layer that runs serial plans through
    the grouped GEMMs, which read their own tile tables (grouped_tiles): under a serial plan (c >= num_sms) no GEMM
    task row is written (`gemm_tasks` holds whatever was there; `meta` still counts them), under another plan
    every one is. Those rows are most of the emit's stores at prefill sizes (72 per M tile at DeepSeek-V3's
    shape).
    `beside_emit`: called between the bases and the emit launches with (expert_offsets, gemm1_expected), final by
    then: what needs only those can be enqueued on another stream, beside the emit (the weave backend's grouped-GEMM
    tile tables)."""
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
    BLOCK_L = _pow2(L)
    BT, step = _block_tokens(T, KP)
    if block_tokens is not None:
        BT, step = block_tokens, min(step, block_tokens)
    NB = triton.cdiv(T, BT)
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
    q = torch.empty(P, T, K, **i32)
    recv_local = torch.empty(P, T, **i32)
    send_local = torch.empty(P, T, **i32)
    pair_hist = torch.empty(P, NB, L, **i32)
    pair_block_base = torch.empty(P, NB, L, **i32)
    recv_hist = torch.empty(P, NB, **i32)
    recv_block_base = torch.empty(P, NB, **i32)
    send_hist = torch.empty(P, NB, **i32)
    send_block_base = torch.empty(P, NB, **i32)
    pair_base = torch.empty(P, L, MC, **i32)
    seg_rows = torch.empty(2 * MC * L, **i32)        # [rows | first row] per segment (chunk, local expert)
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

    emit_tokens = emit_tokens or _BLOCK_T
    per_block = triton.cdiv(T, emit_tokens)
    task_slots = max(max_dispatch, max_combine, max_mtiles)
    block_c, block_j = min(BLOCK_L, 64), 64
    _scan_kernel[(P * NB + NB,)](
        all_ids, all_ids.stride(0), chunks, tokens, tokens.stride(0), q, pair_hist, pair_counts, recv_local,
        recv_hist, arrival, send_local, send_hist, key_counts, token_dest_mask, rank, P, T, L, NB, K=K, KP=KP,
        MC=MC, BT=BT, SUB=step, BLOCK_L=BLOCK_L, BLOCK_P=BLOCK_P, WAIT=_WAIT_OF[previous_writes], **sync.LAUNCH)
    _bases_kernel[(1 + P * triton.cdiv(L, block_c) + 1,)](
        pair_counts, arrival, key_counts, tokens, tokens.stride(0), pair_base, seg_rows, seg_mtiles_end,
        expert_offsets, chunk_mtiles, group_base, recv_base, combine_seg, dispatch_seg, send_base, meta,
        gemm1_expected, arrival_expected, combine_expected, pair_hist, pair_block_base, recv_hist,
        recv_block_base, send_hist, send_block_base, rank, P, L, NB, n0, n1, block_m, dispatch_rows, combine_rows,
        reduce_rows,
        MC=MC, BLOCK_L=BLOCK_L, BLOCK_P=BLOCK_P, BLOCK_PMC=BLOCK_PMC, BLOCK_B=64, BLOCK_C=block_c,
        CLEAR_COUNTS=counters is not None, **sync.LAUNCH)
    if beside_emit is not None:
        beside_emit(expert_offsets, gemm1_expected)
    grid = P * per_block + P * per_block + triton.cdiv(task_slots, block_j)
    _emit_kernel[(grid,)](
        all_ids, all_weights, all_ids.stride(0), tokens, tokens.stride(0), chunks, q, recv_local, send_local,
        pair_base, recv_base, send_base, pair_block_base, recv_block_base, send_block_base, seg_rows,
        seg_mtiles_end, group_base, combine_seg, dispatch_seg, meta,
        gather_rows, combine_token, combine_pos, combine_weight, send_token, send_slot, dispatch_tasks,
        combine_tasks, gemm_tasks, meta if serial_plan is None else serial_plan,
        rank, P, T, L, NB, n0, n1, block_m, block_n0, block_n1, dispatch_rows, combine_rows, max_dispatch,
        max_combine, max_pairs, P * per_block, P * per_block, max(num_sms, 1), K=K, KP=KP, MC=MC,
        BLOCK_T=emit_tokens, BT=BT, BLOCK_P=BLOCK_P, BLOCK_PMC=BLOCK_PMC, BLOCK_SEG=_pow2(MC * L), BLOCK_J=block_j,
        BLOCK_N=min(16, _pow2(max(n0, n1))), SERIAL_GROUPED=serial_plan is not None, **sync.LAUNCH)
    return Layout(meta=meta, dispatch_tasks=dispatch_tasks, send_token=send_token, send_slot=send_slot,
                  gather_rows=gather_rows, gemm_tasks=gemm_tasks, arrival_expected=arrival_expected,
                  gemm1_expected=gemm1_expected, num_mtiles_bound=max_mtiles, combine_tasks=combine_tasks,
                  combine_token=combine_token, combine_pos=combine_pos, combine_weight=combine_weight,
                  token_dest_mask=token_dest_mask, combine_expected=combine_expected, max_pairs=max_pairs,
                  expert_offsets=expert_offsets)
