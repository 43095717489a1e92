"""Warp-specialised grouped GEMMs for decode sizes, in Gluon: the expert MLP's GEMM0 + SiLU-mul and GEMM1 with the
weights as the MMA's M side ("swap AB"), so that a few token rows per expert still run on wgmma and a producer warp
keeps the weights streaming.

Shape legend: BT = token rows per tile (the tile table's block_m), BW = weight rows per tile, BK = K step, S = stages.

Why. At decode sizes an expert holds a few rows and a GEMM streams its weights: Qwen3-30B-A3B at 1 token per rank
(one rank's work of EP=2) reads 75 MB of weights, ~22.5 us at an H100's HBM rate, and its grouped GEMMs took 21.4 +
14.0 us in a call (docs/perf-notes.md entry 42): ~2.3 TB/s for GEMM0 over its 96 tiles, ~25 GB/s per busy SM. The
Triton kernels there run 16-row tiles on mma.sync (wgmma needs 64 rows) with the loads issued by the warps that
multiply. Here the tile is BW weight rows x BT token rows: acc^T [BW, BT] = W [BW, K] @ A [BT, K]^T, one wgmma
m64nBTk16 per warpgroup and k16 step (A's block is the wgmma's B operand through a transposed view of its K-major
shared-memory block), and the loads come from kernels/ws_ring.py's producer partition: a warp that keeps S stages of
(BW + BT) x BK bf16 in flight, across tiles, with few registers. Smaller weight tiles (BW = 64) also spread an
expert's weights over more SMs (Qwen3-30B-A3B's GEMM0 at 1 token: 8 experts x 24 tiles instead of 96 tiles).

The ring, its protocol, the work order and the tile table are kernels/ws_ring.py's (one consumer). The epilogue is
transposed: GEMM0's accumulator rows are interleaved w13 rows (gate j, up j neighbours, `grouped_gemm.
interleave_w13`), split in pairs after a layout change that puts each pair in one thread, and h[t, j] is stored for
the tile's token rows t below the expert's end; GEMM1 stores y[t, j] (times the row's routing weight with `scale`).
Gluon has no interpreter: compiled for sm_90 on the CPU (tests/test_ws_decode.py), run by scripts/ws_gemm_probe.py
(`--decode`) on a GPU. The layer runs it with KernelConfig.ws_gemm below ws_gemm.MIN_ROWS_PER_EXPERT rows per expert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents

from weave_moe.backends.weave.kernels.grouped_tiles import TileTable
from weave_moe.backends.weave.kernels.ws_ring import (MAX_RING_BYTES, allocate_ring, check_operands, producer,
                                                       weight_descriptor, work_tile)

__all__ = ["WsDecodeConfig", "ws_decode_gemm0", "ws_decode_gemm1", "ws_decode_launch", "default_config",
           "default_configs"]


@dataclass(frozen=True)
class WsDecodeConfig:
    """Tile shape and partitions of one decode launch.

    Attributes:
        block_t: token rows per tile (the tile table's block_m; the wgmma's N): 8, 16, 32 or 64.
        block_w: weight rows per tile: 64 (one warpgroup) or 128 (two); GEMM0: block_w / 2 columns of h.
        block_k: K step: 64 or 128.
        stages: shared-memory stages of the load ring (at least 2).
        producer_regs: registers per thread of the producer warp.
        k_blocked: the weights in the K-blocked layout of block_k (`ws_ring.block_weights`), as WsConfig.k_blocked
            (a probe's; no layer holds its weights so).
    """

    block_t: int = 16
    block_w: int = 64
    block_k: int = 128
    stages: int = 8
    producer_regs: int = 40
    k_blocked: bool = False

    def __post_init__(self):
        if self.block_t not in (8, 16, 32, 64):
            raise ValueError(f"WsDecodeConfig.block_t must be 8, 16, 32 or 64, got {self.block_t}")
        if self.block_w not in (64, 128):
            raise ValueError(f"WsDecodeConfig.block_w must be 64 or 128, got {self.block_w}")
        if self.block_k not in (64, 128):
            raise ValueError(f"WsDecodeConfig.block_k must be 64 or 128, got {self.block_k}")
        if not 2 <= self.stages <= 12:
            raise ValueError(f"WsDecodeConfig.stages must be in [2, 12], got {self.stages}")
        if not 24 <= self.producer_regs <= 256 or self.producer_regs % 8:
            raise ValueError(f"WsDecodeConfig.producer_regs must be a multiple of 8 in [24, 256], got "
                             f"{self.producer_regs}")
        if self.shared_bytes > MAX_RING_BYTES:
            raise ValueError(f"WsDecodeConfig: {self.stages} stages of ({self.block_w} + {self.block_t}) x "
                             f"{self.block_k} bf16 take {self.shared_bytes} bytes of shared memory, over "
                             f"{MAX_RING_BYTES}")

    @property
    def block_m(self) -> int:
        """The tile table's rows per tile (`grouped_tiles.TileTable.block_m`): the token rows."""
        return self.block_t

    @property
    def split_tail(self) -> bool:
        """The tile tables' kind: no split tails."""
        return False

    @property
    def gathers(self) -> bool:
        """Whether GEMM0 may read its rows through gather rows: never (rows in expert order, as ws_gemm's `gathers`)."""
        return False

    @property
    def num_warps(self) -> int:
        """The consumer's warps: one per 16 weight rows."""
        return self.block_w // 16

    @property
    def shared_bytes(self) -> int:
        """The load ring's shared memory."""
        return 2 * self.stages * (self.block_w + self.block_t) * self.block_k

    @property
    def short(self) -> str:
        """The compact name `parse` reads back, e.g. "t16w64k128s8" ("p<n>": the producer's registers where not
        the default)."""
        name = f"t{self.block_t}w{self.block_w}k{self.block_k}s{self.stages}"
        name += f"p{self.producer_regs}" if self.producer_regs != WsDecodeConfig.producer_regs else ""
        return name + ("b" if self.k_blocked else "")

    @classmethod
    def parse(cls, text: str) -> "WsDecodeConfig":
        """The config of a compact name (`short`): "t16w64k128s8" (token rows, weight rows, K step, stages), then
        optionally "p40" (producer registers), "b" (K-blocked weights); ValueError naming the text otherwise."""
        match = re.fullmatch(r"t(\d+)w(\d+)k(\d+)s(\d+)(?:p(\d+))?(b)?", text.strip())
        if not match:
            raise ValueError(f"warp-specialised decode config {text!r}: expected e.g. t16w64k128s8[p40][b]")
        bt, bw, bk, stages, producer, blocked = match.groups()
        fields = dict(block_t=int(bt), block_w=int(bw), block_k=int(bk), stages=int(stages),
                      k_blocked=blocked is not None)
        if producer:
            fields["producer_regs"] = int(producer)
        return cls(**fields)

    def __str__(self) -> str:
        blocked = " kblocked" if self.k_blocked else ""
        return f"wsd {self.block_w}x{self.block_t}x{self.block_k} s{self.stages} p{self.producer_regs}{blocked}"


@gluon.constexpr_function
def _acc_layout(block_w, block_t, num_warps):
    """acc^T [BW, BT]: wgmma over the weight rows, one warp per 16 of them, one instruction N = BT wide."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_t, 16])


@gluon.constexpr_function
def _pairs_layout(block_w, block_t, num_warps):
    """acc^T with each (gate, up) row pair in one thread: 2 rows x 1 token per thread, rows fastest."""
    rows = min(32, block_w // 2)
    return gl.BlockedLayout(size_per_thread=[2, 1], threads_per_warp=[rows, 32 // rows],
                            warps_per_cta=[1, num_warps], order=[0, 1])


@gluon.constexpr_function
def _store_layout(rows, block_t, num_warps):
    """A [rows, BT] tile stored transposed (out[t, j]): 8 consecutive j (16 bytes) per thread."""
    threads_j = max(1, min(32, rows // 8))
    return gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[threads_j, 32 // threads_j],
                            warps_per_cta=[1, num_warps], order=[0, 1])


@gluon.jit
def _decode_consumer(a_bufs, w_bufs, ready, empty, out_ptr, scale_ptr, tiles_ptr, num_tiles_ptr, width, num_n, K,
                     n_out, GEMM: gl.constexpr, HAS_SCALE: gl.constexpr, NUM_SMS: gl.constexpr,
                     num_warps: gl.constexpr):
    """The MMA partition: acc^T = W @ A^T per stage, then the transposed epilogue (module docstring)."""
    BLOCK_T: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_W: gl.constexpr = w_bufs.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    OUT_W: gl.constexpr = BLOCK_W // 2 if GEMM == 0 else BLOCK_W
    acc_layout: gl.constexpr = _acc_layout(BLOCK_W, BLOCK_T, num_warps)
    out_layout: gl.constexpr = _store_layout(OUT_W, BLOCK_T, num_warps)
    pid = gl.program_id(0)
    num_work = gl.load(num_tiles_ptr) * num_n
    k_steps = gl.cdiv(K, BLOCK_K)
    for work in range(pid, num_work, NUM_SMS):
        expert, m_start, m_end, n = work_tile(tiles_ptr, width, work, gl.load(num_tiles_ptr), num_n, 1)
        step = (work - pid) // NUM_SMS * k_steps
        acc = gl.zeros((BLOCK_W, BLOCK_T), dtype=gl.float32, layout=acc_layout)
        for k in range(0, K, BLOCK_K):
            stage = step % STAGES
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            acc = warpgroup_mma(w_bufs.index(stage), a_bufs.index(stage).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k > 0)
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))   # K >= 8: the tile had a step
        if GEMM == 0:   # rows 2j, 2j + 1 = gate j, up j: into one thread, then h^T = silu(gate) * up
            pairs = gl.convert_layout(acc, _pairs_layout(BLOCK_W, BLOCK_T, num_warps))
            gate, up = pairs.reshape([BLOCK_W // 2, 2, BLOCK_T]).permute((0, 2, 1)).split()
            values = gate / (1.0 + gl.exp(-gate)) * up
        else:
            values = acc
        values = gl.convert_layout(values, out_layout)
        tokens = m_start + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, out_layout))
        if GEMM == 1 and HAS_SCALE:
            values = values * gl.load(scale_ptr + gl.minimum(tokens, m_end - 1))[None, :]
        cols = n * OUT_W + gl.arange(0, OUT_W, layout=gl.SliceLayout(1, out_layout))
        mask = (cols < n_out)[:, None] & (tokens < m_end)[None, :]
        gl.store(out_ptr + tokens.to(gl.int64)[None, :] * n_out + cols[:, None], values.to(gl.bfloat16), mask=mask)


@gluon.jit
def _ws_decode_kernel(a_desc, w_desc, out_ptr, scale_ptr, tiles_ptr, num_tiles_ptr, max_tiles, K, n_out, w_rows,
                      GEMM: gl.constexpr, HAS_SCALE: gl.constexpr, NUM_SMS: gl.constexpr, STAGES: gl.constexpr,
                      PRODUCER_REGS: gl.constexpr, W_BLOCKED: gl.constexpr, CHAIN: gl.constexpr,
                      num_warps: gl.constexpr, PRELOAD: gl.constexpr = False):
    """out[t, j] over every tile of the table: GEMM 0: a = the rows [P, H], w = the interleaved w13 as
    [E_local * 2I, H], out = h [P, I] (n_out = I, w_rows = 2I); GEMM 1: a = h, w = w2 as [E_local * H, I], out = y
    [P, H] (n_out = H, w_rows = H), times scale[t] with HAS_SCALE. CHAIN: GEMM0 lets the next kernel start early,
    GEMM1 is launched programmatically after it (kernels/ws_ring.py, "Chained launches"). PRELOAD (GEMM0): launched
    programmatically after the kernel that writes its rows (the pair dispatch), it loads its first weight blocks
    before it waits for that kernel, as a chained GEMM1 does (its tile table was written before that kernel's CTAs
    passed their own wait)."""
    if CHAIN and GEMM == 0:
        gdc_launch_dependents()   # the chained GEMM1 may start its CTAs (ws_ring, "Chained launches")
    a_bufs, w_bufs, ready, empty = allocate_ring(a_desc, w_desc, STAGES, 1)
    width = 2 * max_tiles
    num_n = gl.cdiv(w_rows, w_desc.block_type.shape[0])
    gl.warp_specialize([
        (_decode_consumer, (a_bufs, w_bufs, ready, empty, out_ptr, scale_ptr, tiles_ptr, num_tiles_ptr, width, num_n,
                            K, n_out, GEMM, HAS_SCALE, NUM_SMS, num_warps)),
        (producer, (a_desc, a_desc, w_desc, a_bufs, w_bufs, ready, empty, tiles_ptr, num_tiles_ptr, width, num_n,
                     K, w_rows, out_ptr, tiles_ptr, 1, NUM_SMS, False, W_BLOCKED, (CHAIN and GEMM == 1) or PRELOAD,
                     False)),
    ], [1], [PRODUCER_REGS])


def default_config(rows: int, num_local_experts: int) -> WsDecodeConfig:
    """The decode config for `rows` rows over `num_local_experts` experts (KernelConfig.ws_gemm under
    `ws_gemm.MIN_ROWS_PER_EXPERT` rows per expert): token tiles of 8 to 64 rows by the mean rows per expert (at most
    about 1.5 of it padding each expert's last tile), 64 weight rows, BLOCK_K 128, the deepest ring within the shared
    memory. On an H100 (bench/results/h100-a9c802a, Qwen3-30B-A3B, one rank's work of EP=2, cold L2), against the
    Triton kernels with the H100 table's configs, GEMM0 / GEMM1: at 1 token 0.958 / 1.029 (20.5 / 11.8 us), at 32
    tokens 0.895 / 0.981; in calls 0.98-0.99x at 1-8 tokens, a tie at 32-128."""
    mean = rows / max(num_local_experts, 1)
    block_t = next(t for t in (8, 16, 32, 64) if mean <= t * 0.75 or t == 64)
    stages = min(8, MAX_RING_BYTES // (2 * (64 + block_t) * 128))
    return WsDecodeConfig(block_t=block_t, block_w=64, block_k=128, stages=stages)


def default_configs() -> tuple[WsDecodeConfig, ...]:
    """Every config `default_config` may pick (what a layer compiles before its first call)."""
    return tuple(dict.fromkeys(default_config(t * 8, 8) for t in (1, 8, 16, 32, 64)))


def ws_decode_launch(gemm: int, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tiles: TileTable,
                     config: WsDecodeConfig, scale: torch.Tensor | None = None, num_sms: int | None = None,
                     chained: bool = False, preload: bool = False) -> tuple:
    """(kernel, grid, args, kwargs) of one launch, as `ws_gemm.ws_launch` (the same operands and tile table, whose
    block_m is the config's token rows; `chained` as there); `preload` (GEMM0): launched programmatically after the
    kernel that writes its rows, its first weight blocks loaded before it waits (`_ws_decode_kernel`'s PRELOAD)."""
    if preload and gemm != 0:
        raise ValueError("preload: GEMM0 only (a chained GEMM1 preloads already)")
    K, num_experts, w_rows, n_out = check_operands(gemm, a, w, out, tiles, config, scale)
    bt, bw, bk = config.block_t, config.block_w, config.block_k
    a_desc = TensorDescriptor.from_tensor(a, [bt, bk], gl.NVMMASharedLayout.get_default_for([bt, bk], gl.bfloat16))
    w_desc = weight_descriptor(w, config, bw)
    num_sms = num_sms or torch.cuda.get_device_properties(a.device).multi_processor_count
    args = (a_desc, w_desc, out, scale if scale is not None else out, tiles.table, tiles.num_tiles, tiles.max_tiles,
            K, n_out, w_rows)
    kwargs = dict(GEMM=gemm, HAS_SCALE=scale is not None, NUM_SMS=num_sms, STAGES=config.stages,
                  PRODUCER_REGS=config.producer_regs, W_BLOCKED=config.k_blocked, CHAIN=chained,
                  num_warps=config.num_warps, launch_pdl=(chained and gemm == 1) or preload)
    if preload:   # the default compiles keep their specialisation
        kwargs["PRELOAD"] = True
    return _ws_decode_kernel, (num_sms, ), args, kwargs


def ws_decode_gemm0(a: torch.Tensor, w13: torch.Tensor, h: torch.Tensor, tiles: TileTable,
                    config: WsDecodeConfig = WsDecodeConfig(), chained: bool = False,
                    preload: bool = False) -> torch.Tensor:
    """h = silu(a @ gate^T) * (a @ up^T) per expert (grouped_gemm.grouped_gemm0's result) at decode sizes; w13:
    `grouped_gemm.interleave_w13(w13)`; tiles: `build_tile_table(offsets, config.block_t, P)`; `chained`: a chained
    GEMM1 follows (`ws_gemm.ws_launch`); `preload`: launched programmatically after the kernel that writes `a`
    (`ws_decode_launch`)."""
    kernel, grid, args, kwargs = ws_decode_launch(0, a, w13, h, tiles, config, chained=chained, preload=preload)
    kernel[grid](*args, **kwargs)
    return h


def ws_decode_gemm1(h: torch.Tensor, w2: torch.Tensor, y: torch.Tensor, tiles: TileTable,
                    config: WsDecodeConfig = WsDecodeConfig(), scale: torch.Tensor | None = None,
                    chained: bool = False) -> torch.Tensor:
    """y = scale * (h @ w2[expert]^T) per expert (grouped_gemm.grouped_gemm1's result) at decode sizes; `chained`:
    launched programmatically after a chained GEMM0."""
    kernel, grid, args, kwargs = ws_decode_launch(1, h, w2, y, tiles, config, scale, chained=chained)
    kernel[grid](*args, **kwargs)
    return y
