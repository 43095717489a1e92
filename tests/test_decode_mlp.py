"""The fused decode MLP (kernels/decode_mlp.py) without a GPU: under TRITON_INTERPRET=1 against torch per expert, and
its sm_90 PTX compiled as a launch specialises it.

Tolerance: fp32 dot operands (the interpreter's bf16 dot is wrong); h is rounded to bf16 in the kernel as the grouped
GEMM0 stores it (by truncation in the interpreter, up to one ulp), and the reference rounds its h the same way
(round-to-nearest), so h may differ by an ulp: 2e-2, as tests/test_grouped_gemm.py.
"""

import textwrap

import pytest
import torch

from weave_moe.backends.weave.kernels import decode_mlp as dm
from weave_moe.backends.weave.kernels import grouped_gemm as gg
from weave_moe.backends.weave.kernels import sm90
from weave_moe.commands.tune import HOPPER_SMEM_BYTES
from interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    r"""
    import torch
    from weave_moe.backends.weave.kernels import decode_mlp as dm
    from weave_moe.backends.weave.kernels import grouped_gemm as gg

    # (rows per local expert, H, I, config): empty experts, one row, a tile and one more row, no rows at all, I not a
    # multiple of block_i (the last block reads the next expert's w13 rows: zeroed in h), H not a multiple of block_k
    # or block_n (K tail of GEMM0, column tail of GEMM1)
    C = dm.DecodeMlpConfig
    CASES = [([5, 0, 3], 48, 40, C(16, 16, 16, 32)), ([1], 32, 16, C(16, 16, 16, 16)),
             ([17, 2, 16], 40, 24, C(16, 16, 32, 16)), ([0, 0], 32, 16, C(16, 16, 16, 16)),
             ([2, 1, 1, 3], 56, 48, C(16, 32, 16, 32))]
    for case, (counts, H, I, cfg) in enumerate(CASES):
        torch.manual_seed(case)
        E = len(counts)
        offsets = torch.zeros(E + 1, dtype=torch.int32)
        offsets[1:] = torch.tensor(counts).cumsum(0)
        rows = int(offsets[-1])
        P = rows + 5   # buffers sized by a bound: rows past the last expert must stay untouched
        a = torch.randn(P, H).bfloat16()
        w13 = (torch.randn(E, 2 * I, H) / H ** 0.5).bfloat16()
        w2 = (torch.randn(E, H, I) / I ** 0.5).bfloat16()
        tiles = gg.build_tile_table(offsets, cfg.block_m, P)
        parts = torch.full(dm.parts_shape(P, H, I, cfg.block_i), float("nan"))
        dm.decode_mlp(a, gg.interleave_w13(w13), w2, tiles, parts, cfg, dot_fp32=True)
        assert parts[:, rows:].isnan().all(), "rows past the last expert were written"
        assert not parts[:, :rows].isnan().any(), "unwritten rows"
        y = torch.full((P, H), float("nan")).bfloat16()
        dm.reduce_parts(parts, y, offsets[-1:].clone(), block_h=16)
        assert y[rows:].isnan().all(), "reduce_parts wrote rows past the count"
        # the sum over I blocks in block order in fp32, rounded once (the interpreter converts to bf16 by
        # truncation; the GPU rounds to nearest): bitwise
        acc = torch.zeros(rows, H)
        for block in parts[:, :rows]:
            acc += block
        truncated = (acc.view(torch.int32) & -65536).view(torch.float32).bfloat16()
        assert torch.equal(y[:rows].view(torch.int16), truncated.view(torch.int16))
        for e in range(E):
            s, f = int(offsets[e]), int(offsets[e + 1])
            if s == f:
                continue
            gate_up = a[s:f].float() @ w13[e].float().T
            h_ref = (torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]).bfloat16().float()
            y_ref = h_ref @ w2[e].float().T
            err = ((y[s:f].float() - y_ref).norm() / y_ref.norm()).item()
            assert err < 2e-2, (counts, H, I, cfg, e, err)
    print("DECODE MLP INTERPRETER OK")
    """
)


