"""Persistent grouped GEMMs of the expert MLP for Hopper, as two launches: GEMM0 + SiLU-mul, then GEMM1.

Shape legend: P = rows (token, expert pairs) on this rank, H = hidden size, I = intermediate size, E_local = local
experts, BM/BN/BK = tile sizes.

Layout the caller provides: the rows of every local expert contiguous and in expert order, `a` [P, H] bf16 with
expert e's rows at [expert_offsets[e], expert_offsets[e + 1]) (`expert_offsets` int32 [E_local + 1], a prefix sum
that starts at 0; rows past expert_offsets[-1] are never read into an output). `h` [P, I] and `y` [P, H] use the same
row order.

How the kernels are built (Hopper, Triton 3.6):
- Grid = number of SMs; each CTA walks a flat list of (M tile, N tile) work items. M tiles come from a tile table
  built on the device (`build_tile_table`, no host sync): ceil(rows_e / BM) tiles per expert, each with its expert,
  first row and the expert's end row, so no tile spans two experts and the padding is under one tile per expert
  (`split_tail`: tails of at most BM/2 rows run as BM/2-row tiles after the full ones, in the same launch).
- Every operand comes through the bulk tensor copy engine (TMA) from host-built descriptors: A rows of a tile past
  the expert's end read the next expert's rows (or zeros past P); they land in accumulator rows that are never
  stored. K tails are zero-filled by the descriptor bounds. GEMM1 reads `h` through TMA: it must have been written
  by an earlier launch (a separate launch orders the generic-proxy stores before the copy engine's reads).
  `grouped_gemm0(gather=)`: A's rows come from any rows of a source buffer (row m = a[gather[m]], rows past the
  expert's end clamped to its last), by pointer loads that the pipeliner turns into cp.async, so the caller need not
  copy them into expert order first (KernelConfig.gemm0_gather; the weights stay on TMA).
- GEMM0 multiplies gate and up columns in ONE wide MMA: w13 is re-laid once at load time (`interleave_w13`) so that
  gate row j and up row j are neighbours; a [BN, BK] block of it is BN/2 gate-up pairs, the fp32 accumulator's
  column pairs are in the same thread, and `tl.split` separates them for the SiLU-mul epilogue for free.
- The epilogue (GemmConfig.epilogue) stores through masked pointer stores, or through TMA from a descriptor made on
  the device per tile whose row bound is the expert's end (TMA clips the rows past it; EPILOGUE_TMA_HALVES: in two
  column halves through one half-size shared buffer, so GEMM1's 128x256 tiles keep 4 pipeline stages within the
  227 KB of shared memory), or TMA for full tiles and masked stores for tails (not with `flatten`: Triton 3.6 fails
  to compile that branch inside a flattened loop).
- `flatten` pipelines the tile loop and the K loop as one, so the next tile's loads overlap this tile's epilogue.
  `warp_specialize` compiles on sm_90 with Triton 3.6 but yields the same code as without (no producer/consumer
  split on Hopper in this Triton); it is kept for newer Tritons and measured, not used by default.
- Programmatic dependent launch: a CTA waits for the previous launch first (sync.pdl_wait) and lets the next
  launch's CTAs be scheduled only after its tiles (sync.pdl_release), so they do not sit beside the tiles for the
  whole GEMM. Seen on an H200: DeepSeek-V3's GEMM0 at 128 tokens (per-rank work of EP=2, 16x128x128 tiles, 147 KB
  of shared memory, room for a GEMM1 CTA) took 2439 us in a call with GEMM1's CTAs resident from its start, 1679 us
  alone (bench/results/h200-4d666c5); the A/B of the two releases in calls was neutral (0.97-1.03x on three models,
  1-2048 tokens, bench/results/h200-185e40c), so the slowdown had another cause too (that config was dropped from
  the table). `early_release` keeps the early release, for A/B runs. The layer launches both GEMMs without PDL
  (`pdl=False`, KernelConfig.grouped_pdl): a GEMM0 launched programmatically after the gather launch ran 1.4-1.6x
  its time alone at prefill sizes, and 1.0x launched plainly (bench/results/h200-de378c8).
- Work order: GROUP_M consecutive M tiles (mostly one expert's rows) sweep the N tiles together, so a weight block
  is read from HBM about once and reused from L2 by the group.
- Stream-K (GemmConfig.stream_k, either GEMM): at decode sizes a launch has few tiles, each a long walk over K, and
  whole tiles leave SMs idle (Qwen3-30B-A3B's GEMM0 at 1 token per rank: 96 tiles of 16 K steps on 132 SMs, so 16
  steps of time where 1536 / 132 = 11.6 would do; DeepSeek-V3's GEMM1: 448 tiles, 3.4 waves). The (tile, K step) pairs
  are numbered tile by tile, and CTA p takes the steps [p * per, (p + 1) * per), per = ceil(steps / NUM_SMS), walking
  its range from its end: a tile it ends inside (whose later steps belong to the next CTA) comes first, and its part
  is stored in the CTA's slot of an fp32 scratch [NUM_SMS, BM * BN] and flagged (release); the CTA that holds a tile's
  LAST step adds the parts of the CTAs before it, nearest first (a bounded acquire wait on each flag, which it clears
  for the next launch), then runs the epilogue (GEMM0's SiLU-mul, GEMM1's routing weight). A CTA publishes at most one
  part (the tile at the end of its range), first thing, and waits only for parts its lower neighbours published first
  thing, so no wait depends on another wait; the sum's order is fixed by the partition, so the result is
  deterministic. Under the interpreter, programs run in pid order: every part is published before it is read.

Configurations (GemmConfig, the analytical defaults, the tuned tables): kernels/gemm_configs.py.

Everything also runs under TRITON_INTERPRET=1 with DOT_FP32 (the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from weave_moe.backends.weave.config import DEFAULT_TIMEOUT_S
from weave_moe.backends.weave.kernels import sync
from weave_moe.backends.weave.kernels.gemm_configs import CLIPPED_EPILOGUES, EPILOGUE_TMA, GemmConfig
from weave_moe.backends.weave.kernels.sync import STATUS_WORDS
from weave_moe.backends.weave.kernels.grouped_tiles import TileTable, build_tile_table, build_tile_table_torch
from weave_moe.backends.weave.kernels import ws_decode, ws_gemm

__all__ = ["TileTable", "build_tile_table", "build_tile_table_torch", "interleave_w13", "grouped_gemm0",
           "grouped_gemm1", "launch_gemm", "stream_k_buffers", "StreamKScratch"]

#: the deadline of a stream-K GEMM0's waits when the caller gives none (the layer passes its own)
DEFAULT_TIMEOUT_NS = int(DEFAULT_TIMEOUT_S * 1e9)

def interleave_w13(w13: torch.Tensor) -> torch.Tensor:
    """[E_local, 2I, H] (gate rows, then up rows) -> [E_local, 2I, H] with row 2j = gate j, row 2j + 1 = up j."""
    num_experts, two_i, hidden = w13.shape
    return w13.view(num_experts, 2, two_i // 2, hidden).transpose(1, 2).reshape(num_experts, two_i, hidden).contiguous()


@triton.jit
def _tile_coords(work, num_tiles, num_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * num_n
    group = work // per_group
    first = group * GROUP_M
    size = tl.minimum(num_tiles - first, GROUP_M)
    tile = first + (work % per_group) % size
    n = (work % per_group) // size
    return tile, n


@triton.jit
def _masked_store(out_ptr, values, m_start, m_end, n_start, num_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * num_cols + offs_n[None, :]
    tl.store(ptrs, values, mask=(offs_m < m_end)[:, None] & (offs_n < num_cols)[None, :])


@triton.jit
def _store_tile(out_ptr, out_desc, values, m_start, m_end, n_start, num_cols,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPILOGUE: tl.constexpr):
    """out[m_start + m, n_start + n] = values[m, n] for rows < m_end and columns < num_cols (EPILOGUE: GemmConfig)."""
    values = values.to(out_ptr.dtype.element_ty)
    if EPILOGUE == 3:
        HALF: tl.constexpr = BLOCK_N // 2
        clipped = tl.make_tensor_descriptor(out_ptr, shape=[m_end, num_cols], strides=[num_cols, 1],
                                            block_shape=[BLOCK_M, HALF])
        low, high = tl.split(tl.permute(tl.reshape(values, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        clipped.store([m_start, n_start], low)
        clipped.store([m_start, n_start + HALF], high)
    elif EPILOGUE == 2:
        clipped = tl.make_tensor_descriptor(out_ptr, shape=[m_end, num_cols], strides=[num_cols, 1],
                                            block_shape=[BLOCK_M, BLOCK_N])
        clipped.store([m_start, n_start], values)
    elif EPILOGUE == 1:
        if m_end - m_start >= BLOCK_M:
            out_desc.store([m_start, n_start], values)  # columns past num_cols are clipped by the descriptor
        else:
            _masked_store(out_ptr, values, m_start, m_end, n_start, num_cols, BLOCK_M, BLOCK_N)
    else:
        _masked_store(out_ptr, values, m_start, m_end, n_start, num_cols, BLOCK_M, BLOCK_N)


@triton.jit
def _section_work(pid, work_before, NUM_SMS: tl.constexpr):
    """First work index of this CTA in a section that follows `work_before` items: the round-robin over CTAs goes on
    across sections, so the CTAs that ran out of section-0 work first take section 1's first items."""
    return ((pid - work_before) % NUM_SMS + NUM_SMS) % NUM_SMS


