"""Warp-specialised grouped GEMMs for Hopper, written in Gluon: the expert MLP's GEMM0 + SiLU-mul and GEMM1, the
same work as kernels/grouped_gemm.py, with the loads and the MMAs in different warps.

Shape legend: P = rows (token, expert pairs) in expert order, H = hidden size, I = intermediate size, BM / BN / BK =
tile sizes, S = pipeline stages.

Why. The Triton grouped GEMMs (kernels/grouped_gemm.py) issue their TMA loads from the warps that issue the MMAs:
every K step the compiled loop waits for its stage's mbarrier, issues the wgmma, waits for the one before, then
synchronises the whole CTA (four `bar.sync` per K step in the PTX of DeepSeek-V3's GEMM0 at 128x256x64) around the
next TMA issue, and a tile's epilogue stops the loads. Triton 3.6's automatic warp specialisation leaves that code
unchanged on sm_90 (docs/perf-notes.md entry 27). Gluon (`triton.experimental.gluon`, in Triton 3.6) writes the
split by hand: `gl.warp_specialize`, mbarriers, TMA and `warpgroup_mma` as explicit operations.

How (one CTA per SM, persistent; the same work items, tile table and GROUP_M order as grouped_gemm):
- a producer partition of one warp, with few registers (`WsConfig.producer_regs`), issues every TMA load into a ring
  of S shared-memory stages, up to S K steps ahead across tiles (kernels/ws_ring.py: the ring, its mbarrier
  protocol and the work order), so the next tile's first blocks load while the consumer runs this tile's epilogue.
- the consumer (the default partition: `num_warps` warps, one or two warpgroups over the tile's rows) waits on
  `ready`, issues the stage's wgmma asynchronously (one instruction N as wide as the tile: m64nBNk16 per warpgroup),
  keeps one MMA group in flight (`warpgroup_mma_wait(1)`) and then releases the stage before; at a tile's end it
  drains (`wait(0)`), releases the last stage and runs the epilogue from registers: GEMM0 splits the interleaved
  gate / up columns (w13 as `grouped_gemm.interleave_w13` lays it: adjacent accumulator columns, held by one
  thread) and stores silu(gate) * up; GEMM1 stores the accumulator times the row's routing weight (`scale`). Rows of
  a tile past its expert's end are computed (A's TMA block reads the next expert's rows, or zeros past P) and never
  stored; stores are masked pointer stores of 16 bytes per thread.
- two consumers (`WsConfig.consumers`, ping-pong) take alternate work items; their mainloops take turns through two
  more mbarriers (`turn`): a consumer starts item i once the other has issued its MMAs of every earlier item, so
  each waits on the ring within one phase (kernels/ws_ring.py, "Parity"), as CUTLASS's ping-pong kernels order
  their math warpgroups.

Row parts (`WsConfig.block_m` 192): three consumer partitions of one warpgroup each take rows 0-63, 64-127 and
128-191 of every work item, each with its own 64xBN accumulator, on one ring whose stages hold three 64-row A
blocks and one W block (kernels/ws_ring.py, "Row parts"); a part with no rows before the expert's end passes the
item's stages on (`_pass_tile`). So an expert of 129-192 rows reads each weight block once, in one CTA, where 64-row
tiles read it three times (from L2) and 128-row tiles twice with 256 rows of MMAs. The 16 warps leave 128 registers
per thread at launch, within which ptxas allocates every partition: BN = 128 (a 64x256 accumulator's wgmma needs
154). On an H100 (bench/results/h100-25eba99, each GEMM alone, one rank's work of EP=2): DeepSeek-V2 at 2048 tokens
(154 rows per expert) GEMM0 1044.6 us against 1169.0 for 64x256x64 and the library's 1018.1, GEMM1 545.7 against
628.3 and 571.8; DeepSeek-V3 (128) 3098.1 / 1526.8 against the Triton kernels' 3147.8 / 1591.6; slower where the
MMAs bind (at 8192 tokens) or the weights are small (H = 2048). The H100 table picks them where they win; the
rule below does not. `WsConfig.row_split` makes a 128-row tile two row parts the same way (12 warps: 168 registers
at launch, so BN 256 fits; for 65-128 rows per expert, where a 192-row tile leaves a part idle); compiled without
spills, not yet measured.

Split tails (`WsConfig.split_tail`): the table's section 1 (tails of at most BM / 2 rows) runs after section 0 as
64-row tiles whose A blocks fill the first half of a stage's A buffer, one consumer, the ring's steps going on.
Not covered here (kernels/grouped_gemm.py has them): stream-K, the gather rows, TMA epilogues, programmatic
dependent launch. Gluon has no interpreter: on the CPU the kernels are compiled for sm_90 and their
PTX read (tests/test_ws_gemm.py); on a GPU scripts/ws_gemm_probe.py checks them against torch and times them beside
the Triton grouped GEMMs and `torch._grouped_mm`. The layer runs them with KernelConfig.ws_gemm (off). On an H100
(bench/results/h100-a9c802a): every config correct (the probe's small check, every shape's check, the layer's
calls with ws_gemm on); faster than the Triton kernels where the weights stream (DeepSeek-V3's GEMM0 at 2048
tokens per rank 3187 against 4233 us), as fast or up to 6% slower at 384-1024 rows per expert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents

from weave_moe.backends.weave.kernels.grouped_tiles import TileTable
from weave_moe.backends.weave.kernels.ws_ring import (MAX_RING_BYTES, allocate_ring, check_operands, producer,
                                                       producer_warps, ready_arrivals, section_work,
                                                       weight_descriptor, work_tile)

__all__ = ["WsConfig", "ws_gemm0", "ws_gemm1", "ws_launch", "default_config", "default_configs", "DEFAULT_CONFIG",
           "ROW_PART_CONFIGS", "MIN_ROWS_PER_EXPERT", "MAX_ROWS_PER_EXPERT"]

#: registers a thread may hold (the hardware's limit per thread)
MAX_REGS = 255
#: rows of a row part: one warpgroup's wgmma height (module docstring, "Row parts")
ROW_PART = 64
#: registers a consumer thread needs beyond its accumulator's around the wgmma (ptxas asked for 154 with a 64x256
#: fp32 accumulator, 128 registers: "Insufficient registers (128) ... register target of 154 or higher")
MMA_REGS = 26
#: fp32 accumulator registers per consumer thread at most: 128x256 over 8 warps; 128x256 over 4 warps (256) spills
#: in ptxas (tests/test_ws_gemm.py)
ACCUMULATOR_REGS = 128


@dataclass(frozen=True)
class WsConfig:
    """Tile shape and partitions of one warp-specialised grouped GEMM launch.

    Attributes:
        block_m: rows per M tile: 64 (one warpgroup of 4 warps, or two side by side over N), 128 (two warpgroups
            of 64 rows, or one over both halves when the accumulator fits: ACCUMULATOR_REGS; or with `row_split`
            two row parts) or 192 (row parts: three consumer partitions of one warpgroup, each over 64 rows of
            every work item, the W stage shared; `row_parts`).
        block_n: accumulator columns per tile (GEMM0: BN / 2 gate-up pairs, BN / 2 columns of h), at most 256.
        block_k: K step.
        stages: shared-memory stages of the load ring (at least 2).
        group_m: M tiles that sweep the N tiles together (L2 reuse of weight blocks), as GemmConfig.group_m.
        num_warps: the consumer's warps: 4 or 8.
        producer_regs: registers per thread of the producer warp (setmaxnreg; 24 to 256, a multiple of 8).
        maxnreg: the kernel's registers per thread before the partitions redistribute them (the consumer gets what
            the producer's warpgroup gives back); with one CTA per SM, 65536 / (32 * warps) at most, over every
            partition's warps (the producer's rounded up to a warpgroup); 0: that bound (`registers`).
        consumers: 1 (one consumer partition over every tile: its epilogue stops the MMAs, the producer's loads go
            on) or 2 (ping-pong: two consumer partitions of `num_warps` warps take alternate work items, so one's
            epilogue runs while the other's MMAs do; the ring's stages still pass in the CTA's work order).
        consumer_regs: with 2 consumers, the second's registers per thread (setmaxnreg); the first gets the rest.
            Two consumers of 8 warps do not fit an SM's registers: ping-pong takes 4-warp consumers.
        split_tail: the tile table's tails of at most block_m / 2 rows run as 64-row tiles after the full ones
            (`grouped_tiles.TileTable`, as GemmConfig.split_tail): less padding. 128-row tiles and one consumer
            only (the tails' A blocks fill the first half of a stage's A buffer; wgmma needs 64 rows).
        k_blocked: the weights in the K-blocked layout of block_k (`ws_ring.block_weights`): each K step's W block
            one contiguous run of memory. The caller holds its weights so (a probe of the DRAM access pattern
            where the GEMMs stream their weights; no layer holds them so yet).
        row_split: a 128-row tile as two row parts (two consumer partitions of one warpgroup, 64 rows each, the W
            stage shared: module docstring, "Row parts") instead of one partition over both halves.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 4
    group_m: int = 8
    num_warps: int = 8
    producer_regs: int = 40
    maxnreg: int = 0
    consumers: int = 1
    consumer_regs: int = 232
    split_tail: bool = False
    k_blocked: bool = False
    row_split: bool = False

    def __post_init__(self):
        if self.block_m not in (64, 128, ROW_PART * 3):
            raise ValueError(f"WsConfig.block_m must be 64, 128 or {ROW_PART * 3}, got {self.block_m}")
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"WsConfig.block_n must be 64, 128 or 256, got {self.block_n}")
        if self.block_k not in (32, 64, 128):
            raise ValueError(f"WsConfig.block_k must be 32, 64 or 128, got {self.block_k}")
        if self.num_warps not in (4, 8):
            raise ValueError(f"WsConfig.num_warps must be 4 or 8, got {self.num_warps}")
        if not 2 <= self.stages <= 8 or self.group_m < 1:
            # one stage would be refilled while the MMA that reads it is in flight (the consumer releases a stage
            # one step late)
            raise ValueError(f"WsConfig.stages must be in [2, 8] and group_m >= 1, got {self.stages}, {self.group_m}")
        if self.row_split and self.block_m != 2 * ROW_PART:
            raise ValueError(f"WsConfig.row_split: {2 * ROW_PART}-row tiles only, got block_m={self.block_m}")
        if self.row_parts > 1 and (self.num_warps != 4 or self.consumers != 1 or self.split_tail):
            raise ValueError(f"WsConfig: {self.block_m}-row tiles are {self.row_parts} consumers of one warpgroup "
                             f"each (num_warps=4, consumers=1, no split_tail)")
        rows = self.block_m // self.row_parts
        if rows * self.block_n > ACCUMULATOR_REGS * 32 * self.num_warps:
            raise ValueError(f"WsConfig: a {rows}x{self.block_n} fp32 accumulator over {self.num_warps} warps "
                             f"holds more than {ACCUMULATOR_REGS} registers per thread (it spills)")
        if self.row_parts > 1 and rows * self.block_n // (32 * self.num_warps) + MMA_REGS > self.registers:
            # ptxas allocates every partition within the launch's registers (128 for 16 warps, 168 for 12): a 64x256
            # accumulator's wgmma needs 154, a 64x128 one compiles without spills in 128 (tests/test_ws_gemm.py)
            raise ValueError(f"WsConfig: {self.row_parts} row parts of {rows}x{self.block_n} accumulators need more "
                             f"than the {self.registers} registers per thread of {self.warps} warps: use block_n=128")
        if not 24 <= self.producer_regs <= 256 or self.producer_regs % 8:
            raise ValueError(f"WsConfig.producer_regs must be a multiple of 8 in [24, 256], got {self.producer_regs}")
        if self.shared_bytes > MAX_RING_BYTES:
            raise ValueError(f"WsConfig: {self.stages} stages of {self.block_m}x{self.block_k} + {self.block_n}x"
                             f"{self.block_k} bf16 take {self.shared_bytes} bytes of shared memory, over "
                             f"{MAX_RING_BYTES}")
        if self.consumers not in (1, 2):
            raise ValueError(f"WsConfig.consumers must be 1 or 2, got {self.consumers}")
        if not 24 <= self.consumer_regs <= 256 or self.consumer_regs % 8:
            raise ValueError(f"WsConfig.consumer_regs must be a multiple of 8 in [24, 256], got {self.consumer_regs}")
        if self.split_tail and (self.block_m != 128 or self.consumers != 1):
            raise ValueError("WsConfig.split_tail: 128-row tiles and one consumer only (64-row tails)")
        if self.consumers == 2 and self.num_warps != 4:
            raise ValueError("WsConfig: two consumers (ping-pong) of 8 warps do not fit an SM's registers: use "
                             "num_warps=4")
        if self.maxnreg and (self.maxnreg * 32 * self.warps > 65536 or self.maxnreg > MAX_REGS):
            raise ValueError(f"WsConfig.maxnreg = {self.maxnreg}: {self.warps} warps of it exceed the 65536 "
                             f"registers of an SM")

    @property
    def row_parts(self) -> int:
        """Consumer partitions that share each work item, one per ROW_PART rows (module docstring, "Row parts")."""
        return self.block_m // ROW_PART if self.block_m > 2 * ROW_PART or self.row_split else 1

    @property
    def part_regs(self) -> int:
        """With row parts, each worker consumer's registers per thread (setmaxnreg): an equal share of the CTA's
        (`registers` per thread over every partition's warpgroups) after the producer's, a multiple of 8; the default
        partition (the first part) gets what is left."""
        groups = self.warps // 4
        return (groups * self.registers - self.producer_regs) // self.row_parts // 8 * 8

    @property
    def worker_regs(self) -> int:
        """The worker consumer partitions' registers per thread (setmaxnreg): ping-pong's second consumer
        `consumer_regs`, the row parts after the first `part_regs`."""
        return self.consumer_regs if self.consumers == 2 else self.part_regs

    @property
    def warps(self) -> int:
        """Every partition's warps: the consumers', and the producer's warp rounded up to a warpgroup."""
        return self.consumers * self.row_parts * self.num_warps + 4

    @property
    def registers(self) -> int:
        """The kernel's registers per thread (`maxnreg`, else the most that one CTA per SM allows, a multiple of 8)."""
        return self.maxnreg or min(MAX_REGS // 8 * 8, 65536 // (32 * self.warps) // 8 * 8)

    @property
    def gathers(self) -> bool:
        """Whether GEMM0 of this config may read A's rows through gather rows (`ws_launch(gather=)`): one consumer
        or row parts, no split tails (the gathering producer walks section 0 only)."""
        return self.consumers == 1 and not self.split_tail

    @property
    def shared_bytes(self) -> int:
        """The load ring's shared memory (bf16 A and W blocks, S stages)."""
        return 2 * self.stages * (self.block_m + self.block_n) * self.block_k

    @property
    def short(self) -> str:
        """The compact name `parse` reads back, e.g. "64x256x64w4s4" ("c2": two consumers; "g<n>" / "p<n>" / "r<n>":
        group_m / the producer's registers / maxnreg where not the defaults; "t": split tails; "h": `row_split`)."""
        name = f"{self.block_m}x{self.block_n}x{self.block_k}w{self.num_warps}s{self.stages}"
        name += "c2" if self.consumers == 2 else ""
        name += f"g{self.group_m}" if self.group_m != WsConfig.group_m else ""
        name += f"p{self.producer_regs}" if self.producer_regs != WsConfig.producer_regs else ""
        name += f"r{self.maxnreg}" if self.maxnreg else ""
        return name + ("b" if self.k_blocked else "") + ("t" if self.split_tail else "") + ("h" if self.row_split
                                                                                          else "")

    @classmethod
    def parse(cls, text: str) -> "WsConfig":
        """The config of a compact name (`short`): "128x256x64w8s4", then optionally "c2" (two consumers), "g4"
        (group_m), "p40" (producer registers), "r168" (maxnreg), "b" (K-blocked weights), "t" (split tails), "h"
        (`row_split`); ValueError naming the text otherwise."""
        match = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(c2)?(?:g(\d+))?(?:p(\d+))?(?:r(\d+))?(b)?(t)?(h)?",
                             text.strip())
        if not match:
            raise ValueError(f"warp-specialised GEMM config {text!r}: expected e.g. "
                             f"128x256x64w8s4[c2][g4][p40][r168][b][t][h]")
        bm, bn, bk, warps, stages, pingpong, group, producer, maxnreg, blocked, tail, halves = match.groups()
        fields = dict(block_m=int(bm), block_n=int(bn), block_k=int(bk), num_warps=int(warps), stages=int(stages),
                      consumers=2 if pingpong else 1, split_tail=tail is not None, k_blocked=blocked is not None,
                      row_split=halves is not None)
        if group:
            fields["group_m"] = int(group)
        if producer:
            fields["producer_regs"] = int(producer)
        if maxnreg:
            fields["maxnreg"] = int(maxnreg)
        return cls(**fields)

    def __str__(self) -> str:
        pingpong = f" pingpong c{self.consumer_regs}" if self.consumers == 2 else ""
        tail = " tail" if self.split_tail else ""
        blocked = " kblocked" if self.k_blocked else ""
        blocked += " halves" if self.row_split else ""
        group = f" g{self.group_m}" if self.group_m != WsConfig.group_m else ""
        return (f"ws {self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.stages}{group} "
                f"p{self.producer_regs} r{self.registers}{pingpong}{blocked}{tail}")