def test_decode_mlp_under_interpreter():
    run_interpreted(SCRIPT, "DECODE MLP INTERPRETER OK", timeout=900)


def test_decode_mlp_rejects_what_it_cannot_run():
    """Wrong dtypes, shapes and tile tables are named, before anything launches."""
    E, H, I = 2, 64, 32
    a, w13, w2 = torch.zeros(8, H).bfloat16(), torch.zeros(E, 2 * I, H).bfloat16(), torch.zeros(E, H, I).bfloat16()
    offsets = torch.tensor([0, 4, 8], dtype=torch.int32)
    cfg = dm.DecodeMlpConfig(16, 16, 16, 16)
    parts = torch.zeros(dm.parts_shape(8, H, I, 16))
    tiles = gg.build_tile_table_torch(offsets, 16, 8)
    with pytest.raises(ValueError, match="parts"):
        dm._decode_mlp_launch(a, w13, w2, tiles, parts[:1], cfg)
    with pytest.raises(ValueError, match="w2"):
        dm._decode_mlp_launch(a, w13, w2.float(), tiles, parts, cfg)
    with pytest.raises(ValueError, match="tiles"):
        dm._decode_mlp_launch(a, w13, w2, gg.build_tile_table_torch(offsets, 32, 8), parts, cfg)
    with pytest.raises(ValueError, match="block_i"):
        dm.DecodeMlpConfig(block_i=48)


def test_default_config_fills_the_sms_at_one_token():
    """BLOCK_I whose items at 1 token (experts x I blocks) fill the SMs in the fewest, fullest waves, the larger on a
    tie; BLOCK_K 64 only with BLOCK_I 128 (shared memory)."""
    for (hidden, inter, k), block_i in [((2048, 768, 8), 64), ((2048, 512, 8), 32), ((2048, 1408, 6), 64),
                                        ((7168, 2048, 8), 128)]:
        config = dm.default_config(hidden, inter, k, 132)
        assert config.block_i == block_i and config.block_k == (64 if block_i == 128 else 128), (inter, config)


@pytest.mark.parametrize("hidden, inter, config", [
    (2048, 768, dm.default_config(2048, 768, 8, 132)),                  # Qwen3-30B-A3B (the layer's default)
    (7168, 2048, dm.default_config(7168, 2048, 8, 132)),                # DeepSeek-V3
    (2048, 512, dm.default_config(2048, 512, 8, 132)),                  # Qwen3.5-35B-A3B
    (2048, 512, dm.DecodeMlpConfig(block_i=32, block_n=256)),           # a probe candidate
])
def test_decode_mlp_compiles_for_sm90_without_local_memory(hidden, inter, config):
    """As a launch specialises it (the H100 / H200 SM count): TMA loads of a and both weights, tensor-core MMAs, no
    local memory (no spills)."""
    E, rows = 4, 32
    a = torch.zeros(rows, hidden).bfloat16()
    w13, w2 = torch.zeros(E, 2 * inter, hidden).bfloat16(), torch.zeros(E, hidden, inter).bfloat16()
    offsets = torch.tensor([0, 8, 16, 24, 32], dtype=torch.int32)
    tiles = gg.build_tile_table_torch(offsets, config.block_m, rows)
    parts = torch.zeros(dm.parts_shape(rows, hidden, inter, config.block_i))
    kernel, grid, args, kwargs = dm._decode_mlp_launch(a, w13, w2, tiles, parts, config, num_sms=132)
    compiled = sm90.compile_for_sm90(kernel, args, kwargs)
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx, "a, w13 and w2 must come through TMA"
    assert "mma" in ptx and ".local" not in ptx
    assert compiled.metadata.shared <= HOPPER_SMEM_BYTES, compiled.metadata.shared