@triton.jit
def _a_block(a_desc, a_ptr, rows, m_start, k, K, BLOCK_K: tl.constexpr, GATHER_A: tl.constexpr):
    """The A block of a tile at K offset k: rows [m_start, +BLOCK_M) through TMA, or with GATHER_A rows `rows` (int64
    [BLOCK_M] row indices of a [*, K]) by pointer loads, the K tail zero-filled."""
    if GATHER_A:
        offs_k = k + tl.arange(0, BLOCK_K)
        block = tl.load(a_ptr + rows[:, None] * K + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
    else:
        block = a_desc.load([m_start, k])
    return block


@triton.jit
def _gathered_rows(gather_ptr, m_start, m_end, BLOCK_M: tl.constexpr, GATHER_A: tl.constexpr):
    """With GATHER_A, the rows of a that tile rows [m_start, +BLOCK_M) read: gather[row], rows past the expert's end
    clamped to its last (read, never stored); else unused."""
    rows = m_start
    if GATHER_A:
        rows = tl.load(gather_ptr + tl.minimum(m_start + tl.arange(0, BLOCK_M), m_end - 1)).to(tl.int64)
    return rows


@triton.jit
def _desc_k_loop(a_desc, a_ptr, rows, w_desc, m_start, w_row, K, k_start, k_end, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WS_INNER: tl.constexpr, DOT_FP32: tl.constexpr,
                 GATHER_A: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32 = A rows [m_start, +BLOCK_M) @ W rows [w_row, +BLOCK_N)^T over K offsets
    [k_start, k_end) (0 and K: all of it), both through TMA (A: `_a_block`)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, warp_specialize=WS_INNER):
        a = _a_block(a_desc, a_ptr, rows, m_start, k, K, BLOCK_K, GATHER_A)
        w = w_desc.load([w_row, k])
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w.T, acc)
    return acc


