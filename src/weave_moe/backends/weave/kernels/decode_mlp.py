"""The expert MLP of a decode call in ONE launch: GEMM0 + SiLU-mul + GEMM1, split over the intermediate size.

Why. At decode sizes each hit expert has a few rows, and the grouped GEMMs (kernels/grouped_gemm.py) are two
launches that each stream one half of the weights: GEMM0 w13, then GEMM1 w2 once GEMM0's last tile has stored h.
Between them sit a launch gap and the second launch's ramp; GEMM1 has few long tiles (Qwen3-30B-A3B at 1 token per
rank: 8 experts x H / BLOCK_N tiles of K = I), and h makes a round trip through memory. Measured on an H100 at 1 token
(bench/results/h100-dfac10b, docs/perf-notes.md entry 42): GEMM0 21.4 us + GEMM1 14.0 us, where reading the 8
experts' weights once at the HBM rate takes ~22.5 us.

What. Work item (M tile, I block b) of BLOCK_I intermediate columns, dealt round-robin over a persistent grid:
  h_b   = bf16(silu(a @ gate_b^T) * (a @ up_b^T))        [BLOCK_M, BLOCK_I]  (GEMM0 over K = H, one wide MMA per
                                                                              k-step on the interleaved w13)
  parts[b, rows, :] = h_b @ w2[:, b]^T in fp32              [BLOCK_M, H]       (GEMM1's share of block b, BLOCK_N
                                                                              columns at a time)
so every item streams its own slice of w13 and w2 once, and the items spread over every SM (Qwen3-30B-A3B at 1
token: 8 tiles x 12 blocks of 64 = 96 items, not 48 + 256 tiles in two waves). The caller sums the parts over b in
fp32 in block order and rounds once (`reduce_parts`; a combine may fold that sum into its own loads): the same value
as the grouped GEMM1's fp32 accumulation over K = I up to the order of the fp32 additions, and h rounded to bf16 as
the grouped GEMM0 stores it. Not bitwise equal to the grouped GEMMs: compared with the reference's tolerance.

Layout: as the grouped GEMMs'. `a` [P, H] bf16 rows in expert order, the tile table's tiles (expert, first row,
expert's end) with BLOCK_M rows (section 0 only); w13 interleaved (`grouped_gemm.interleave_w13`: gate row j at
2j, up row j at 2j + 1) as [E_local * 2I, H]; w2 [E_local, H, I]; parts fp32 [ceil(I / BLOCK_I), P, H]. Rows of a
tile past the expert's end read the next rows of `a` (zeros past P) and are never stored; columns of the last I
block past I read the next expert's w13 rows and are zeroed in h before GEMM1 (w2's columns past I read as zeros
through the descriptor's bounds).

Everything also runs under TRITON_INTERPRET=1 with DOT_FP32 (the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from weave_moe.backends.weave.kernels import sync
from weave_moe.backends.weave.kernels.grouped_gemm import _check, _desc_k_loop, _num_sms, _tile_rows
from weave_moe.backends.weave.kernels.grouped_tiles import TileTable

__all__ = ["decode_mlp", "reduce_parts", "parts_shape", "default_config", "DecodeMlpConfig"]


@dataclasses.dataclass(frozen=True)
class DecodeMlpConfig:
    """Tile sizes and launch options of `decode_mlp` (block_i: intermediate columns per item; block_n: GEMM1's
    output columns per MMA; block_k: GEMM0's K step)."""

    block_m: int = 16
    block_i: int = 64
    block_k: int = 128
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_m", "block_i", "block_k", "block_n"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 16 and value & (value - 1) == 0):
                raise ValueError(f"{name}={value!r} is not a power of two >= 16")
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps={self.num_warps!r} is not 4 or 8")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"num_stages={self.num_stages!r} is not an int >= 1")

    def __repr__(self) -> str:
        return (f"DecodeMlpConfig({self.block_m}x{self.block_i}x{self.block_k}, block_n={self.block_n}, "
                f"w{self.num_warps} s{self.num_stages})")


def parts_shape(rows: int, hidden: int, inter: int, block_i: int) -> tuple[int, int, int]:
    """The parts buffer of `decode_mlp` for `rows` rows: (I blocks, rows, H)."""
    return (triton.cdiv(inter, block_i), rows, hidden)


def default_config(hidden: int, inter: int, rows_per_token: int, num_sms: int) -> DecodeMlpConfig:
    """The config a layer uses before any is measured (an assumption until scripts/decode_mlp_probe.py measures it):
    BLOCK_I from 32 / 64 / 128 whose items at 1 token (`rows_per_token` experts x ceil(I / BLOCK_I) blocks) fill the
    `num_sms` SMs in the fewest, fullest waves, the larger on a tie (132 SMs: Qwen3-30B-A3B 64 -> 96 items, Qwen3.5-
    35B-A3B 32 -> 128, DeepSeek-V2-Lite 64 -> 132, DeepSeek-V3 128 -> 128); BLOCK_K 64 with BLOCK_I 128, so that 4
    stages of w13 stay within shared memory, else 128."""
    def fill(block_i):
        items = rows_per_token * triton.cdiv(inter, block_i)
        return items / (triton.cdiv(items, num_sms) * num_sms), block_i

    block_i = max(fill(b) for b in (32, 64, 128))[1]
    return DecodeMlpConfig(block_i=block_i, block_k=64 if block_i == 128 else 128)


@triton.jit
def _decode_mlp_item(a_desc, w13_desc, w2_desc, parts_ptr, tiles_ptr, width, num_blocks, work, P, H, I,
                     BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT_FP32: tl.constexpr):
    tile = work // num_blocks
    block = work % num_blocks
    expert, m_start, m_end = _tile_rows(tiles_ptr, width, 0, tile)
    i_start = block * BLOCK_I
    # GEMM0 + SiLU-mul: one wide MMA per k-step over BLOCK_I interleaved gate-up pairs
    acc = _desc_k_loop(a_desc, parts_ptr, m_start, w13_desc, m_start, expert * 2 * I + 2 * i_start, H, 0, H,
                       BLOCK_M, 2 * BLOCK_I, BLOCK_K, False, DOT_FP32, False)
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_I, 2)))
    h = gate * tl.sigmoid(gate) * up
    cols_i = i_start + tl.arange(0, BLOCK_I)
    h = tl.where((cols_i < I)[None, :], h, 0.0).to(tl.bfloat16)   # as the grouped GEMM0 stores it; past I: zero
    if DOT_FP32:
        h = h.to(tl.float32)
    # GEMM1's share of this I block, BLOCK_N output columns at a time
    offs_m = m_start + tl.arange(0, BLOCK_M)
    rows_ok = (offs_m < m_end)[:, None]
    base = parts_ptr + block.to(tl.int64) * P * H + offs_m.to(tl.int64)[:, None] * H
    for n in range(0, H, BLOCK_N):
        w = w2_desc.load([expert * H + n, i_start])
        if DOT_FP32:
            w = w.to(tl.float32)
        part = tl.dot(h, w.T)
        offs_n = n + tl.arange(0, BLOCK_N)
        tl.store(base + offs_n[None, :], part, mask=rows_ok & (offs_n < H)[None, :])


