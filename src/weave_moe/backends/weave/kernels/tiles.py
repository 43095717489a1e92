"""Triton tile functions of the MoE layer, shared by the staged launches and the persistent megakernel.

Each function does one task of the task tables built by `weave_moe.backends.weave.layout` and nothing else: no waits, no signals
(those live in `sync.py`), so each can be run and tested alone (also under TRITON_INTERPRET=1, with DOT_FP32 set
because the interpreter's bf16 dot is wrong).

Index habit: row indices are clamped instead of masked on loads (a clamped row reads valid memory and is never
stored), so the K loops load without predicates and pipeline well; only stores are masked.
"""

import triton
import triton.language as tl


@triton.jit
def dispatch_rows(x_ptr, dst_ptr, token_ptr, slot_ptr, start, count, H,
                  BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, PIPELINED: tl.constexpr = True):
    """Copy `count` (<= BLOCK_ROWS) rows of x [T, H] to dst [*, H] (a peer's receive region or our own).

    Row i of the task: x[token[start + i]] -> dst[slot[start + i]].

    In BLOCK_H-wide steps. PIPELINED: each step's loads are issued before the previous step's stores. A store waits
    for its data, so in a plain load-then-store loop every step waits one load latency after the last (the row copies
    are latency-bound at the tasks' sizes); here the next step's loads are on their way meanwhile, for another
    BLOCK_ROWS x BLOCK_H elements of registers (which a launch that also holds the GEMM tiles' code pays in spills).
    """
    offs_r = tl.arange(0, BLOCK_ROWS)
    mask_r = offs_r < count
    token = tl.load(token_ptr + start + offs_r, mask=mask_r, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + start + offs_r, mask=mask_r, other=0).to(tl.int64)
    if not PIPELINED:
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask = mask_r[:, None] & (offs_h < H)[None, :]
            rows = tl.load(x_ptr + token[:, None] * H + offs_h[None, :], mask=mask)
            tl.store(dst_ptr + slot[:, None] * H + offs_h[None, :], rows, mask=mask)
        return
    offs_h = tl.arange(0, BLOCK_H)
    mask = mask_r[:, None] & (offs_h < H)[None, :]
    rows = tl.load(x_ptr + token[:, None] * H + offs_h[None, :], mask=mask)
    for h0 in range(BLOCK_H, H, BLOCK_H):
        next_offs = h0 + tl.arange(0, BLOCK_H)
        next_mask = mask_r[:, None] & (next_offs < H)[None, :]
        next_rows = tl.load(x_ptr + token[:, None] * H + next_offs[None, :], mask=next_mask)
        tl.store(dst_ptr + slot[:, None] * H + offs_h[None, :], rows, mask=mask)
        offs_h, mask, rows = next_offs, next_mask, next_rows
    tl.store(dst_ptr + slot[:, None] * H + offs_h[None, :], rows, mask=mask)