@triton.jit
def _tile_rows(tiles_ptr, width, column0, tile):
    """(expert, first row, the expert's end row) of M tile `tile` in section `column0` of a TileTable."""
    expert = tl.load(tiles_ptr + column0 + tile)
    m_start = tl.load(tiles_ptr + width + column0 + tile)
    m_end = tl.load(tiles_ptr + 2 * width + column0 + tile)
    return expert, m_start, m_end


@triton.jit
def _store_h(h_ptr, h_desc, gate, up, m_start, m_end, n_start, I, BLOCK_M: tl.constexpr, HALF_N: tl.constexpr,
             EPILOGUE: tl.constexpr):
    """GEMM0's epilogue: h = silu(gate) * up."""
    _store_tile(h_ptr, h_desc, gate * tl.sigmoid(gate) * up, m_start, m_end, n_start, I, BLOCK_M, HALF_N, EPILOGUE)


@triton.jit
def _store_y(y_ptr, y_desc, scale_ptr, acc, m_start, m_end, n_start, H, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, HAS_SCALE: tl.constexpr, EPILOGUE: tl.constexpr):
    """GEMM1's epilogue: y = acc, times each row's routing weight with HAS_SCALE."""
    if HAS_SCALE:
        rows = tl.minimum(m_start + tl.arange(0, BLOCK_M), m_end - 1)
        acc = acc * tl.load(scale_ptr + rows)[:, None]
    _store_tile(y_ptr, y_desc, acc, m_start, m_end, n_start, H, BLOCK_M, BLOCK_N, EPILOGUE)


@triton.jit
def _gemm0_tile(a_desc, a_ptr, gather_ptr, w_desc, h_ptr, h_desc, tiles_ptr, width, column0, num_tiles, num_n, work,
                H, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                INTERLEAVED: tl.constexpr, EPILOGUE: tl.constexpr, WS_INNER: tl.constexpr, DOT_FP32: tl.constexpr,
                GATHER_A: tl.constexpr):
    HALF_N: tl.constexpr = BLOCK_N // 2
    tile, n = _tile_coords(work, num_tiles, num_n, GROUP_M)
    expert, m_start, m_end = _tile_rows(tiles_ptr, width, column0, tile)
    n_start = n * HALF_N
    rows = _gathered_rows(gather_ptr, m_start, m_end, BLOCK_M, GATHER_A)
    if INTERLEAVED:
        acc = _desc_k_loop(a_desc, a_ptr, rows, w_desc, m_start, expert * 2 * I + 2 * n_start, H, 0, H,
                           BLOCK_M, BLOCK_N, BLOCK_K, WS_INNER, DOT_FP32, GATHER_A)
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, HALF_N, 2)))
    else:
        gate_row = expert * 2 * I + n_start
        gate = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
        for k in tl.range(0, H, BLOCK_K, warp_specialize=WS_INNER):
            a = _a_block(a_desc, a_ptr, rows, m_start, k, H, BLOCK_K, GATHER_A)
            wg = w_desc.load([gate_row, k])
            wu = w_desc.load([gate_row + I, k])
            if DOT_FP32:
                a = a.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            gate = tl.dot(a, wg.T, gate)
            up = tl.dot(a, wu.T, up)
    _store_h(h_ptr, h_desc, gate, up, m_start, m_end, n_start, I, BLOCK_M, HALF_N, EPILOGUE)


