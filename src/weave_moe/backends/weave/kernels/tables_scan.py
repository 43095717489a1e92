"""The task tables' first stage: `scan_kernel`, the running counts within token blocks (kernels/tables.py's module
docstring: the tables as counting sorts, step 1). Shape legend as there."""

from __future__ import annotations

import triton
import triton.language as tl

from weave_moe.backends.weave.kernels import sync

__all__ = ["scan_kernel", "chunk_of", "token_destinations", "WAIT_FIRST", "WAIT_BEFORE_CHUNKS", "WAIT_LAST"]


@triton.jit
def chunk_of(t, chunks_ptr, d, tokens_ptr, tokens_stride, s):
    """chunk(t) = t * K_d // max(T_s, 1), as layout.py computes it."""
    K = tl.load(chunks_ptr + d * 4)   # chunks are column 1 of the [P, 4] plans: stride 4 (host checks)
    Ts = tl.maximum(tl.load(tokens_ptr + s * tokens_stride), 1)
    return (t * K) // Ts


#: `scan_kernel`'s WAIT: where it waits for the kernel launched before it
#: (`tables.build_layout_triton(previous_writes=)`)
WAIT_FIRST = tl.constexpr(0)            # before anything: the previous kernel may write anything the scan reads
WAIT_BEFORE_CHUNKS = tl.constexpr(1)    # before the first read of the chunk counts, all the previous kernel writes
WAIT_LAST = tl.constexpr(2)             # at its end: the previous kernel writes nothing the scan reads


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
def _arrivals(t, hit, K_rank, n_tok, arrival_ptr, s, MC: tl.constexpr):
    """Add the block's tokens that have an expert here (`hit`) into rows per (source s, chunk); `K_rank`: this rank's
    chunk count, `n_tok`: T_s (chunk(t) = t * K // max(T_s, 1), as `chunk_of`)."""
    mc = tl.arange(0, MC)
    arrived = tl.histogram(tl.minimum((t * K_rank) // tl.maximum(n_tok, 1), MC - 1), MC, mask=hit != 0)
    tl.atomic_add(arrival_ptr + s * MC + mc, arrived, mask=arrived > 0, sem="relaxed")


@triton.jit
def _step_pairs(row, tt, j, n_tok, rank, L, K: tl.constexpr):
    """The (token, slot) pairs of one step: (local expert or 0, whether the pair's expert is on this rank)."""
    pair_ids = tl.load(row + tt * K + j, mask=(tt < n_tok) & (j < K), other=-1)
    pair_mine = (pair_ids >= rank * L) & (pair_ids < (rank + 1) * L)
    return tl.where(pair_mine, pair_ids - rank * L, 0), pair_mine


@triton.jit
def _rank_pairs(row, first, last, n_tok, rank, L, K_rank, q_ptr, pair_counts_ptr, s, T, K: tl.constexpr,
                KP: tl.constexpr, MC: tl.constexpr, SUB: tl.constexpr, BLOCK_L: tl.constexpr, late: tl.constexpr):
    """Tokens [first, last) of source s in steps of SUB: each pair's rank among the earlier pairs of its local expert
    (q: a pairwise compare within the step + the running count of the steps before); returns the pairs per local
    expert. Unless `late`, the pairs per (expert, chunk) too (`K_rank` is then loaded)."""
    ii = tl.arange(0, SUB * KP)
    running = tl.zeros([BLOCK_L], dtype=tl.int32)
    for start in range(first, last, SUB):
        tt = start + ii // KP
        j = ii % KP
        expert, pair_mine = _step_pairs(row, tt, j, n_tok, rank, L, K)
        same = (expert[None, :] == expert[:, None]) & pair_mine[None, :] & (ii[None, :] < ii[:, None])
        q = tl.sum(same.to(tl.int32), axis=1) + tl.gather(running, expert, 0)
        tl.store(q_ptr + (s * T + tt).to(tl.int64) * K + j, q, mask=pair_mine)
        running += tl.histogram(expert, BLOCK_L, mask=pair_mine)
        if not late:
            _pair_chunk_counts(expert, pair_mine, tt, start, n_tok, K_rank, pair_counts_ptr, s, L, MC, SUB, BLOCK_L)
    return running


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
    # every load the block's first results need is issued at once: T_s, the chunk count (unless the previous launch
    # writes it) and the ids, read up to T_max and cut at T_s afterwards (not a load that waits for T_s)
    n_tok = tl.load(tokens_ptr + s * tokens_stride)
    late: tl.constexpr = WAIT == WAIT_BEFORE_CHUNKS
    if late:
        K_rank = 0   # loaded after the wait
    else:
        K_rank = tl.load(chunks_ptr + rank * 4)
    first = b * BT
    t = first + tl.arange(0, BT)
    jj = tl.arange(0, KP)
    row = ids_ptr + s.to(tl.int64) * ids_stride
    ids = tl.load(row + t[:, None] * K + jj[None, :], mask=(t < T)[:, None] & (jj[None, :] < K), other=-1)
    ids = tl.where((t < n_tok)[:, None], ids, -1)
    mine = (ids >= rank * L) & (ids < (rank + 1) * L)
    hit = (tl.sum(mine.to(tl.int32), axis=1) > 0).to(tl.int32)
    tl.store(recv_local_ptr + s * T + t, tl.cumsum(hit, axis=0) - hit, mask=hit != 0)
    tl.store(recv_hist_ptr + s * NB + b, tl.sum(hit, axis=0))
    if not late:
        _arrivals(t, hit, K_rank, n_tok, arrival_ptr, s, MC)
    # pairs, SUB tokens at a time: rank among the step's earlier pairs of the same expert + the block's running count;
    # a block of at most SHORT tokens (decode) in one step of SHORT: its pairwise compare is (SUB / SHORT)^2 times
    # smaller, and it was most of the scan's time at one token (sm_90 SASS of a [128 x 128] compare: ~1300 of the
    # kernel's ~2300 instructions)
    SHORT: tl.constexpr = max(SUB // 4, 1)
    le = tl.arange(0, BLOCK_L)
    last = tl.minimum(first + BT, n_tok)
    if last - first <= SHORT:
        running = _rank_pairs(row, first, last, n_tok, rank, L, K_rank, q_ptr, pair_counts_ptr, s, T,
                              K, KP, MC, SHORT, BLOCK_L, late)
    else:
        running = _rank_pairs(row, first, last, n_tok, rank, L, K_rank, q_ptr, pair_counts_ptr, s, T,
                              K, KP, MC, SUB, BLOCK_L, late)
    tl.store(pair_hist_ptr + (s * NB + b) * L + le, running, mask=le < L)
    if late:
        _wait_for_chunks(WAIT)
        K_rank = tl.load(chunks_ptr + rank * 4)
        _arrivals(t, hit, K_rank, n_tok, arrival_ptr, s, MC)
        ii = tl.arange(0, SUB * KP)
        for start in range(first, last, SUB):
            tt = start + ii // KP
            expert, pair_mine = _step_pairs(row, tt, ii % KP, n_tok, rank, L, K)
            _pair_chunk_counts(expert, pair_mine, tt, start, n_tok, K_rank, pair_counts_ptr, s, L, MC, SUB, BLOCK_L)


@triton.jit
def token_destinations(ids, P, L, BLOCK_P: tl.constexpr):
    """[T, BLOCK_P] bool: token t (ids [T, k]) has an expert on rank d (L local experts per rank, P ranks). Ids
    outside [0, P * L) go nowhere (-1: none; >= E: the counts kernel refuses the call)."""
    pp = tl.arange(0, BLOCK_P)
    owner = tl.where((ids >= 0) & (ids < P * L), ids // L, -1)
    return tl.sum((owner[:, :, None] == pp[None, None, :]).to(tl.int32), axis=1) > 0


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
    early: tl.constexpr = WAIT != WAIT_BEFORE_CHUNKS
    if early:   # the chunk counts are not the previous launch's: loaded with the rest, not after the stores
        K_dest = tl.load(chunks_ptr + pp * 4, mask=pp < P, other=1)
    # the ids up to T_max, cut at T afterwards: one round of loads with T's, not one after it
    ids = tl.load(ids_ptr + rank.to(tl.int64) * ids_stride + t[:, None] * K + jj[None, :],
                  mask=(t < T)[:, None] & (jj[None, :] < K), other=-1)
    ids = tl.where((t < n_tok)[:, None], ids, -1)
    goes = token_destinations(ids, P, L, BLOCK_P)                                        # [BT, P]
    hit = goes.to(tl.int32)
    tl.store(send_local_ptr + pp[None, :] * T + t[:, None], tl.cumsum(hit, axis=0) - hit, mask=goes)
    tl.store(send_hist_ptr + pp * NB + b, tl.sum(hit, axis=0), mask=pp < P)
    tl.store(mask_ptr + t, tl.sum(tl.where(goes, 1 << pp[None, :], 0), axis=1), mask=t < T)
    if not early:
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
def scan_kernel(ids_ptr, ids_stride, chunks_ptr, tokens_ptr, tokens_stride, q_ptr, pair_hist_ptr, pair_counts_ptr,
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

