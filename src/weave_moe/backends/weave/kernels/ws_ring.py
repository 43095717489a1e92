"""The load ring of the warp-specialised Gluon GEMMs (kernels/ws_gemm.py, kernels/ws_decode.py): the work order, the
producer partition and the mbarrier protocol that the consumers follow.

Shape legend: S = stages, K steps = ceil(K / BLOCK_K).

The ring. S shared-memory stages, each an A buffer and a W buffer (a work item's K-step blocks), with two mbarriers
of arrival count 1: `ready` completes when the TMA copies of a stage's blocks have landed (their transaction
bytes), `empty` when the consumer's MMAs that read the stage have finished. Every partition counts K steps from 0
across the CTA's whole walk: item i (the CTA's i-th work item, section 0 then section 1) takes steps i * K steps ...
(i + 1) * K steps - 1, and step c uses stage c % S in phase (c // S) & 1. The producer waits on `empty` with the
opposite phase (a fresh mbarrier's phase "1" counts as complete, so its first S waits pass), expects the bytes on
`ready` and issues the copies; a consumer waits on `ready`, issues the stage's MMAs asynchronously, waits until at
most one MMA group is in flight and then arrives on `empty` of the step before (whose MMAs have now finished), and
at an item's end drains and arrives on `empty` of its last step. So the producer runs up to S steps ahead, across
items. Every partition derives the walk from the same tile table, so they agree on every step.

Row parts (kernels/ws_gemm.py's 192-row tiles): a stage holds PARTS A blocks, one per consumer, each a TMA box of
the part's rows (TMA boxes are powers of two), and one W block that every consumer reads; the producer copies the
A blocks of the parts that have rows before the expert's end (`ready` expects their bytes and W's: `expect_step`),
and `empty`
counts one arrival per consumer (`allocate_ring`'s PARTS), so a stage is refilled once every part's MMAs that read
it have finished. A part waits on `ready` before each arrival, also where it has no rows, so it arrives once per
phase.

Parity. A wait names a phase only by its parity: it is right while the waiter is at most one phase ahead of the
barrier. The producer and a single consumer stay so by construction; two consumers (ping-pong) must take turns at
their mainloops (kernels/ws_gemm.py, `turn`), or the second one's first wait on `ready` would pass on a phase two
behind. tests/test_ws_gemm.py simulates this arithmetic with the partitions interleaved at random.

Gathered A rows (`producer`'s GATHER_A, GEMM0 only): A's rows come from any rows of a source buffer (row m =
source[gather[m]], the receive buffer as the layout's gather rows order it), so TMA cannot load them; a producer of
one warpgroup copies them with `cp.async` (16 bytes per thread and copy) and each of its threads then issues
`cp.async.mbarrier.arrive.noinc` on the stage's `ready`, which fires once that thread's copies have landed. `ready`
then counts 1 + 32 x GATHER_WARPS arrivals (`ready_arrivals`): the W copy's `expect` and one per producer thread. The
copies write shared memory through the generic proxy and wgmma reads it through the async proxy, so a consumer fences
(`fence.proxy.async`) after its wait on `ready` and before its MMAs.

Chained launches (programmatic dependent launch; the kernels' `chained` / CHAIN): a chained GEMM0 lets the next
kernel's CTAs start as soon as each of its CTAs has begun (`griddepcontrol.launch_dependents` at its start); a GEMM1
launched programmatically after it (`producer`'s CHAINED) lands on the SMs that GEMM0's CTAs leave in its last wave
and fills its ring's first stages with its first work item's weight blocks (which no kernel writes) before
`griddepcontrol.wait` (GEMM0 has ended and its h is visible), then issues their A blocks (h) and goes on as usual.
Only the producer waits: the consumer's loads (the routing weights) were written before GEMM0 began, and its stores
follow A's loads. A CTA with no work item waits too, before its split tails' loads. The tile tables a chained producer reads before its wait
were written two or more launches before it, by kernels that ended before GEMM0, a plain launch, began.

Work order: grouped_gemm's: GROUP_M consecutive M tiles of the tile table sweep the N tiles together (a weight
block read from HBM about once, reused from L2), dealt round-robin to the CTAs; section 1 (split tails) after
section 0, its round-robin going on from where section 0's ended.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_wait

__all__ = ["MAX_RING_BYTES", "GATHER_WARPS", "ready_arrivals", "allocate_ring", "work_tile", "section_work",
           "load_tile", "producer", "producer_warps", "check_operands", "weight_descriptor", "block_weights"]

#: the load ring's shared memory at most: Hopper's 227 KB per CTA less room for the epilogue's layout conversion
#: (compiled for sm_90: 128x256x64 tiles with 4 stages, 192 KB of ring, take 229444 bytes in all; 192x128x64 with 5
#: stages, 200 KB, 229476; 64x256x64 with 5 stages 221276)
MAX_RING_BYTES = 200 * 1024
#: the warps of a producer that gathers A's rows (one warpgroup: what the kernel's register budget holds for a
#: producer anyway)
GATHER_WARPS = gl.constexpr(4)


@gluon.constexpr_function
def producer_warps(GATHER_A):
    """The producer partition's warps: one issuing TMA copies, or GATHER_WARPS copying gathered A rows."""
    return GATHER_WARPS.value if GATHER_A else 1