@gluon.constexpr_function
def _warps_per_cta(block_m, num_warps):
    """The consumer's warps over the tile: from the wgmma atom [4, 1] (4 warps x 16 rows = 64 rows), doubled along
    M while the rows allow, then along N."""
    warps = [4, 1]
    while warps[0] * warps[1] < num_warps:
        if block_m > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    return warps


@gluon.constexpr_function
def _mma_layout(block_m, block_n, num_warps):
    """The accumulator's layout: wgmma over `_warps_per_cta`, one instruction as wide as a warpgroup's columns."""
    warps = _warps_per_cta(block_m, num_warps)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, block_n // warps[1], 16])


@gluon.constexpr_function
def _store_layout(block_n, num_warps):
    """A coalesced layout for the epilogue's stores: 8 bf16 (16 bytes) per thread along a row."""
    columns = max(1, min(32, block_n // 8))
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // columns, columns],
                            warps_per_cta=[num_warps, 1], order=[1, 0])


@gluon.jit
def _consume_tile(a_bufs, w_bufs, ready, empty, turn, out_ptr, scale_ptr, m_start, m_end, n, step, K, n_out,
                  GEMM: gl.constexpr, HAS_SCALE: gl.constexpr, ROWS: gl.constexpr, CONSUMER: gl.constexpr,
                  CONSUMERS: gl.constexpr, WARPS: gl.constexpr, GATHER_A: gl.constexpr, PART: gl.constexpr = 0,
                  PARTS: gl.constexpr = 1):
    """One work item of ROWS rows (the first ROWS of each stage's A buffer, or with PARTS > 1 the buffer of row part
    PART: ws_ring, "Row parts"; out's rows from `m_start`) from ring step `step` on: its wgmma, then its epilogue;
    returns the step after it. GATHER_A: the A blocks were written by cp.async (generic proxy), fenced before the
    wgmma reads them (ws_ring, "Gathered A rows")."""
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = w_bufs.shape[1]
    STAGES: gl.constexpr = w_bufs.shape[0]
    OUT_N: gl.constexpr = BLOCK_N // 2 if GEMM == 0 else BLOCK_N
    mma_layout: gl.constexpr = _mma_layout(ROWS, BLOCK_N, WARPS)
    out_layout: gl.constexpr = _store_layout(OUT_N, WARPS)
    acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    for k in range(0, K, BLOCK_K):
        stage = step % STAGES
        mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
        if GATHER_A:
            fence_async_shared()
        if PARTS > 1:
            a = a_bufs.index(stage * PARTS + PART)
        elif ROWS == a_bufs.shape[1]:
            a = a_bufs.index(stage)
        else:
            a = a_bufs.index(stage).slice(0, ROWS)
        acc = warpgroup_mma(a, w_bufs.index(stage).permute((1, 0)), acc, is_async=True)
        # the MMA of the step before has finished: its stage may be refilled
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k > 0)
        step += 1
    if CONSUMERS == 2:   # every MMA of this item issued: the other consumer's turn
        mbarrier.arrive(turn.index(1 - CONSUMER))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))   # K >= 8: the tile had a step
    if GEMM == 0:   # h = silu(gate) * up: gate j and up j are adjacent columns (interleaved w13)
        gate, up = acc.reshape([ROWS, BLOCK_N // 2, 2]).split()
        values = gate / (1.0 + gl.exp(-gate)) * up
    else:
        values = acc
        if HAS_SCALE:
            rows = gl.minimum(m_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_layout)), m_end - 1)
            values = values * gl.load(scale_ptr + rows)[:, None]
    values = gl.convert_layout(values.to(gl.bfloat16), out_layout)
    rows = m_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_layout))
    cols = n * OUT_N + gl.arange(0, OUT_N, layout=gl.SliceLayout(0, out_layout))
    mask = (rows < m_end)[:, None] & (cols < n_out)[None, :]
    gl.store(out_ptr + rows.to(gl.int64)[:, None] * n_out + cols[None, :], values, mask=mask)
    return step