@triton.jit
def _paired_k_loop(a_ptrs, b0_ptrs, b1_ptrs, K, b_desc, b0_row, b1_row,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                   STAGES: tl.constexpr, USE_TMA: tl.constexpr, PAIRED_DESC: tl.constexpr = False):
    """(A @ B0, A @ B1) over K in BLOCK_K steps: two [BLOCK_M, BLOCK_N] fp32 accumulators sharing each A block.

    a_ptrs: [BLOCK_M, BLOCK_K] pointers of the first A block; b0_ptrs / b1_ptrs: [BLOCK_K, BLOCK_N] pointers of the
    first B blocks (K-contiguous rows of the weights). With USE_TMA the B blocks come from `b_desc` at rows b0_row /
    b1_row instead (block [BLOCK_N, BLOCK_K], transposed on load); with PAIRED_DESC too, `b_desc` is 3-D
    [rows, 2, K] (block [BLOCK_N, 1, BLOCK_K]) and B0 / B1 are its pairs' first / second rows from row b0_row (the
    interleaved w13). The K tail is masked (pointers) or zero-filled (TMA).
    """
    offs_k = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        if USE_TMA and PAIRED_DESC:
            b0 = b_desc.load([b0_row, 0, k0]).reshape(BLOCK_N, BLOCK_K).T
            b1 = b_desc.load([b0_row, 1, k0]).reshape(BLOCK_N, BLOCK_K).T
        elif USE_TMA:
            b0 = b_desc.load([b0_row, k0]).T
            b1 = b_desc.load([b1_row, k0]).T
        else:
            b0 = tl.load(b0_ptrs, mask=k_ok[:, None], other=0.0)
            b1 = tl.load(b1_ptrs, mask=k_ok[:, None], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b0 = b0.to(tl.float32)
            b1 = b1.to(tl.float32)
        acc0 = tl.dot(a, b0, acc0)
        acc1 = tl.dot(a, b1, acc1)
        a_ptrs += BLOCK_K
        b0_ptrs += BLOCK_K
        b1_ptrs += BLOCK_K
    return acc0, acc1


@triton.jit
def _k_loop(a_ptrs, b_ptrs, K, b_desc, b_row, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, STAGES: tl.constexpr, USE_TMA: tl.constexpr = False):
    """A @ B over K in BLOCK_K steps into ONE [BLOCK_M, BLOCK_N] fp32 accumulator (one MMA per step). b_ptrs:
    [BLOCK_K, BLOCK_N] pointers of the first B block; with USE_TMA the B blocks come from `b_desc` at row b_row
    (block [BLOCK_N, BLOCK_K], transposed on load). The K tail is masked (pointers) or zero-filled (TMA)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        if USE_TMA:
            b = b_desc.load([b_row, k0]).T
        else:
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _rows_of(base_ptr, row_start, offs, width):
    """[len(offs), 1] pointers to rows row_start + offs of a [*, width] matrix: the tile's first row in 64 bits (one
    scalar), the offsets within the tile in 32 (offs < BLOCK_M, so offs * width fits), instead of a 64-bit product
    per row. GEMM0's epilogue stores through it: the host-driven one-launch kernel, which spilled 40 bytes of
    registers (its h-store row addresses among them), spills none with it (sm_90, as launched). GEMM1's epilogues
    keep the 64-bit products: through this, ptxas spilled ~300 bytes more in both one-launch compiles."""
    return (base_ptr + tl.cast(row_start, tl.int64) * width) + (offs * width)[:, None]


@triton.jit
def gemm0_tile(a_ptr, gather_ptr, w13_ptr, h_ptr, expert, row_start, num_rows, n_start, H, I,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
               STAGES: tl.constexpr = 3, w13_desc=None, USE_TMA: tl.constexpr = False,
               INTERLEAVED: tl.constexpr = False, WIDE: tl.constexpr = False):
    """h[row_start + m, n_start + n] = silu(a_m . gate_n) * (a_m . up_n), a_m = a[gather[row_start + m]].

    a: [*, H] bf16 receive buffer; gather: [pairs] int32 rows of a; w13: [E_local, 2I, H] bf16 (gate rows, then up
    rows); h: [pairs, I] bf16. The gate and up columns of the tile are multiplied together so SiLU-mul fuses into
    the epilogue and h is written once, rounded to bf16 (as the reference does).

    USE_TMA (KernelConfig.tma): the gate and up blocks come through the bulk tensor copy engine from `w13_desc`, a
    host-built descriptor of w13 as [E_local * 2I, H] with block [BLOCK_N, BLOCK_K]. A tile past its expert's I rows
    reads the next rows (or zeros past the tensor): those columns are never stored; the K tail past H is zero-filled.
    The A rows are gathered (dedup), so they stay pointer loads.

    INTERLEAVED: w13 holds gate row j at row 2j and up row j at row 2j + 1 of its expert (the layout the grouped GEMMs
    read, `grouped_gemm.interleave_w13`); with USE_TMA `w13_desc` is then a descriptor of w13 as [E_local * I, 2, H]
    with block [BLOCK_N, 1, BLOCK_K]. WIDE (INTERLEAVED only): the tile's 2 * BLOCK_N interleaved rows in ONE MMA
    per K step, the gate and up columns of the accumulator separated by `tl.split` (as the grouped GEMMs do); with
    USE_TMA `w13_desc` is then a descriptor of w13 as [E_local * 2I, H] with block [2 * BLOCK_N, BLOCK_K].
    """
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_rows
    rows = tl.load(gather_ptr + row_start + tl.minimum(offs_m, num_rows - 1)).to(tl.int64)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    cols = tl.minimum(offs_n, I - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * H + offs_k[None, :]
    expert_w13 = w13_ptr + expert.to(tl.int64) * (2 * I) * H
    if WIDE:
        tl.static_assert(INTERLEAVED, "WIDE reads the interleaved w13")
        pair_rows = tl.minimum(2 * n_start + tl.arange(0, 2 * BLOCK_N), 2 * I - 1).to(tl.int64)
        acc = _k_loop(a_ptrs, expert_w13 + pair_rows[None, :] * H + offs_k[:, None], H, w13_desc,
                      expert * (2 * I) + 2 * n_start, BLOCK_M, 2 * BLOCK_N, BLOCK_K, DOT_FP32, STAGES, USE_TMA)
        acc_gate, acc_up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    elif INTERLEAVED:
        gate_ptrs = expert_w13 + (2 * cols)[None, :] * H + offs_k[:, None]
        up_ptrs = gate_ptrs + H
        gate_row = expert * I + n_start    # TMA coordinates of the gate-up pairs (3-D descriptor)
        up_row = gate_row
    else:
        gate_ptrs = expert_w13 + cols[None, :] * H + offs_k[:, None]
        up_ptrs = gate_ptrs + I * H
        gate_row = expert * (2 * I) + n_start  # TMA coordinates of the gate block; the up block is I rows further
        up_row = gate_row + I
    if not WIDE:
        acc_gate, acc_up = _paired_k_loop(a_ptrs, gate_ptrs, up_ptrs, H, w13_desc, gate_row, up_row,
                                          BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, STAGES, USE_TMA, INTERLEAVED)
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out_ptrs = _rows_of(h_ptr, row_start, offs_m, I) + offs_n[None, :]
    tl.store(out_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def gemm1_tile(h_ptr, w2_ptr, y_ptr, expert, row_start, num_rows, n_start, H, I,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
               STAGES: tl.constexpr = 4, w2_desc=None, USE_TMA: tl.constexpr = False):
    """y[row_start + m, n_start + n] = h[row_start + m] . w2[expert, n_start + n].

    h: [pairs, I] bf16 (rows of one expert are contiguous); w2: [E_local, H, I] bf16; y: [pairs, H] bf16.
    A tile of BLOCK_N >= 256 columns runs as two BLOCK_N / 2 halves that share each A block (two accumulators), the
    shape GEMM0 uses for gate and up: on H200 one 128x256 dot measured slower than two 128x128 dots.

    USE_TMA (KernelConfig.tma, paired tiles only): the w2 blocks come from `w2_desc`, a host-built descriptor of w2
    as [E_local * H, I] with block [BLOCK_N // 2, BLOCK_K] (columns past H read the next rows and are never stored).
    h stays a pointer load: other CTAs wrote it with ordinary stores during this kernel, and the copy engine (the
    async proxy) would need a proxy fence to see them; the weights never change during a kernel.
    """
    if BLOCK_N >= 256 or USE_TMA:
        _gemm1_pair(h_ptr, w2_ptr, y_ptr, expert, row_start, num_rows, n_start, H, I,
                    BLOCK_M, BLOCK_N // 2, BLOCK_K, DOT_FP32, STAGES, w2_desc, USE_TMA)
    else:
        _gemm1_single(h_ptr, w2_ptr, y_ptr, expert, row_start, num_rows, n_start, H, I,
                      BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, STAGES)


@triton.jit
def _gemm1_single(h_ptr, w2_ptr, y_ptr, expert, row_start, num_rows, n_start, H, I,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                  STAGES: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_rows
    rows = (row_start + tl.minimum(offs_m, num_rows - 1)).to(tl.int64)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    cols = tl.minimum(offs_n, H - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * I + offs_k[None, :]
    b_ptrs = w2_ptr + expert.to(tl.int64) * H * I + cols[None, :] * I + offs_k[:, None]
    acc = _k_loop(a_ptrs, b_ptrs, I, None, 0, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, STAGES)
    out_ptrs = y_ptr + (row_start + offs_m)[:, None].to(tl.int64) * H + offs_n[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _gemm1_pair(h_ptr, w2_ptr, y_ptr, expert, row_start, num_rows, n_start, H, I,
                BLOCK_M: tl.constexpr, HALF_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                STAGES: tl.constexpr, w2_desc=None, USE_TMA: tl.constexpr = False):
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_rows
    rows = (row_start + tl.minimum(offs_m, num_rows - 1)).to(tl.int64)
    offs_lo = n_start + tl.arange(0, HALF_N)
    offs_hi = offs_lo + HALF_N
    cols_lo = tl.minimum(offs_lo, H - 1).to(tl.int64)
    cols_hi = tl.minimum(offs_hi, H - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * I + offs_k[None, :]
    w_base = w2_ptr + expert.to(tl.int64) * H * I
    w_row = expert * H + n_start  # TMA coordinates of the low half; the high half is HALF_N rows further
    acc_lo, acc_hi = _paired_k_loop(a_ptrs, w_base + cols_lo[None, :] * I + offs_k[:, None],
                                    w_base + cols_hi[None, :] * I + offs_k[:, None], I, w2_desc, w_row,
                                    w_row + HALF_N, BLOCK_M, HALF_N, BLOCK_K, DOT_FP32, STAGES, USE_TMA)
    row_ptrs = y_ptr + (row_start + offs_m)[:, None].to(tl.int64) * H
    tl.store(row_ptrs + offs_lo[None, :], acc_lo.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & (offs_lo < H)[None, :])
    tl.store(row_ptrs + offs_hi[None, :], acc_hi.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & (offs_hi < H)[None, :])


@triton.jit
def combine_rows(y_ptr, pos_ptr, weight_ptr, token_ptr, dst_ptr, start, count, H,
                 TOP_K: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """For received row i of the task: dst[token[i]] = sum_j weight[i, j] * y[pos[i, j]] over pos >= 0 (fp32 sum).

    y: [pairs, H] bf16; pos/weight: [received, TOP_K] int32 / fp32; dst: the source rank's combine region for this
    rank, [T_max, H] bf16 (a peer's memory for remote tokens).
    """
    offs_r = tl.arange(0, BLOCK_ROWS)
    mask_r = offs_r < count
    row = start + offs_r
    token = tl.load(token_ptr + row, mask=mask_r, other=0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        acc = tl.zeros((BLOCK_ROWS, BLOCK_H), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pos = tl.load(pos_ptr + row * TOP_K + j, mask=mask_r, other=-1)
            weight = tl.load(weight_ptr + row * TOP_K + j, mask=mask_r, other=0.0)
            ok = pos >= 0
            values = tl.load(y_ptr + tl.maximum(pos, 0).to(tl.int64)[:, None] * H + offs_h[None, :],
                             mask=ok[:, None] & mask_h[None, :], other=0.0)
            acc += weight[:, None] * values.to(tl.float32)
        tl.store(dst_ptr + token[:, None] * H + offs_h[None, :], acc.to(dst_ptr.dtype.element_ty),
                 mask=mask_r[:, None] & mask_h[None, :])


@triton.jit
def reduce_rows(comb_ptr, mask_ptr, out_ptr, start, count, H, max_tokens, world_size,
                BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum over ranks d with bit d of mask[t]: comb[d * max_tokens + t], for t in [start, start + count).

    comb: [EP * T_max, H] bf16 (this rank's combine buffer); mask: [T] int32 bit per destination rank; out: [T, H].
    A token with no expert gets a zero row. One row per task (BLOCK_ROWS 1, a decode call's): every rank's row is
    loaded and the unsent ones zeroed afterwards, so that the loads do not wait for the mask's (one round trip);
    with more rows the loads stay masked (the rows not sent are not read).
    """
    offs_r = tl.arange(0, BLOCK_ROWS)
    mask_r = offs_r < count
    token = start + offs_r
    bits = tl.load(mask_ptr + token, mask=mask_r, other=0)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        acc = tl.zeros((BLOCK_ROWS, BLOCK_H), dtype=tl.float32)
        # rank d + 1's rows are loaded before rank d's are added, so that two loads are in flight, not one at a time
        # (an add waits for its data, and the ranks' loop has a runtime trip count: nothing unrolls it); the sum's
        # order is unchanged
        values = _comb_rows(comb_ptr, bits, 0, max_tokens, token, mask_r, offs_h, mask_h, H, BLOCK_ROWS == 1)
        for d in range(1, world_size):
            next_values = _comb_rows(comb_ptr, bits, d, max_tokens, token, mask_r, offs_h, mask_h, H,
                                     BLOCK_ROWS == 1)
            acc += values.to(tl.float32)
            values = next_values
        acc += values.to(tl.float32)
        tl.store(out_ptr + token.to(tl.int64)[:, None] * H + offs_h[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask_r[:, None] & mask_h[None, :])


@triton.jit
def _comb_rows(comb_ptr, bits, d, max_tokens, token, mask_r, offs_h, mask_h, H, READ_ALL: tl.constexpr):
    """reduce_rows' rows of rank d for `token` (zeros where bit d of `bits` is clear). READ_ALL: loaded whatever the
    bit, then zeroed where it is clear (the load does not wait for `bits`)."""
    sent = ((bits >> d) & 1) != 0
    row = (d * max_tokens + token).to(tl.int64)
    if READ_ALL:
        values = tl.load(comb_ptr + row[:, None] * H + offs_h[None, :], mask=mask_r[:, None] & mask_h[None, :],
                         other=0.0)
        return tl.where(sent[:, None], values, 0.0)
    return tl.load(comb_ptr + row[:, None] * H + offs_h[None, :], mask=(sent & mask_r)[:, None] & mask_h[None, :],
                   other=0.0)


@triton.jit
def poison_rows(out_ptr, start, count, H, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = NaN for t in [start, start + count): the output of a call the kernel refused to run (sync.py,
    rejections), so that a caller who ignores the deferred error cannot mistake it for an answer."""
    offs_r = tl.arange(0, BLOCK_ROWS)
    mask_r = offs_r < count
    token = (start + offs_r).to(tl.int64)
    nan = tl.full((BLOCK_ROWS, BLOCK_H), float("nan"), tl.float32).to(out_ptr.dtype.element_ty)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        tl.store(out_ptr + token[:, None] * H + offs_h[None, :], nan, mask=mask_r[:, None] & (offs_h < H)[None, :])
