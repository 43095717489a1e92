"""The task tables' second stage: `bases_kernel`, the group bases, `meta` and the token blocks' bases (exclusive
prefix sums of what the scan counted; kernels/tables.py's module docstring, step 2). Shape legend as there."""

from __future__ import annotations

import triton
import triton.language as tl

from weave_moe.backends.weave.kernels import sync

__all__ = ["bases_kernel"]


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
    # every load first: what the scan counted and T, in one round (issued after the stores of the pairs' bases,
    # each later load waited behind their data: four dependent round trips in a row)
    c3 = tl.arange(0, MC)[:, None, None]
    e3 = tl.arange(0, BLOCK_L)[None, :, None]
    s3 = tl.arange(0, BLOCK_P)[None, None, :]
    ok3 = (e3 < L) & (s3 < P) & (c3 < MC)
    at = (s3 * L + e3) * MC + c3
    n = tl.load(pair_counts_ptr + at, mask=ok3, other=0)
    f = tl.arange(0, BLOCK_PMC)
    fc = f // BLOCK_P
    fs = f % BLOCK_P
    fok = (fc < MC) & (fs < P)
    arrivals = tl.load(arrival_ptr + fs * MC + fc, mask=fok, other=0)        # order (chunk, source)
    gd = f // MC
    gc = f % MC
    gok = gd < P
    keys = tl.load(key_counts_ptr + gd * MC + gc, mask=gok, other=0)                     # order (dest, chunk)
    pp = tl.arange(0, BLOCK_P)
    mc = tl.arange(0, MC)
    sent = tl.sum(tl.load(key_counts_ptr + pp[:, None] * MC + mc[None, :], mask=(pp < P)[:, None], other=0), axis=1)
    my_tokens = tl.load(tokens_ptr + rank * tokens_stride)
    # -- pairs: groups (chunk, expert, source) in that order; pair_base[s, e, c] = base of the group minus the pairs
    #    of (s, e) in earlier chunks, so a pair's position is pair_base + its running count q. All [MC, L, P].
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
    dblocks = (keys + dispatch_rows - 1) // dispatch_rows
    tl.store(dispatch_seg_ptr + f, tl.cumsum(dblocks, axis=0))
    tl.store(dispatch_seg_ptr + BLOCK_PMC + f, _exclusive(keys))
    tl.store(dispatch_seg_ptr + 2 * BLOCK_PMC + f, keys)
    num_dispatch = tl.sum(dblocks, axis=0)
    tl.store(send_base_ptr + pp, _exclusive(sent), mask=pp < P)
    tl.store(combine_expected_ptr + pp, sent, mask=pp < P)
    num_reduce = (my_tokens + reduce_rows - 1) // reduce_rows
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
def bases_kernel(pair_counts_ptr, arrival_ptr, key_counts_ptr, tokens_ptr, tokens_stride,
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