@gluon.constexpr_function
def ready_arrivals(GATHER_A):
    """Arrivals that complete a stage's `ready` (module docstring): the W copy's `expect`, and with gathered A rows
    one `cp.async.mbarrier.arrive.noinc` per producer thread."""
    return 1 + (32 * GATHER_WARPS.value if GATHER_A else 0)


@gluon.jit
def allocate_ring(a_desc, w_desc, STAGES: gl.constexpr, READY_ARRIVALS: gl.constexpr, PARTS: gl.constexpr = 1):
    """The ring's shared memory (module docstring): STAGES W blocks and STAGES x PARTS A blocks of the descriptors'
    boxes (stage s's row parts at s * PARTS ...; "Row parts"), and the `ready` / `empty` mbarriers of each stage,
    initialised with arrival counts READY_ARRIVALS (`ready_arrivals`) and PARTS (one consumer per part)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES * PARTS] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(empty.index(i), count=PARTS)
    return a_bufs, w_bufs, ready, empty


@gluon.jit
def work_tile(tiles_ptr, width, work, num_tiles, num_n, GROUP_M: gl.constexpr):
    """(expert, first row, the expert's end row, N tile) of work item `work`: GROUP_M consecutive M tiles sweep the
    N tiles together (grouped_gemm's `_tile_coords` order)."""
    per_group = GROUP_M * num_n
    first = (work // per_group) * GROUP_M
    size = gl.minimum(num_tiles - first, GROUP_M)
    tile = first + (work % per_group) % size
    n = (work % per_group) // size
    expert = gl.load(tiles_ptr + tile)
    m_start = gl.load(tiles_ptr + width + tile)
    m_end = gl.load(tiles_ptr + 2 * width + tile)
    return expert, m_start, m_end, n


@gluon.jit
def section_work(pid, work_before, NUM_SMS: gl.constexpr):
    """This CTA's first work item of a section that follows `work_before` items: the round-robin goes on across
    sections, so the CTAs that ran out of section-0 work first take section 1's first items (grouped_gemm's)."""
    return ((pid - work_before) % NUM_SMS + NUM_SMS) % NUM_SMS


@gluon.jit
def load_a(a_desc, a_bufs, bar, stage, m_start, m_end, k, ROWS: gl.constexpr, PARTS: gl.constexpr):
    """The TMA copies of one K step's A block into stage `stage`, completing on `bar`: ROWS rows from `m_start` into
    the first ROWS of the stage's A buffer, or with PARTS > 1 each row part's box that starts before `m_end` into
    its own buffer ("Row parts"; `row_parts` counts them)."""
    if PARTS == 1:
        if ROWS == a_bufs.shape[1]:
            tma.async_copy_global_to_shared(a_desc, [m_start, k], bar, a_bufs.index(stage))
        else:
            tma.async_copy_global_to_shared(a_desc, [m_start, k], bar, a_bufs.index(stage).slice(0, ROWS))
    else:
        PART_ROWS: gl.constexpr = a_bufs.shape[1]
        for part in gl.static_range(PARTS):
            if m_start + part * PART_ROWS < m_end:
                tma.async_copy_global_to_shared(a_desc, [m_start + part * PART_ROWS, k], bar,
                                                a_bufs.index(stage * PARTS + part))


@gluon.jit
def expect_step(bar, a_desc, w_desc, parts, PARTS: gl.constexpr):
    """The producer's arrival on a stage's `ready` with the bytes of one K step (`load_a`'s and `load_w`'s copies):
    one A box, or with PARTS > 1 `parts` of them (the row parts with rows: 1 to PARTS; an mbarrier's expected bytes
    are an instruction's constant, so one predicated arrival per count)."""
    if PARTS == 1:
        mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
    else:
        for p in gl.static_range(1, PARTS + 1):
            mbarrier.expect(bar, p * a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=parts == p)


@gluon.jit
def row_parts(a_desc, m_start, m_end, PARTS: gl.constexpr):
    """The row parts of a work item that have rows before the expert's end (1 without row parts)."""
    PART_ROWS: gl.constexpr = a_desc.block_type.shape[0]
    return gl.minimum(gl.cdiv(m_end - m_start, PART_ROWS), PARTS) if PARTS > 1 else 1


@gluon.jit
def load_tile(a_desc, w_desc, a_bufs, w_bufs, ready, empty, m_start, w_row, w_rows, K, step, ROWS: gl.constexpr,
              W_BLOCKED: gl.constexpr, k_first=0, m_end=0, PARTS: gl.constexpr = 1):
    """The TMA loads of one work item's K steps from column `k_first` on, from ring step `step` on (A: `load_a`, ROWS
    rows, or PARTS row parts up to `m_end`; W: the block at row `w_row`, K step by K step along its columns, or with
    W_BLOCKED along the K-blocked layout's rows, `w_rows` rows a step: `block_weights`); returns the step after
    them."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = w_bufs.shape[0]
    parts = row_parts(a_desc, m_start, m_end, PARTS)
    for k in range(k_first, K, BLOCK_K):
        stage = step % STAGES
        mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        expect_step(bar, a_desc, w_desc, parts, PARTS)
        load_a(a_desc, a_bufs, bar, stage, m_start, m_end, k, ROWS, PARTS)
        load_w(w_desc, w_bufs.index(stage), bar, w_row, w_rows, k, W_BLOCKED)
        step += 1
    return step


@gluon.jit
def load_first_tile_chained(a_desc, w_desc, a_bufs, w_bufs, ready, empty, m_start, w_row, w_rows, K,
                            ROWS: gl.constexpr, W_BLOCKED: gl.constexpr, m_end=0, PARTS: gl.constexpr = 1):
    """A chained launch's first work item (module docstring, "Chained launches"), from ring step 0: the W blocks of
    its first min(STAGES, K steps) steps into the fresh ring (each stage's first phase: no `empty` to wait for),
    `griddepcontrol.wait`, their A blocks, then the item's other steps as `load_tile`. Returns the step after it."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = w_bufs.shape[0]
    early = gl.minimum(gl.cdiv(K, BLOCK_K), STAGES)
    parts = row_parts(a_desc, m_start, m_end, PARTS)
    for i in range(0, early):
        bar = ready.index(i)
        expect_step(bar, a_desc, w_desc, parts, PARTS)
        load_w(w_desc, w_bufs.index(i), bar, w_row, w_rows, i * BLOCK_K, W_BLOCKED)
    gdc_wait()   # the kernel before this one has ended, its memory visible
    for i in range(0, early):
        load_a(a_desc, a_bufs, ready.index(i), i, m_start, m_end, i * BLOCK_K, ROWS, PARTS)
    return load_tile(a_desc, w_desc, a_bufs, w_bufs, ready, empty, m_start, w_row, w_rows, K, early, ROWS, W_BLOCKED,
                     early * BLOCK_K, m_end, PARTS)


@gluon.jit
def load_w(w_desc, buf, bar, w_row, w_rows, k, W_BLOCKED: gl.constexpr):
    """The TMA copy of one K step's W block (column k on) into `buf`, completing on `bar`: the block at row `w_row`
    of the layer's layout, or with W_BLOCKED of the K-blocked one, `w_rows` rows a step (`block_weights`)."""
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    if W_BLOCKED:
        tma.async_copy_global_to_shared(w_desc, [w_row + (k // BLOCK_K) * w_rows, 0], bar, buf)
    else:
        tma.async_copy_global_to_shared(w_desc, [w_row, k], bar, buf)


@gluon.constexpr_function
def _gather_layout(BLOCK_K):
    """The gathering producer's layout of an A block: 16 bytes per thread and copy along a row, the warpgroup's
    threads over the block's rows."""
    columns = BLOCK_K // 8
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // columns, columns],
                            warps_per_cta=[GATHER_WARPS.value, 1], order=[1, 0])


@gluon.jit
def _gather_sources(gather_ptr, first, m_end, K, ROWS: gl.constexpr, layout: gl.constexpr):
    """The element offsets in the source buffer of rows first .. first + ROWS - 1 (`gather`; rows past the expert's
    end `m_end` read its last row, never stored)."""
    rows = gl.minimum(first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)), m_end - 1)
    return gl.load(gather_ptr + rows).to(gl.int64) * K


@gluon.jit
def load_tile_gathered(a_ptr, gather_ptr, w_desc, a_bufs, w_bufs, ready, empty, m_start, m_end, w_row, w_rows, K,
                       step, W_BLOCKED: gl.constexpr, PARTS: gl.constexpr = 1):
    """The loads of one work item's K steps from ring step `step` on, with gathered A rows (module docstring): A's
    rows a_ptr[gather[m]] for m from `m_start` (BLOCK_M of them, or PARTS = 2 or 3 row parts of BLOCK_M, each after
    the first copied where it has rows before the expert's end `m_end`: "Row parts") by cp.async from this
    partition's threads, each thread arriving on `ready` once its copies land (columns past K read as zeros); W as
    `load_tile`. Returns the step after them."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    STAGES: gl.constexpr = w_bufs.shape[0]
    layout: gl.constexpr = _gather_layout(BLOCK_K)
    sources = _gather_sources(gather_ptr, m_start, m_end, K, BLOCK_M, layout)
    if PARTS >= 2:
        sources1 = _gather_sources(gather_ptr, m_start + BLOCK_M, m_end, K, BLOCK_M, layout)
    if PARTS == 3:
        sources2 = _gather_sources(gather_ptr, m_start + 2 * BLOCK_M, m_end, K, BLOCK_M, layout)
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    for k in range(0, K, BLOCK_K):
        stage = step % STAGES
        mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, w_desc.block_type.nbytes)
        columns = (k + cols)[None, :]
        mask = (k + cols < K)[None, :]
        async_copy.async_copy_global_to_shared(a_bufs.index(stage * PARTS), a_ptr + sources[:, None] + columns,
                                               mask=mask)
        if PARTS >= 2:
            if m_start + BLOCK_M < m_end:
                async_copy.async_copy_global_to_shared(a_bufs.index(stage * PARTS + 1),
                                                       a_ptr + sources1[:, None] + columns, mask=mask)
        if PARTS == 3:
            if m_start + 2 * BLOCK_M < m_end:
                async_copy.async_copy_global_to_shared(a_bufs.index(stage * PARTS + 2),
                                                       a_ptr + sources2[:, None] + columns, mask=mask)
        async_copy.mbarrier_arrive(bar, increment_count=False)
        load_w(w_desc, w_bufs.index(stage), bar, w_row, w_rows, k, W_BLOCKED)
        step += 1
    return step


@gluon.jit
def producer(a_desc, a_tail_desc, w_desc, a_bufs, w_bufs, ready, empty, tiles_ptr, num_tiles_ptr, width, num_n, K,
             w_rows, a_ptr, gather_ptr, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, SPLIT_TAIL: gl.constexpr,
             W_BLOCKED: gl.constexpr, CHAINED: gl.constexpr, GATHER_A: gl.constexpr, PARTS: gl.constexpr = 1):
    """The load partition (`producer_warps` warps): every load of the CTA's work items, into the ring (module
    docstring); with SPLIT_TAIL, section 1's half-height tiles after section 0's (A through `a_tail_desc`);
    W_BLOCKED: the weights in the K-blocked layout (`block_weights`); CHAINED: launched programmatically after the
    kernel that writes A, the first item's first W blocks loaded before waiting for it (module docstring, "Chained
    launches"); GATHER_A (no split tails, not chained): A's rows a_ptr[gather_ptr[m]] by cp.async
    (`load_tile_gathered`; module docstring, "Gathered A rows"); PARTS > 1 (2 or 3, no split tails): each
    stage's A block as that many row parts ("Row parts")."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    pid = gl.program_id(0)
    num_work = gl.load(num_tiles_ptr) * num_n
    # an expert's first weight row: E_local x w_rows rows of K, or E_local x K steps x w_rows rows of BLOCK_K
    expert_rows = w_rows * gl.cdiv(K, BLOCK_K) if W_BLOCKED else w_rows
    step = 0
    first = pid
    if CHAINED:
        if pid < num_work:
            expert, m_start, m_end, n = work_tile(tiles_ptr, width, pid, gl.load(num_tiles_ptr), num_n, GROUP_M)
            step = load_first_tile_chained(a_desc, w_desc, a_bufs, w_bufs, ready, empty, m_start,
                                           expert * expert_rows + n * BLOCK_N, w_rows, K, BLOCK_M, W_BLOCKED, m_end,
                                           PARTS)
        else:
            gdc_wait()
        first = pid + NUM_SMS
    for work in range(first, num_work, NUM_SMS):
        expert, m_start, m_end, n = work_tile(tiles_ptr, width, work, gl.load(num_tiles_ptr), num_n, GROUP_M)
        if GATHER_A:
            step = load_tile_gathered(a_ptr, gather_ptr, w_desc, a_bufs, w_bufs, ready, empty, m_start, m_end,
                                      expert * expert_rows + n * BLOCK_N, w_rows, K, step, W_BLOCKED, PARTS)
        else:
            step = load_tile(a_desc, w_desc, a_bufs, w_bufs, ready, empty, m_start,
                             expert * expert_rows + n * BLOCK_N, w_rows, K, step, BLOCK_M, W_BLOCKED, 0, m_end,
                             PARTS)
    if SPLIT_TAIL:
        num_tails = gl.load(num_tiles_ptr + 1)
        for work in range(section_work(pid, num_work, NUM_SMS), num_tails * num_n, NUM_SMS):
            expert, m_start, m_end, n = work_tile(tiles_ptr + width // 2, width, work, num_tails, num_n, GROUP_M)
            step = load_tile(a_tail_desc, w_desc, a_bufs, w_bufs, ready, empty, m_start,
                             expert * expert_rows + n * BLOCK_N, w_rows, K, step, BLOCK_M // 2, W_BLOCKED)


def weight_descriptor(w: torch.Tensor, config, block_rows: int) -> TensorDescriptor:
    """The TMA descriptor of a launch's W blocks ([block_rows, config.block_k] boxes) over `w` as `config` reads it:
    [E_local * w_rows, K] rows of the layer's layout, or with `config.k_blocked` [E_local * K steps * w_rows,
    block_k] rows of the K-blocked one (`block_weights`); the producer addresses either (`load_tile`)."""
    bk = config.block_k
    rows = w.view(-1, bk) if config.k_blocked else w.view(-1, w.shape[-1])
    return TensorDescriptor.from_tensor(rows, [block_rows, bk],
                                        gl.NVMMASharedLayout.get_default_for([block_rows, bk], gl.bfloat16))


def block_weights(w: torch.Tensor, block_k: int) -> torch.Tensor:
    """The K-blocked layout of weights `w` [E_local, w_rows, K] (K a multiple of `block_k`): [E_local, K / block_k,
    w_rows, block_k], contiguous, so that one K step's W block of BLOCK_N rows (the TMA box [BLOCK_N, block_k]) is one
    contiguous run of BLOCK_N x block_k x 2 bytes instead of BLOCK_N runs of block_k x 2 bytes, K x 2 bytes apart."""
    num_experts, w_rows, K = w.shape
    if K % block_k:
        raise ValueError(f"block_weights: K = {K} is not a multiple of block_k = {block_k}")
    return w.view(num_experts, w_rows, K // block_k, block_k).transpose(1, 2).contiguous()


def check_operands(gemm: int, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tiles, config,
                   scale: torch.Tensor | None, gather: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    """A launch's operands checked, ValueError naming the first wrong one: `gemm` 0 (a [P, H], w the interleaved w13
    [E_local, 2I, H], out h [P, I]) or 1 (a = h [P, I], w = w2 [E_local, H, I], out y [P, H], `scale` fp32 [P] or
    None), bf16 and contiguous; with `config.k_blocked` w in the K-blocked layout of `config`'s block_k (`block_weights`:
    [E_local, K / block_k, w_rows, block_k]); the tile table of `config`'s block_m and split_tail. Returns (K,
    E_local, w_rows, n_out). With `gather` (GEMM0 of a config that `gathers`: `producer`'s GATHER_A) a holds the source
    rows [S, H] in any order and gather int32 rows of it, one per row of out below the table's last expert end."""
    if gemm not in (0, 1):
        raise ValueError(f"gemm: expected 0 or 1, given {gemm!r}")
    if gather is not None:
        if gemm != 0 or not config.gathers:
            raise ValueError(f"gather: GEMM0 of a config that gathers only: one consumer or row parts, no split "
                             f"tails (given gemm {gemm}, {config})")
        if gather.dim() != 1 or gather.dtype != torch.int32 or not gather.is_contiguous():
            raise ValueError(f"gather: expected contiguous int32 [>= rows read], given {gather.dtype} "
                             f"{tuple(gather.shape)}")
    if a.dim() != 2:
        raise ValueError(f"a: expected 2-D rows [*, K], given {tuple(a.shape)}")
    rows, K = (out.shape[0], a.shape[1]) if gather is not None else a.shape
    if config.k_blocked:
        if w.dim() != 4:
            raise ValueError(f"w: expected the K-blocked layout [E_local, K / block_k, w_rows, block_k] "
                             f"(block_weights), given {tuple(w.shape)}")
        num_experts, _, w_rows, _ = w.shape
        w_shape = (num_experts, K // config.block_k, w_rows, config.block_k)
    else:
        num_experts, w_rows = w.shape[:2]
        w_shape = (num_experts, w_rows, K)
    n_out = w_rows // 2 if gemm == 0 else w_rows
    if config.k_blocked and K % config.block_k:
        raise ValueError(f"K = {K}: the K-blocked weights need a multiple of block_k = {config.block_k}")
    a_shape = (a.shape[0], K) if gather is not None else (rows, K)
    for name, tensor, shape in (("a", a, a_shape), ("w", w, w_shape), ("out", out, (rows, n_out))):
        if tuple(tensor.shape) != shape or tensor.dtype != torch.bfloat16 or not tensor.is_contiguous():
            raise ValueError(f"{name}: expected contiguous bf16 {shape}, given {tensor.dtype} "
                             f"{tuple(tensor.shape)}{'' if tensor.is_contiguous() else ' (not contiguous)'}")
    if gemm == 0 and scale is not None:
        raise ValueError("scale: GEMM1 only (the routing weight of each row)")
    if scale is not None and (scale.dtype != torch.float32 or tuple(scale.shape) != (rows, )):
        raise ValueError(f"scale: expected fp32 ({rows},), given {scale.dtype} {tuple(scale.shape)}")
    if tiles.block_m != config.block_m or tiles.split_tail != config.split_tail:
        raise ValueError(f"tiles: expected block_m = {config.block_m}, split_tail = {config.split_tail}, given "
                         f"block_m = {tiles.block_m}, split_tail = {tiles.split_tail}")
    if K % 8 or n_out % 8:
        raise ValueError(f"K = {K} and the output's {n_out} columns must be multiples of 8 (16-byte TMA rows)")
    return K, num_experts, w_rows, n_out
