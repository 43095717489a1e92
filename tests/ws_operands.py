"""CPU operands of one warp-specialised GEMM launch (kernels/ws_gemm.py, kernels/ws_decode.py), for the compile
tests of tests/test_ws_gemm.py and tests/test_ws_decode.py: empty bf16 tensors of a layer shape and a tile table of
two experts with half the rows each."""

from __future__ import annotations

import torch

from weave_moe.backends.weave.kernels.grouped_tiles import build_tile_table_torch


def operands(gemm: int, hidden: int, inter: int, rows: int, block_m: int, split_tail: bool = False,
             experts: int = 2, scale: bool = False):
    """(a, w, out, tiles, scale) of `gemm` 0 (a [rows, H], w13 [E, 2I, H], h [rows, I]) or 1 (h, w2 [E, H, I], y
    [rows, H], fp32 scale [rows] with `scale`), tiles of `block_m` rows (the decode kernels' token rows)."""
    offsets = torch.tensor([0, rows // 2, rows], dtype=torch.int32)
    tiles = build_tile_table_torch(offsets, block_m, rows, split_tail)
    bf16 = dict(dtype=torch.bfloat16)
    if gemm == 0:
        return (torch.empty(rows, hidden, **bf16), torch.empty(experts, 2 * inter, hidden, **bf16),
                torch.empty(rows, inter, **bf16), tiles, None)
    return (torch.empty(rows, inter, **bf16), torch.empty(experts, hidden, inter, **bf16),
            torch.empty(rows, hidden, **bf16), tiles, torch.empty(rows) if scale else None)
