"""The grouped GEMMs of kernels/grouped_gemm.py without a GPU: under TRITON_INTERPRET=1 against torch, and their sm_90
PTX compiled exactly as a launch specialises them.

Tolerance: fp32 dot operands (the interpreter's bf16 dot is wrong); h and y are rounded to bf16 by truncation in the
interpreter (not round-to-nearest as on the GPU), up to one ulp each: 2e-2 here, the GPU benchmark holds 1e-2.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from weave_moe.backends.weave.kernels import grouped_gemm as gg

SCRIPT = textwrap.dedent(
    r"""
    import torch
    from weave_moe.backends.weave.kernels import grouped_gemm as gg

    C = gg.GemmConfig
    small = dict(block_m=16, block_n=32, block_k=16, group_m=2)
    CONFIGS = [C(**small, epilogue=gg.EPILOGUE_MASKED), C(**small, epilogue=gg.EPILOGUE_TMA),
               C(**small, epilogue=gg.EPILOGUE_TMA_CLIPPED), C(**small, interleaved=False, flatten=False),
               C(**dict(small, block_m=32), epilogue=gg.EPILOGUE_TMA),
               C(**dict(small, block_m=32), epilogue=gg.EPILOGUE_MASKED, split_tail=True),
               C(**dict(small, block_m=32), epilogue=gg.EPILOGUE_TMA_CLIPPED, split_tail=True, interleaved=False)]
    # (rows per local expert, H, I): empty experts, a single row, a tail of one row past a full tile, no rows at all,
    # I not a multiple of BN/2 (a tile reads into the next expert's weights), H not a multiple of BK (K tail)
    CASES = [([5, 0, 21], 48, 40), ([1], 40, 16), ([17, 33, 16], 32, 24), ([0, 0], 32, 16), ([40, 3], 24, 56),
             ([64, 65, 80, 96, 97], 32, 16)]

    def check(counts, H, I, cfg, seed):
        torch.manual_seed(seed)
        E = len(counts)
        offsets = torch.zeros(E + 1, dtype=torch.int32)
        offsets[1:] = torch.tensor(counts).cumsum(0)
        rows = int(offsets[-1])
        P = rows + 7  # the buffers are sized by a bound; rows past the last expert must stay untouched
        a = torch.randn(P, H).bfloat16()
        w13 = (torch.randn(E, 2 * I, H) / H ** 0.5).bfloat16()
        w2 = (torch.randn(E, H, I) / I ** 0.5).bfloat16()
        scale = torch.rand(P) + 0.5
        tiles = gg.build_tile_table(offsets, cfg.block_m, P, cfg.split_tail)
        ref_tiles = gg.build_tile_table_torch(offsets, cfg.block_m, P, cfg.split_tail)
        assert torch.equal(tiles.num_tiles, ref_tiles.num_tiles), (tiles.num_tiles, ref_tiles.num_tiles)
        for section, n in enumerate(ref_tiles.num_tiles.tolist()):
            cols = slice(section * tiles.max_tiles, section * tiles.max_tiles + n)
            assert torch.equal(tiles.table[:, cols], ref_tiles.table[:, cols]), (section, tiles.table, ref_tiles.table)
        if cfg.split_tail:  # every row in exactly one tile, tails of at most BM/2 rows in section 1
            covered = torch.zeros(P, dtype=torch.int32)
            for section, n in enumerate(ref_tiles.num_tiles.tolist()):
                for j in range(n):
                    _, m_start, m_end = ref_tiles.table[:, section * tiles.max_tiles + j].tolist()
                    height = cfg.block_m >> section
                    covered[m_start:min(m_start + height, m_end)] += 1
            assert torch.equal(covered[:rows], torch.ones(rows, dtype=torch.int32)) and not covered[rows:].any()
        h = torch.full((P, I), float("nan")).bfloat16()
        y = torch.full((P, H), float("nan")).bfloat16()
        w = gg.interleave_w13(w13) if cfg.interleaved else w13
        gg.grouped_gemm0(a, w, h, tiles, cfg, dot_fp32=True)
        gg.grouped_gemm1(h, w2, y, tiles, cfg, scale=scale, dot_fp32=True)
        assert h[rows:].isnan().all() and y[rows:].isnan().all(), "rows past the last expert were written"
        assert not h[:rows].isnan().any() and not y[:rows].isnan().any(), "unwritten rows"
        for e in range(E):
            s, f = int(offsets[e]), int(offsets[e + 1])
            if s == f:
                continue
            gate_up = a[s:f].float() @ w13[e].float().T
            h_ref = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]
            y_ref = (h[s:f].float() @ w2[e].float().T) * scale[s:f, None]
            for out, ref in ((h[s:f], h_ref), (y[s:f], y_ref)):
                err = ((out.float() - ref).norm() / ref.norm()).item()
                assert err < 2e-2, (counts, H, I, cfg, e, err)

    for i, (counts, H, I) in enumerate(CASES):
        for j, cfg in enumerate(CONFIGS):
            check(counts, H, I, cfg, seed=10 * i + j)
    print("GROUPED GEMM INTERPRETER OK")
    """
)


def test_grouped_gemms_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "GROUPED GEMM INTERPRETER OK" in result.stdout


def test_interleave_w13_pairs_gate_and_up_rows():
    import torch

    w13 = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)
    out = gg.interleave_w13(w13)
    assert torch.equal(out[:, 0::2], w13[:, :3]) and torch.equal(out[:, 1::2], w13[:, 3:])


def test_default_config_picks_64_row_tiles_only_where_they_pad_much_less():
    assert gg.default_config(0, 154 * 80, 80).block_m == 64  # 2 tiles of 128 for 154 rows: 66% padding
    assert gg.default_config(1, 174 * 80, 80).block_m == 64
    for mean in (109, 128, 255, 381, 513, 2034):
        assert gg.default_config(0, mean * 64, 64).block_m == 128, mean
    with pytest.raises(ValueError, match="gemm"):
        gg.default_config(2, 100, 4)


def test_bad_arguments_name_what_was_expected():
    import torch

    offsets = torch.tensor([0, 4], dtype=torch.int32)
    cfg = gg.GemmConfig(block_m=16, block_n=32, block_k=16)
    tiles = gg.build_tile_table_torch(offsets, 16, 4)
    a = torch.zeros(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="split_tail"):
        gg.grouped_gemm0(a, torch.zeros(1, 32, 32, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16),
                         tiles, cfg.with_(split_tail=True))
    with pytest.raises(ValueError, match="h: expected contiguous"):
        gg.grouped_gemm0(a, torch.zeros(1, 32, 32, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16),
                         tiles, cfg)
    with pytest.raises(ValueError, match="tiles.block_m"):
        gg.grouped_gemm0(a, torch.zeros(1, 32, 32, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16),
                         tiles, cfg.with_(block_m=32))
    with pytest.raises(ValueError, match="expert_offsets"):
        gg.build_tile_table(offsets.long(), 16, 4)


def _ptxas_report(ptx: str, tmp_path) -> str:
    from triton import knobs

    path = tmp_path / "kernel.ptx"
    path.write_text(ptx)
    result = subprocess.run([knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", str(path), "-o", str(tmp_path / "k.o")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stderr


# The shipped defaults (both tile heights) at a DeepSeek-V3-like shape, with the runtime's own specialisation:
# argument alignment and divisibility come from real tensors, as a launch computes them.
@pytest.mark.parametrize("gemm,mean_rows", [(0, 512), (0, 154), (1, 512), (1, 154)])
def test_ptx_is_hopper_tma_wgmma_without_local_memory(gemm, mean_rows, tmp_path):
    import torch

    experts, hidden, inter = 4, 7168, 2048
    rows = mean_rows * experts
    cfg = gg.default_config(gemm, rows, experts)
    offsets = torch.arange(0, rows + 1, mean_rows, dtype=torch.int32)
    tiles = gg.build_tile_table_torch(offsets, cfg.block_m, rows)
    h = torch.empty(rows, inter, dtype=torch.bfloat16)
    if gemm == 0:
        a = torch.empty(rows, hidden, dtype=torch.bfloat16)
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16)
        launch = gg._gemm0_launch(a, w13, h, tiles, cfg)
    else:
        w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16)
        y = torch.empty(rows, hidden, dtype=torch.bfloat16)
        launch = gg._gemm1_launch(h, w2, y, tiles, cfg, scale=torch.empty(rows))
    kernel, _, args, kwargs = launch
    compiled = gg.compile_for_sm90(kernel, args, kwargs)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx, "not on Hopper's tensor cores"
    assert "cp.async.bulk.tensor" in ptx, "operands not loaded by the bulk tensor copy engine"
    assert not re.search(r"\.local\b", ptx), "local memory in the GEMM kernel"
    # one wide MMA per k16 step: BLOCK_K / 16 wgmma per K step (no separate gate and up MMAs)
    assert ptx.count("wgmma.mma_async") == cfg.block_k // 16, ptx.count("wgmma.mma_async")
    report = _ptxas_report(ptx, tmp_path)
    assert "0 bytes stack frame" in report and "0 bytes spill stores" in report, report


def test_default_config_only_picks_from_default_configs():
    """The weave backend compiles `default_configs` before its first-call barrier: nothing else may be picked."""
    for gemm in (0, 1):
        allowed = gg.default_configs(gemm)
        for experts in (1, 8, 80, 128):
            for rows in (0, 1, 63, 64, 154 * experts, 174 * experts, 4096 * experts):
                assert gg.default_config(gemm, rows, experts) in allowed