@triton.jit
def _stream_k(a_desc, a_ptr, gather_ptr, w_desc, out_ptr, out_desc, scale_ptr, tiles_ptr, width, num_tiles, num_n,
              pid, partial_ptr, flags_ptr, status_ptr, timeout_ns, H, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, EPILOGUE: tl.constexpr,
              DOT_FP32: tl.constexpr, GATHER_A: tl.constexpr, GEMM: tl.constexpr, HAS_SCALE: tl.constexpr):
    """A GEMM's tiles as one range of K steps per CTA (GemmConfig.stream_k; module docstring, "Stream-K"). GEMM 0:
    A = a rows (or the gather rows), W = the interleaved w13, out = h with the SiLU-mul epilogue; GEMM 1: A = h,
    W = w2, out = y (times the routing weight with HAS_SCALE)."""
    HALF_N: tl.constexpr = BLOCK_N // 2
    K = H if GEMM == 0 else I
    k_steps = tl.cdiv(K, BLOCK_K)
    total = num_tiles * num_n * k_steps
    per = tl.cdiv(total, NUM_SMS)
    start = pid * per
    hi = tl.minimum(start + per, total)
    slot = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    while hi > start:   # this CTA's range, last tile first
        work = (hi - 1) // k_steps
        first = work * k_steps          # the tile's first K step in the flat order
        lo = tl.maximum(start, first)
        tile, n = _tile_coords(work, num_tiles, num_n, GROUP_M)
        expert, m_start, m_end = _tile_rows(tiles_ptr, width, 0, tile)
        if GEMM == 0:
            n_start = n * HALF_N
            w_row = expert * 2 * I + 2 * n_start
            rows = _gathered_rows(gather_ptr, m_start, m_end, BLOCK_M, GATHER_A)
        else:
            n_start = n * BLOCK_N
            w_row = expert * H + n_start
            rows = m_start
        acc = _desc_k_loop(a_desc, a_ptr, rows, w_desc, m_start, w_row, K, (lo - first) * BLOCK_K,
                           (hi - first) * BLOCK_K, BLOCK_M, BLOCK_N, BLOCK_K, False, DOT_FP32, GATHER_A)
        if hi - first < k_steps:
            # the tile's later K steps are the next CTA's: publish this part in this CTA's slot
            tl.store(partial_ptr + pid * (BLOCK_M * BLOCK_N) + slot, acc)
            sync.signal_store(flags_ptr + pid, 1, False)
        else:
            # this CTA holds the tile's last K step: add the parts of the CTAs before it, nearest first
            j = pid - 1
            covered = lo
            while covered > first:
                sync.wait_at_least(flags_ptr + j, 1, status_ptr, sync.ERROR_STREAM_K_TIMEOUT, j, timeout_ns, False)
                acc += tl.load(partial_ptr + j * (BLOCK_M * BLOCK_N) + slot, cache_modifier=".cg")
                tl.atomic_xchg(flags_ptr + j, 0, sem="relaxed", scope="gpu")   # for the next launch
                covered = tl.maximum(j * per, first)
                j -= 1
            if GEMM == 0:
                gate, up = tl.split(tl.reshape(acc, (BLOCK_M, HALF_N, 2)))
                _store_h(out_ptr, out_desc, gate, up, m_start, m_end, n_start, I, BLOCK_M, HALF_N, EPILOGUE)
            else:
                _store_y(out_ptr, out_desc, scale_ptr, acc, m_start, m_end, n_start, H, BLOCK_M, BLOCK_N, HAS_SCALE,
                         EPILOGUE)
        hi = lo