@triton.jit(do_not_specialize=["max_tiles", "P"])
def _decode_mlp_kernel(a_desc, w13_desc, w2_desc, parts_ptr, tiles_ptr, num_tiles_ptr, max_tiles, P, H, I,
                       BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       NUM_SMS: tl.constexpr, DOT_FP32: tl.constexpr):
    """parts[b, m] = h_b[m] @ w2[expert(m), :, b]^T for every (M tile, I block b) of the table (module docstring)."""
    sync.pdl_wait()
    pid = tl.program_id(0)
    num_blocks = tl.cdiv(I, BLOCK_I)
    num_work = tl.load(num_tiles_ptr) * num_blocks
    for work in range(pid, num_work, NUM_SMS):
        _decode_mlp_item(a_desc, w13_desc, w2_desc, parts_ptr, tiles_ptr, 2 * max_tiles, num_blocks, work, P, H, I,
                         BLOCK_M, BLOCK_I, BLOCK_K, BLOCK_N, DOT_FP32)
    sync.pdl_release()


@triton.jit(do_not_specialize=["P"])
def _reduce_parts_kernel(parts_ptr, y_ptr, rows_ptr, P, H, NUM_BLOCKS: tl.constexpr, BLOCK_H: tl.constexpr):
    """y[r, cols] = bf16(sum over b in block order of parts[b, r, cols]) for the rows r < rows_ptr[0]."""
    sync.pdl_wait()
    pid = tl.program_id(0)
    rows = tl.load(rows_ptr)
    blocks_h = tl.cdiv(H, BLOCK_H)
    offs = tl.arange(0, BLOCK_H)
    for item in range(pid, rows * blocks_h, tl.num_programs(0)):
        row = item // blocks_h
        cols = (item % blocks_h) * BLOCK_H + offs
        mask = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for b in tl.static_range(NUM_BLOCKS):
            acc += tl.load(parts_ptr + (b * P + row).to(tl.int64) * H + cols, mask=mask, other=0.0)
        tl.store(y_ptr + row.to(tl.int64) * H + cols, acc.to(tl.bfloat16), mask=mask)
    sync.pdl_release()