@gluon.jit
def _pass_tile(ready, empty, step, K, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """A row part with no rows in a work item (module docstring, "Row parts"): each of the item's steps waits for
    its stage and releases it, so the ring's `empty` still counts every part once per step; returns the step after
    the item."""
    for k in range(0, K, BLOCK_K):
        stage = step % STAGES
        mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
        mbarrier.arrive(empty.index(stage))
        step += 1
    return step


@gluon.jit
def _consumer(a_bufs, w_bufs, ready, empty, turn, out_ptr, scale_ptr, tiles_ptr, num_tiles_ptr, width, num_n, K,
              n_out, GEMM: gl.constexpr, HAS_SCALE: gl.constexpr, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr,
              SPLIT_TAIL: gl.constexpr, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr, WARPS: gl.constexpr,
              GATHER_A: gl.constexpr, PART: gl.constexpr = 0, PARTS: gl.constexpr = 1):
    """An MMA partition (consumer CONSUMER of CONSUMERS, WARPS warps): the wgmma of every stage of its work items
    (the CTA's items CONSUMER, CONSUMER + CONSUMERS, ...), then each tile's epilogue (module docstring). With two
    consumers their mainloops take turns (`turn`, module docstring); with SPLIT_TAIL (one consumer) section 1's
    half-height tiles follow section 0's. With PARTS > 1 (one consumer, "Row parts") it is row part PART of every
    item: its buffer's rows (a_bufs.shape[1]) from PART times that on, or none past the expert's end
    (`_pass_tile`)."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    pid = gl.program_id(0)
    num_work = gl.load(num_tiles_ptr) * num_n
    k_steps = gl.cdiv(K, BLOCK_K)
    step = 0
    for work in range(pid + CONSUMER * NUM_SMS, num_work, CONSUMERS * NUM_SMS):
        expert, m_start, m_end, n = work_tile(tiles_ptr, width, work, gl.load(num_tiles_ptr), num_n, GROUP_M)
        # the CTA's item index; the ring's step of its first K step (the producer loads the items in order)
        index = (work - pid) // NUM_SMS
        step = index * k_steps
        if CONSUMERS == 2:   # wait for the other consumer's mainloops of the items before this one
            turns = index // 2 + CONSUMER
            mbarrier.wait(turn.index(CONSUMER), (turns - 1) & 1, pred=turns > 0)
        if PARTS == 1:
            step = _consume_tile(a_bufs, w_bufs, ready, empty, turn, out_ptr, scale_ptr, m_start, m_end, n, step, K,
                                 n_out, GEMM, HAS_SCALE, BLOCK_M, CONSUMER, CONSUMERS, WARPS, GATHER_A)
        else:
            part_start = m_start + PART * BLOCK_M   # a part's buffer: BLOCK_M rows (ws_ring, "Row parts")
            if part_start < m_end:
                step = _consume_tile(a_bufs, w_bufs, ready, empty, turn, out_ptr, scale_ptr, part_start, m_end, n,
                                     step, K, n_out, GEMM, HAS_SCALE, BLOCK_M, CONSUMER, CONSUMERS, WARPS, GATHER_A,
                                     PART, PARTS)
            else:
                step = _pass_tile(ready, empty, step, K, BLOCK_K, w_bufs.shape[0])
    if SPLIT_TAIL:   # one consumer: `step` is the ring's step after section 0
        num_tails = gl.load(num_tiles_ptr + 1)
        for work in range(section_work(pid, num_work, NUM_SMS), num_tails * num_n, NUM_SMS):
            expert, m_start, m_end, n = work_tile(tiles_ptr + width // 2, width, work, num_tails, num_n, GROUP_M)
            step = _consume_tile(a_bufs, w_bufs, ready, empty, turn, out_ptr, scale_ptr, m_start, m_end, n, step, K,
                                 n_out, GEMM, HAS_SCALE, BLOCK_M // 2, CONSUMER, CONSUMERS, WARPS, GATHER_A)


@gluon.jit
def _ws_gemm_kernel(a_desc, a_tail_desc, w_desc, out_ptr, scale_ptr, tiles_ptr, num_tiles_ptr, max_tiles, K, n_out,
                    w_rows, a_ptr, gather_ptr, GEMM: gl.constexpr, HAS_SCALE: gl.constexpr, GROUP_M: gl.constexpr,
                    NUM_SMS: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                    CONSUMERS: gl.constexpr, WORKER_REGS: gl.constexpr, SPLIT_TAIL: gl.constexpr,
                    W_BLOCKED: gl.constexpr, GATHER_A: gl.constexpr, CHAIN: gl.constexpr, ROW_PARTS: gl.constexpr,
                    num_warps: gl.constexpr):
    """out[m, j] over every tile of the table: GEMM 0: a = the rows, w = the interleaved w13 as [E_local * 2I, H],
    out = h [P, I] (n_out = I, w_rows = 2I); GEMM 1: a = h, w = w2 as [E_local * H, I], out = y [P, H] (n_out = H,
    w_rows = H), times scale[m] with HAS_SCALE. K: the reduction length (H or I). SPLIT_TAIL: the table's section 1
    too (tiles of BM / 2 rows, A through a_tail_desc; a_desc again otherwise). GATHER_A (GEMM0, one consumer, no
    split tails): row m of A is a_ptr's row gather_ptr[m] ([*, H], loaded by `producer`'s cp.async; a_desc then only
    shapes the ring's A buffers). CHAIN: GEMM0 lets the next kernel start early, GEMM1 is launched programmatically
    after it (kernels/ws_ring.py, "Chained launches"). ROW_PARTS > 1: that many consumers share each work item, one
    per BLOCK_M / ROW_PARTS rows ("Row parts"). WORKER_REGS: the registers of the worker consumers (ping-pong's
    second, the row parts after the first; `WsConfig.worker_regs`)."""
    if CHAIN and GEMM == 0:
        gdc_launch_dependents()   # the chained GEMM1 may start its CTAs (ws_ring, "Chained launches")
    a_bufs, w_bufs, ready, empty = allocate_ring(a_desc, w_desc, STAGES, ready_arrivals(GATHER_A), ROW_PARTS)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())   # ping-pong only
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    width = 2 * max_tiles
    num_n = gl.cdiv(n_out * (2 if GEMM == 0 else 1), w_desc.block_type.shape[0])
    # (the partitions' arguments written out in each call: a tuple built here would lose its constexprs)
    if CONSUMERS == 1 and ROW_PARTS == 1:   # one consumer partition over every tile
        gl.warp_specialize([
            (_consumer, (a_bufs, w_bufs, ready, empty, turn, out_ptr, scale_ptr, tiles_ptr, num_tiles_ptr, width, num_n, K,
                         n_out, GEMM, HAS_SCALE, GROUP_M, NUM_SMS, SPLIT_TAIL, 0, 1, num_warps, GATHER_A)),
            (producer, (a_desc, a_tail_desc, w_desc, a_bufs, w_bufs, ready, empty, tiles_ptr, num_tiles_ptr, width,
                         num_n, K, w_rows, a_ptr, gather_ptr, GROUP_M, NUM_SMS, SPLIT_TAIL, W_BLOCKED,
                         CHAIN and GEMM == 1, GATHER_A)),
        ], [producer_warps(GATHER_A)], [PRODUCER_REGS])
    elif ROW_PARTS < 3:   # two consumers: ping-pong over alternate work items, or two row parts of every item
        gl.warp_specialize([
            (_consumer, (a_bufs, w_bufs, ready, empty, turn, out_ptr, scale_ptr, tiles_ptr, num_tiles_ptr, width, num_n, K,
                         n_out, GEMM, HAS_SCALE, GROUP_M, NUM_SMS, False, 0, CONSUMERS, num_warps, GATHER_A, 0,
                         ROW_PARTS)),
            (_consumer, (a_bufs, w_bufs, ready, empty, turn, out_ptr, scale_ptr, tiles_ptr, num_tiles_ptr, width, num_n, K,
                         n_out, GEMM, HAS_SCALE, GROUP_M, NUM_SMS, False, CONSUMERS - 1, CONSUMERS, num_warps, GATHER_A,
                         ROW_PARTS - 1, ROW_PARTS)),
            (producer, (a_desc, a_tail_desc, w_desc, a_bufs, w_bufs, ready, empty, tiles_ptr, num_tiles_ptr, width,
                         num_n, K, w_rows, a_ptr, gather_ptr, GROUP_M, NUM_SMS, False, W_BLOCKED,
                         CHAIN and GEMM == 1, GATHER_A, ROW_PARTS)),
        ], [num_warps, producer_warps(GATHER_A)], [WORKER_REGS, PRODUCER_REGS])
    else:   # three row parts: the default partition the first, two workers the others
        gl.warp_specialize([
            (_consumer, (a_bufs, w_bufs, ready, empty, turn, out_ptr, scale_ptr, tiles_ptr, num_tiles_ptr, width, num_n, K,
                         n_out, GEMM, HAS_SCALE, GROUP_M, NUM_SMS, False, 0, 1, num_warps, GATHER_A, 0, 3)),
            (_consumer, (a_bufs, w_bufs, ready, empty, turn, out_ptr, scale_ptr, tiles_ptr, num_tiles_ptr, width, num_n, K,
                         n_out, GEMM, HAS_SCALE, GROUP_M, NUM_SMS, False, 0, 1, num_warps, GATHER_A, 1, 3)),
            (_consumer, (a_bufs, w_bufs, ready, empty, turn, out_ptr, scale_ptr, tiles_ptr, num_tiles_ptr, width, num_n, K,
                         n_out, GEMM, HAS_SCALE, GROUP_M, NUM_SMS, False, 0, 1, num_warps, GATHER_A, 2, 3)),
            (producer, (a_desc, a_tail_desc, w_desc, a_bufs, w_bufs, ready, empty, tiles_ptr, num_tiles_ptr, width,
                         num_n, K, w_rows, a_ptr, gather_ptr, GROUP_M, NUM_SMS, False, W_BLOCKED,
                         CHAIN and GEMM == 1, GATHER_A, 3)),
        ], [num_warps, num_warps, producer_warps(GATHER_A)], [WORKER_REGS, WORKER_REGS, PRODUCER_REGS])


#: `default_config`'s rows per expert on average: from a 64-row tile's worth (below: the decode kernels) to where
#: the weights stream rather than the MMAs bind (above: the Triton kernels measured as fast or faster)
MIN_ROWS_PER_EXPERT, MAX_ROWS_PER_EXPERT = 64, 256
#: what `default_config` picks: measured fastest of the candidates at 128-154 rows per expert
DEFAULT_CONFIG = WsConfig(block_m=64, num_warps=4)


#: the 192-row tiles `weave-moe tune --ws auto` measures beside the rule's configs (module docstring, "Row parts"):
#: 4 and 5 stages (the tuner picked each on an H100, bench/results/h100-a287829), and 4 stages with GROUP_M 1 and 2:
#: where an expert has one or two such tiles, a group of 8 sweeps 8 experts' weights at once; fewer sweep each
#: expert's contiguously (each GEMM alone on an H100, DeepSeek-V2 at 2048 tokens, one rank's work of EP=2: GEMM0
#: 996 / 964 / 949 us with GROUP_M 8 / 4 / 2 and GEMM1 528 / 515 / 511 in one run, bench/results/h100-f012e48;
#: GEMM0 941 / 933 with GROUP_M 2 / 1 and GEMM1 506 / 504 in another, h100-7180516)
ROW_PART_CONFIGS = (WsConfig(block_m=192, block_n=128, num_warps=4, stages=4),
                    WsConfig(block_m=192, block_n=128, num_warps=4, stages=5),
                    WsConfig(block_m=192, block_n=128, num_warps=4, stages=4, group_m=2),
                    WsConfig(block_m=192, block_n=128, num_warps=4, stages=4, group_m=1))


def default_config(gemm: int, rows: int, num_local_experts: int) -> WsConfig | None:
    """The config of a warp-specialised GEMM of `rows` rows over `num_local_experts` experts (KernelConfig.ws_gemm),
    or None where the Triton grouped GEMMs keep it: DEFAULT_CONFIG (64x256x64 tiles, one warpgroup, 4 stages) from
    MIN_ROWS_PER_EXPERT to MAX_ROWS_PER_EXPERT rows per expert on average, where the GEMMs stream their weights.
    Measured on an H100 (bench/results/h100-a9c802a, each GEMM alone, cold L2, against the Triton kernel with the
    layer's config, no H100 prefill table there): GEMM0 + GEMM1 at 2048 tokens per rank, one rank's work of EP=2,
    DeepSeek-V3 (128 rows per expert) 0.753 / 0.991, DeepSeek-V2 (154) 0.869 / 0.936, Qwen3.5-35B-A3B (128) 0.936 /
    0.929; at 384-1024 rows per expert 0.99-1.06 (DeepSeek-V3 at 8192 tokens 1.057 / 1.062): the Triton kernels
    keep those, also where the Gluon GEMM0 would read the gather rows (KernelConfig.ws_gather) and the Triton one
    needs the gather launch's copy first: 128x256x64 tiles through the gather rows made DeepSeek-V3's call at 8192
    tokens 13.01 against 11.55 ms, DeepSeek-V2's 4.33 against 4.26 (bench/results/h100-5af6fb0). Below
    MIN_ROWS_PER_EXPERT: None here (kernels/ws_decode.py's `default_config` serves decode sizes)."""
    mean = rows / max(num_local_experts, 1)
    return DEFAULT_CONFIG if MIN_ROWS_PER_EXPERT <= mean <= MAX_ROWS_PER_EXPERT else None


def default_configs() -> tuple[WsConfig, ...]:
    """Every config `default_config` may pick (what a layer compiles before its first call)."""
    return (DEFAULT_CONFIG, )


def ws_launch(gemm: int, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tiles: TileTable, config: WsConfig,
              scale: torch.Tensor | None = None, num_sms: int | None = None,
              gather: torch.Tensor | None = None, chained: bool = False) -> tuple:
    """(kernel, grid, args, kwargs) of one launch: `gemm` 0 (a [P, H], w the interleaved w13 [E_local, 2I, H], out
    h [P, I]) or 1 (a = h [P, I], w = w2 [E_local, H, I], out y [P, H], `scale` fp32 [P] or None); `num_sms`: the
    grid (also the NUM_SMS constexpr), else the device's SMs (a compile-only test passes the GPU's). `gather`
    (GEMM0 of a config that `gathers`): int32 rows of a, which then holds the source rows [S, H] in any order:
    row m of A is a[gather[m]] (kernels/ws_ring.py, "Gathered A rows"), as `grouped_gemm.grouped_gemm0(gather=)`.
    `chained`: a GEMM0 that lets a chained GEMM1 start early, or a GEMM1 launched programmatically after such a
    GEMM0 (kernels/ws_ring.py, "Chained launches"; both of a call or neither)."""
    K, num_experts, w_rows, n_out = check_operands(gemm, a, w, out, tiles, config, scale, gather)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    a_box = [bm // config.row_parts, bk]   # a row part's box (kernels/ws_ring.py, "Row parts")
    a_layout = gl.NVMMASharedLayout.get_default_for(a_box, gl.bfloat16)   # the tails' too: the same swizzle rows
    a_desc = TensorDescriptor.from_tensor(a, a_box, a_layout)
    a_tail_desc = TensorDescriptor.from_tensor(a, [bm // 2, bk], a_layout) if config.split_tail else a_desc
    w_desc = weight_descriptor(w, config, bn)
    num_sms = num_sms or torch.cuda.get_device_properties(a.device).multi_processor_count
    args = (a_desc, a_tail_desc, w_desc, out, scale if scale is not None else out, tiles.table, tiles.num_tiles,
            tiles.max_tiles, K, n_out, w_rows, a, gather if gather is not None else tiles.table)
    kwargs = dict(GEMM=gemm, HAS_SCALE=scale is not None, GROUP_M=config.group_m, NUM_SMS=num_sms,
                  STAGES=config.stages, PRODUCER_REGS=config.producer_regs, CONSUMERS=config.consumers,
                  WORKER_REGS=config.worker_regs, SPLIT_TAIL=config.split_tail, W_BLOCKED=config.k_blocked,
                  GATHER_A=gather is not None, CHAIN=chained, ROW_PARTS=config.row_parts,
                  num_warps=config.num_warps, maxnreg=config.registers,
                  launch_pdl=chained and gemm == 1)
    return _ws_gemm_kernel, (num_sms, ), args, kwargs


def ws_gemm0(a: torch.Tensor, w13: torch.Tensor, h: torch.Tensor, tiles: TileTable,
             config: WsConfig = WsConfig(), gather: torch.Tensor | None = None, chained: bool = False) -> torch.Tensor:
    """h = silu(a @ gate^T) * (a @ up^T) per expert (grouped_gemm.grouped_gemm0's result), one persistent launch;
    w13: `grouped_gemm.interleave_w13(w13)`; tiles: `build_tile_table(offsets, config.block_m, P)`; with `gather`
    row m of A is a[gather[m]]; `chained`: a chained GEMM1 follows (`ws_launch`)."""
    kernel, grid, args, kwargs = ws_launch(0, a, w13, h, tiles, config, gather=gather, chained=chained)
    kernel[grid](*args, **kwargs)
    return h


def ws_gemm1(h: torch.Tensor, w2: torch.Tensor, y: torch.Tensor, tiles: TileTable, config: WsConfig = WsConfig(),
             scale: torch.Tensor | None = None, chained: bool = False) -> torch.Tensor:
    """y = scale * (h @ w2[expert]^T) per expert (grouped_gemm.grouped_gemm1's result), one persistent launch;
    `chained`: launched programmatically after a chained GEMM0 (`ws_launch`)."""
    kernel, grid, args, kwargs = ws_launch(1, h, w2, y, tiles, config, scale, chained=chained)
    kernel[grid](*args, **kwargs)
    return y