@triton.jit(do_not_specialize=["max_tiles", "timeout_ns"])
def _gemm0_kernel(a_desc, a_tail_desc, a_ptr, gather_ptr, w_desc, h_ptr, h_desc, tiles_ptr, num_tiles_ptr, max_tiles,
                  H, I, partial_ptr, flags_ptr, status_ptr, timeout_ns, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  NUM_SMS: tl.constexpr, INTERLEAVED: tl.constexpr, EPILOGUE: tl.constexpr,
                  SPLIT_TAIL: tl.constexpr, WS_OUTER: tl.constexpr, WS_INNER: tl.constexpr, FLATTEN: tl.constexpr,
                  DOT_FP32: tl.constexpr, EARLY_RELEASE: tl.constexpr, GATHER_A: tl.constexpr,
                  STREAM_K: tl.constexpr):
    """h[m, j] = silu(a[m] . gate_j) * (a[m] . up_j) over every tile of the table.

    a_desc: [P, H] block [BM, BK] (a_tail_desc: block [BM / 2, BK], section 1 of a split table); w_desc: w13 as
    [E_local * 2I, H], block [BN, BK] (interleaved) or [BN / 2, BK]; h: [P, I] bf16 (h_desc block [BM, BN / 2]);
    tiles: int32 [3, 2 * max_tiles] (TileTable). GATHER_A: row m is a_ptr's row gather_ptr[m] ([*, H], pointer
    loads; the descriptors of a are then unused). EARLY_RELEASE: the next launch's CTAs may be scheduled from the
    start (sync.pdl_enter) instead of after this CTA's tiles. STREAM_K: `_stream_k` (partial_ptr: fp32
    [NUM_SMS, BM * BN], flags_ptr: int32 [NUM_SMS], zero between launches; status_ptr: the status word its bounded
    waits write on a timeout, timeout_ns their deadline); else unused.
    """
    sync.pdl_wait()
    if EARLY_RELEASE:
        sync.pdl_release()
    pid = tl.program_id(0)
    width = 2 * max_tiles
    num_n = tl.cdiv(I, BLOCK_N // 2)
    num_tiles = tl.load(num_tiles_ptr)
    num_work = num_tiles * num_n
    if STREAM_K:
        _stream_k(a_desc, a_ptr, gather_ptr, w_desc, h_ptr, h_desc, h_ptr, tiles_ptr, width, num_tiles, num_n, pid,
                  partial_ptr, flags_ptr, status_ptr, timeout_ns, H, I, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS,
                  EPILOGUE, DOT_FP32, GATHER_A, 0, False)
    else:
        for work in tl.range(pid, num_work, NUM_SMS, flatten=FLATTEN, warp_specialize=WS_OUTER):
            _gemm0_tile(a_desc, a_ptr, gather_ptr, w_desc, h_ptr, h_desc, tiles_ptr, width, 0, num_tiles, num_n, work,
                        H, I, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, INTERLEAVED, EPILOGUE, WS_INNER, DOT_FP32, GATHER_A)
        if SPLIT_TAIL:
            num_tails = tl.load(num_tiles_ptr + 1)
            for work in tl.range(_section_work(pid, num_work, NUM_SMS), num_tails * num_n, NUM_SMS, flatten=FLATTEN):
                _gemm0_tile(a_tail_desc, a_ptr, gather_ptr, w_desc, h_ptr, h_desc, tiles_ptr, width, max_tiles,
                            num_tails, num_n, work, H, I, BLOCK_M // 2, BLOCK_N, BLOCK_K, GROUP_M, INTERLEAVED,
                            EPILOGUE, WS_INNER, DOT_FP32, GATHER_A)
    if not EARLY_RELEASE:
        sync.pdl_release()


@triton.jit
def _gemm1_tile(h_desc, w_desc, y_ptr, y_desc, scale_ptr, tiles_ptr, width, column0, num_tiles, num_n, work, H, I,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                HAS_SCALE: tl.constexpr, EPILOGUE: tl.constexpr, WS_INNER: tl.constexpr, DOT_FP32: tl.constexpr):
    tile, n = _tile_coords(work, num_tiles, num_n, GROUP_M)
    expert, m_start, m_end = _tile_rows(tiles_ptr, width, column0, tile)
    n_start = n * BLOCK_N
    acc = _desc_k_loop(h_desc, y_ptr, m_start, w_desc, m_start, expert * H + n_start, I, 0, I, BLOCK_M, BLOCK_N,
                       BLOCK_K, WS_INNER, DOT_FP32, False)
    _store_y(y_ptr, y_desc, scale_ptr, acc, m_start, m_end, n_start, H, BLOCK_M, BLOCK_N, HAS_SCALE, EPILOGUE)


@triton.jit(do_not_specialize=["max_tiles", "timeout_ns"])
def _gemm1_kernel(h_desc, h_tail_desc, w_desc, y_ptr, y_desc, scale_ptr, tiles_ptr, num_tiles_ptr, max_tiles, H, I,
                  partial_ptr, flags_ptr, status_ptr, timeout_ns,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  NUM_SMS: tl.constexpr, HAS_SCALE: tl.constexpr, EPILOGUE: tl.constexpr,
                  SPLIT_TAIL: tl.constexpr, WS_OUTER: tl.constexpr, WS_INNER: tl.constexpr, FLATTEN: tl.constexpr,
                  DOT_FP32: tl.constexpr, EARLY_RELEASE: tl.constexpr, STREAM_K: tl.constexpr):
    """y[m] = scale[m] * (h[m] . w2[expert]^T) over every tile of the table (scale = 1 without HAS_SCALE).

    h_desc: [P, I] block [BM, BK] (h_tail_desc: block [BM / 2, BK]); w_desc: w2 as [E_local * H, I], block
    [BN, BK]; y: [P, H] bf16 (y_desc block [BM, BN]); scale: fp32 [P] (the routing weight of each row).
    EARLY_RELEASE, STREAM_K (with partial_ptr, flags_ptr, status_ptr, timeout_ns): as in _gemm0_kernel.
    """
    sync.pdl_wait()
    if EARLY_RELEASE:
        sync.pdl_release()
    pid = tl.program_id(0)
    width = 2 * max_tiles
    num_n = tl.cdiv(H, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    num_work = num_tiles * num_n
    if STREAM_K:
        _stream_k(h_desc, y_ptr, y_ptr, w_desc, y_ptr, y_desc, scale_ptr, tiles_ptr, width, num_tiles, num_n, pid,
                  partial_ptr, flags_ptr, status_ptr, timeout_ns, H, I, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS,
                  EPILOGUE, DOT_FP32, False, 1, HAS_SCALE)
    else:
        for work in tl.range(pid, num_work, NUM_SMS, flatten=FLATTEN, warp_specialize=WS_OUTER):
            _gemm1_tile(h_desc, w_desc, y_ptr, y_desc, scale_ptr, tiles_ptr, width, 0, num_tiles, num_n, work, H, I,
                        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, HAS_SCALE, EPILOGUE, WS_INNER, DOT_FP32)
        if SPLIT_TAIL:
            num_tails = tl.load(num_tiles_ptr + 1)
            for work in tl.range(_section_work(pid, num_work, NUM_SMS), num_tails * num_n, NUM_SMS, flatten=FLATTEN):
                _gemm1_tile(h_tail_desc, w_desc, y_ptr, y_desc, scale_ptr, tiles_ptr, width, max_tiles, num_tails,
                            num_n, work, H, I, BLOCK_M // 2, BLOCK_N, BLOCK_K, GROUP_M, HAS_SCALE, EPILOGUE, WS_INNER,
                            DOT_FP32)
    if not EARLY_RELEASE:
        sync.pdl_release()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter runs programs one after another: a few programs still walk the persistent loop


def _check(name, tensor, shape, dtype):
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype or not tensor.is_contiguous():
        raise ValueError(f"{name}: expected contiguous {dtype} {tuple(shape)}, given {tensor.dtype} "
                         f"{tuple(tensor.shape)}{'' if tensor.is_contiguous() else ' (not contiguous)'}")


def _check_tiles(tiles: TileTable, config: GemmConfig):
    if tiles.block_m != config.block_m:
        raise ValueError(f"tiles.block_m: expected config.block_m={config.block_m}, given {tiles.block_m}")
    if tiles.split_tail != config.split_tail:
        raise ValueError(f"tiles.split_tail: expected config.split_tail={config.split_tail}, given {tiles.split_tail}")
    if config.split_tail and config.epilogue == EPILOGUE_TMA:
        raise ValueError("config.epilogue: EPILOGUE_TMA has one store descriptor, of full tiles; split_tail needs "
                         "EPILOGUE_MASKED, EPILOGUE_TMA_CLIPPED or EPILOGUE_TMA_HALVES")


def stream_k_buffers(slots: int, slot_elements: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A stream-K GEMM's scratch for one launch: (fp32 [slots * slot_elements] parts, int32 [slots] zero flags). A
    caller that launches many keeps one pair per size (`StreamKScratch`; the kernel leaves the flags zero again)."""
    return (torch.empty(slots * slot_elements, dtype=torch.float32, device=device),
            torch.zeros(slots, dtype=torch.int32, device=device))


class StreamKScratch:
    """`stream_k_scratch` for launches one after another on one stream: one `stream_k_buffers` pair per size, made at
    first use (a caller that captures CUDA graphs makes its launches once outside capture first)."""

    def __init__(self, device):
        self.device, self.buffers = device, {}

    def __call__(self, slots: int, slot_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (slots, slot_elements)
        if key not in self.buffers:
            self.buffers[key] = stream_k_buffers(slots, slot_elements, self.device)
        return self.buffers[key]


def _stream_k_args(config: GemmConfig, num_sms: int, device, unused: torch.Tensor, scratch, status,
                   timeout_ns) -> tuple:
    """(parts, flags, status, timeout_ns) of a launch: for a stream-K config its scratch (`scratch(slots, elements)`,
    else new buffers) and status word (else a new zero word) checked; `unused` tensors otherwise."""
    if not config.stream_k:
        return unused, unused, unused, timeout_ns
    elements = config.block_m * config.block_n
    partials, flags = (scratch or functools.partial(stream_k_buffers, device=device))(num_sms, elements)
    _check("stream-K parts", partials, (num_sms * elements,), torch.float32)
    _check("stream-K flags", flags, (num_sms,), torch.int32)
    if status is None:
        status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=device)
    elif status.dtype != torch.int32 or status.numel() < STATUS_WORDS:
        raise ValueError(f"status: expected int32 [>= {STATUS_WORDS}], given {status.dtype} {tuple(status.shape)}")
    return partials, flags, status, timeout_ns


def _gemm0_launch(a, w13, h, tiles: TileTable, config: GemmConfig, dot_fp32: bool = False, num_sms: int | None = None,
                  early_release: bool = False, gather: torch.Tensor | None = None, pdl: bool = True,
                  stream_k_scratch=None, status: torch.Tensor | None = None, timeout_ns: int = DEFAULT_TIMEOUT_NS):
    """(kernel, grid, args, kwargs) of one GEMM0 launch (see grouped_gemm0); `num_sms` overrides the grid (CTAs,
    also the NUM_SMS constexpr), which is otherwise the device's SM count (a compile-only test passes the GPU's)."""
    hidden = a.shape[-1]
    rows = a.shape[0] if gather is None else h.shape[0]   # with gather, a holds the source rows in any order
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    _check("a", a, (a.shape[0], hidden), a.dtype)
    if gather is not None and (gather.dim() != 1 or gather.dtype != torch.int32 or not gather.is_contiguous()):
        raise ValueError(f"gather: expected contiguous int32 [>= P rows read], given {gather.dtype} "
                         f"{tuple(gather.shape)}")
    _check("w13", w13, (num_experts, two_i, hidden), a.dtype)
    _check("h", h, (rows, inter), a.dtype)
    _check_tiles(tiles, config)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    w_block = [bn, bk] if config.interleaved else [bn // 2, bk]
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    a_tail_desc = TensorDescriptor.from_tensor(a, [bm // 2, bk])
    w_desc = TensorDescriptor.from_tensor(w13.view(num_experts * two_i, hidden), w_block)
    h_desc = TensorDescriptor.from_tensor(h, [bm, bn // 2])
    num_sms = num_sms or _num_sms(a.device)
    args = (a_desc, a_tail_desc, a, tiles.table if gather is None else gather, w_desc, h, h_desc, tiles.table,
            tiles.num_tiles, tiles.max_tiles, hidden, inter,
            *_stream_k_args(config, num_sms, a.device, tiles.table, stream_k_scratch, status, timeout_ns))
    kwargs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m, NUM_SMS=num_sms,
                  INTERLEAVED=config.interleaved, EPILOGUE=config.epilogue, SPLIT_TAIL=tiles.split_tail,
                  WS_OUTER=config.warp_specialize == 1,
                  WS_INNER=config.warp_specialize == 2, FLATTEN=config.flatten, DOT_FP32=dot_fp32,
                  EARLY_RELEASE=early_release, GATHER_A=gather is not None, STREAM_K=config.stream_k,
                  num_warps=config.num_warps, num_stages=config.num_stages, **sync.launch_options(pdl))
    return _gemm0_kernel, (num_sms,), args, kwargs


def _gemm1_launch(h, w2, y, tiles: TileTable, config: GemmConfig, scale=None, dot_fp32: bool = False,
                  num_sms: int | None = None, early_release: bool = False, pdl: bool = True, stream_k_scratch=None,
                  status: torch.Tensor | None = None, timeout_ns: int = DEFAULT_TIMEOUT_NS):
    """(kernel, grid, args, kwargs) of one GEMM1 launch (see grouped_gemm1; `num_sms` as in _gemm0_launch)."""
    rows, inter = h.shape
    num_experts, hidden, _ = w2.shape
    _check("h", h, (rows, inter), h.dtype)
    _check("w2", w2, (num_experts, hidden, inter), h.dtype)
    _check("y", y, (rows, hidden), h.dtype)
    if scale is not None:
        _check("scale", scale, (rows,), torch.float32)
    _check_tiles(tiles, config)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    h_desc = TensorDescriptor.from_tensor(h, [bm, bk])
    h_tail_desc = TensorDescriptor.from_tensor(h, [bm // 2, bk])
    w_desc = TensorDescriptor.from_tensor(w2.view(num_experts * hidden, inter), [bn, bk])
    y_desc = TensorDescriptor.from_tensor(y, [bm, bn])
    num_sms = num_sms or _num_sms(h.device)
    args = (h_desc, h_tail_desc, w_desc, y, y_desc, scale if scale is not None else y, tiles.table, tiles.num_tiles,
            tiles.max_tiles, hidden, inter,
            *_stream_k_args(config, num_sms, h.device, tiles.table, stream_k_scratch, status, timeout_ns))
    kwargs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m, NUM_SMS=num_sms,
                  HAS_SCALE=scale is not None, EPILOGUE=config.epilogue, SPLIT_TAIL=tiles.split_tail,
                  WS_OUTER=config.warp_specialize == 1,
                  WS_INNER=config.warp_specialize == 2, FLATTEN=config.flatten, DOT_FP32=dot_fp32,
                  EARLY_RELEASE=early_release, STREAM_K=config.stream_k, num_warps=config.num_warps,
                  num_stages=config.num_stages, **sync.launch_options(pdl))
    return _gemm1_kernel, (num_sms,), args, kwargs


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _launch(kernel, grid, args, kwargs, needs_scratch: bool, scratch=None):
    """Launch; a kernel that makes descriptors on the device needs Triton's global scratch allocator: `scratch`
    when given, else the caller's (`triton.set_allocator`), else a torch one, for this launch only (Triton keeps it
    in a ContextVar)."""
    from triton.runtime import _allocation

    if not needs_scratch or (scratch is None and _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR):
        kernel[grid](*args, **kwargs)
        return
    token = _allocation._allocator.set(scratch or _torch_scratch)
    try:
        kernel[grid](*args, **kwargs)
    finally:
        _allocation._allocator.reset(token)


def launch_gemm(gemm: int, config, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tiles: TileTable,
                gather: torch.Tensor | None = None, chained: bool = False, preload: bool = False, **launch) -> None:
    """One grouped GEMM with the kernel of `config` (gemm_configs.KERNELS): `gemm` 0 (a [P, H] or, with `gather`,
    rows of a through it; w the interleaved w13; out h) or 1 (a = h, w = w2, out y). A `ws_gemm.WsConfig` or
    `ws_decode.WsDecodeConfig` runs the warp-specialised Gluon kernel (`gather` only where the config `gathers`;
    `chained`: GEMM0 and GEMM1 of a call both Gluon, GEMM1 launched programmatically after GEMM0, kernels/ws_ring.py
    "Chained launches"; `preload`: a decode-form GEMM0 launched programmatically after the kernel that writes its rows,
    `ws_decode.ws_decode_launch`); a GemmConfig `grouped_gemm0` / `grouped_gemm1` with `launch`, the Triton kernels'
    launch options (pdl, stream-K scratch, status, ...), which the Gluon kernels have none of."""
    ws = isinstance(config, (ws_gemm.WsConfig, ws_decode.WsDecodeConfig))
    if ws and gather is not None and not config.gathers:
        raise ValueError(f"launch_gemm: {config} reads its rows in expert order, not through gather rows")
    if chained and not ws:
        raise ValueError(f"launch_gemm: {config} is not chained (the Triton kernels take launch options instead)")
    if preload and (gemm != 0 or not isinstance(config, ws_decode.WsDecodeConfig)):
        raise ValueError(f"launch_gemm: only a decode-form GEMM0 preloads, not GEMM{gemm} with {config}")
    if isinstance(config, ws_gemm.WsConfig) and gemm == 0:
        ws_gemm.ws_gemm0(a, w, out, tiles, config, gather=gather, chained=chained)
    elif isinstance(config, ws_gemm.WsConfig):
        ws_gemm.ws_gemm1(a, w, out, tiles, config, chained=chained)
    elif ws and gemm == 0:
        ws_decode.ws_decode_gemm0(a, w, out, tiles, config, chained=chained, preload=preload)
    elif ws:
        ws_decode.ws_decode_gemm1(a, w, out, tiles, config, chained=chained)
    elif gemm == 0:
        grouped_gemm0(a, w, out, tiles, config, gather=gather, **launch)
    else:
        grouped_gemm1(a, w, out, tiles, config, **launch)


def grouped_gemm0(a: torch.Tensor, w13: torch.Tensor, h: torch.Tensor, tiles: TileTable, config: GemmConfig,
                  dot_fp32: bool = False, early_release: bool = False,
                  gather: torch.Tensor | None = None, pdl: bool = True, scratch=None, stream_k_scratch=None,
                  status: torch.Tensor | None = None, timeout_ns: int = DEFAULT_TIMEOUT_NS) -> torch.Tensor:
    """h = silu(a @ gate^T) * (a @ up^T) per expert, one persistent launch.

    Args:
        a: [P, H] bf16, rows in expert order (see the module docstring); with `gather`, [S, H] of any S, row m of
            the expert-ordered rows being a[gather[m]].
        gather: int32 rows of `a`, one per row below expert_offsets[-1] (`layout.Layout.gather_rows`): A is then
            read with pointer loads (no TMA), instead of the caller first copying the rows into expert order.
        w13: [E_local, 2I, H] bf16: `interleave_w13(w13)` when config.interleaved, else gate rows then up rows.
        h: [P, I] bf16 output; rows outside every tile are left untouched.
        tiles: `build_tile_table(expert_offsets, config.block_m, P, config.split_tail)`.
        config: tile shape and schedule.
        dot_fp32: multiply in fp32 (interpreter tests only).
        early_release: let the next launch's CTAs onto the SMs from the start, not after the tiles (see the module
            docstring).
        pdl: launch with programmatic dependent launch (where sync.PDL allows it); False: an ordinary launch, whose
            CTAs reach the SMs only once the previous kernel of the stream has ended (see the module docstring).
        scratch: Triton's global-scratch allocator (`alloc(size, alignment, stream) -> tensor`) for the clipped
            TMA epilogues' device-made descriptors; None: the caller's `triton.set_allocator`, else a torch tensor
            per launch (inside a CUDA-graph capture: from the graph's memory pool).
        stream_k_scratch: with config.stream_k, `(slots, slot_elements) -> (parts, flags)` as `stream_k_buffers`
            makes them (the flags zero; the kernel leaves them zero); None: new ones for this launch.
        status: with config.stream_k, the int32 status word (kernels/sync.py) where a timed-out wait for another
            CTA's part is recorded (ERROR_STREAM_K_TIMEOUT); None: a new zero word nobody reads. timeout_ns: the
            deadline of those waits.
    """
    kernel, grid, args, kwargs = _gemm0_launch(a, w13, h, tiles, config, dot_fp32, early_release=early_release,
                                               gather=gather, pdl=pdl, stream_k_scratch=stream_k_scratch,
                                               status=status, timeout_ns=timeout_ns)
    _launch(kernel, grid, args, kwargs, config.epilogue in CLIPPED_EPILOGUES and a.is_cuda, scratch)
    return h


def grouped_gemm1(h: torch.Tensor, w2: torch.Tensor, y: torch.Tensor, tiles: TileTable, config: GemmConfig,
                  scale: torch.Tensor | None = None, dot_fp32: bool = False, early_release: bool = False,
                  pdl: bool = True, scratch=None, stream_k_scratch=None, status: torch.Tensor | None = None,
                  timeout_ns: int = DEFAULT_TIMEOUT_NS) -> torch.Tensor:
    """y = scale * (h @ w2[expert]^T) per expert, one persistent launch.

    Args:
        h: [P, I] bf16, rows in expert order.
        w2: [E_local, H, I] bf16.
        y: [P, H] bf16 output; rows outside every tile are left untouched.
        tiles: `build_tile_table(expert_offsets, config.block_m, P, config.split_tail)`.
        config: tile shape and schedule (`interleaved` is ignored).
        scale: optional fp32 [P], multiplied into each row in fp32 before the bf16 rounding (routing weights).
        dot_fp32: multiply in fp32 (interpreter tests only).
        early_release, pdl, scratch, stream_k_scratch, status, timeout_ns: as in grouped_gemm0.
    """
    kernel, grid, args, kwargs = _gemm1_launch(h, w2, y, tiles, config, scale, dot_fp32, early_release=early_release,
                                               pdl=pdl, stream_k_scratch=stream_k_scratch, status=status,
                                               timeout_ns=timeout_ns)
    _launch(kernel, grid, args, kwargs, config.epilogue in CLIPPED_EPILOGUES and h.is_cuda, scratch)
    return y