def _decode_mlp_launch(a, w13, w2, tiles: TileTable, parts, config: DecodeMlpConfig, dot_fp32: bool = False,
                       num_sms: int | None = None, pdl: bool = False):
    """(kernel, grid, args, kwargs) of one `decode_mlp` launch, checked (`num_sms`: the grid, else the device's SMs;
    a compile-only test passes the GPU's)."""
    rows, hidden = a.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    _check("a", a, (rows, hidden), torch.bfloat16)
    _check("w13", w13, (num_experts, two_i, hidden), torch.bfloat16)
    _check("w2", w2, (num_experts, hidden, inter), torch.bfloat16)
    _check("parts", parts, parts_shape(rows, hidden, inter, config.block_i), torch.float32)
    if tiles.block_m != config.block_m or tiles.split_tail:
        raise ValueError(f"tiles: expected block_m={config.block_m} without a split tail, given block_m="
                         f"{tiles.block_m}, split_tail={tiles.split_tail}")
    bm, bi, bk, bn = config.block_m, config.block_i, config.block_k, config.block_n
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    w13_desc = TensorDescriptor.from_tensor(w13.view(num_experts * two_i, hidden), [2 * bi, bk])
    w2_desc = TensorDescriptor.from_tensor(w2.view(num_experts * hidden, inter), [bn, bi])
    num_sms = num_sms or _num_sms(a.device)
    args = (a_desc, w13_desc, w2_desc, parts, tiles.table, tiles.num_tiles, tiles.max_tiles, rows, hidden, inter)
    kwargs = dict(BLOCK_M=bm, BLOCK_I=bi, BLOCK_K=bk, BLOCK_N=bn, NUM_SMS=num_sms, DOT_FP32=dot_fp32,
                  num_warps=config.num_warps, num_stages=config.num_stages, **sync.launch_options(pdl))
    return _decode_mlp_kernel, (num_sms,), args, kwargs


def decode_mlp(a: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, tiles: TileTable, parts: torch.Tensor,
               config: DecodeMlpConfig | None = None, *, dot_fp32: bool = False, num_sms: int | None = None,
               pdl: bool = False) -> torch.Tensor:
    """Enqueue the fused decode MLP (module docstring) and return `parts`.

    Args:
        a: [P, H] bf16 rows in expert order (the tile table's rows).
        w13: [E_local, 2I, H] bf16, interleaved (`grouped_gemm.interleave_w13`).
        w2: [E_local, H, I] bf16.
        tiles: the rows' tile table with `config.block_m` rows per tile, no split tail.
        parts: fp32 `parts_shape(P, H, I, config.block_i)`; rows past the table's are not written.
        dot_fp32: the MMAs in fp32 (the interpreter's).
        num_sms: the grid (CTAs); default the device's SM count.
    """
    kernel, grid, args, kwargs = _decode_mlp_launch(a, w13, w2, tiles, parts, config or DecodeMlpConfig(),
                                                    dot_fp32, num_sms, pdl)
    kernel[grid](*args, **kwargs)
    return parts


def reduce_parts(parts: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, *, block_h: int = 512,
                 num_programs: int | None = None, pdl: bool = False) -> torch.Tensor:
    """y[r] = bf16(sum_b parts[b, r]) for r < rows[0] (int32 [1] on the device, e.g. the expert offsets' last entry):
    the grouped GEMM1's output from `decode_mlp`'s parts. Returns y."""
    num_blocks, capacity, hidden = parts.shape
    _check("y", y, (capacity, hidden), torch.bfloat16)
    if rows.dtype != torch.int32 or rows.numel() < 1:
        raise ValueError(f"rows: expected int32 [>= 1], given {rows.dtype} {tuple(rows.shape)}")
    grid = num_programs or max(1, min(capacity * triton.cdiv(hidden, block_h), 4 * _num_sms(parts.device)))
    _reduce_parts_kernel[(grid,)](parts, y, rows, capacity, hidden, NUM_BLOCKS=num_blocks, BLOCK_H=block_h,
                                  num_warps=2, **sync.launch_options(pdl))
    return y
