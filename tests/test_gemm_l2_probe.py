"""scripts/gemm_l2_probe.py's constructions, checked under the Triton interpreter on small shapes: the one-weight tile
table (every tile on expert 0's weights) and the equal splits compute what the probe's reference says they do, so
its checks on the GPU test the kernels, not the probe."""

import textwrap
from pathlib import Path

from interpreter import run_interpreted

SCRIPTS = str(Path(__file__).resolve().parent.parent / "scripts")

SCRIPT = textwrap.dedent(
    r"""
    import sys
    import torch
    sys.path.insert(0, sys.argv[1])   # scripts/
    import gemm_l2_probe as probe
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels import grouped_gemm as gg

    torch.manual_seed(0)
    counts, H, I = [5, 0, 21, 17], 48, 40
    E = len(counts)
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    rows = int(offsets[-1])
    cfg = gc.GemmConfig(block_m=16, block_n=32, block_k=16, group_m=2, epilogue=gc.EPILOGUE_MASKED)
    w13 = gg.interleave_w13((torch.randn(E, 2 * I, H) / H ** 0.5).bfloat16())
    w2 = (torch.randn(E, H, I) / I ** 0.5).bfloat16()
    for gemm, a, weights, out_cols in ((0, torch.randn(rows, H).bfloat16(), w13, I),
                                       (1, torch.randn(rows, I).bfloat16(), w2, H)):
        tiles = gg.build_tile_table(offsets, cfg.block_m, rows)
        for name, table, offs, expert_of in (
                ("layer", tiles, offsets, lambda e: e),
                ("one-weight", probe.one_weight(tiles), offsets, lambda e: 0),
                ("experts=3", gg.build_tile_table(probe.equal_offsets(rows, 3, "cpu"), cfg.block_m, rows),
                 probe.equal_offsets(rows, 3, "cpu"), lambda e: e)):
            assert torch.equal(table.table[1:], tiles.table[1:]) or name == "experts=3"
            out = torch.full((rows, out_cols), float("nan")).bfloat16()
            run = gg.grouped_gemm0 if gemm == 0 else gg.grouped_gemm1
            run(a, weights, out, table, cfg, dot_fp32=True, pdl=False)
            offs_host = offs.tolist()
            checked, ref = probe.reference(gemm, a, weights, offs_host, list(range(len(offs_host) - 1)), expert_of)
            assert checked.numel() == rows, (name, checked.numel())
            got = out[checked].float()
            assert not torch.isnan(got).any(), name
            error = ((got - ref).norm() / ref.norm()).item()
            assert error <= 2e-2, (gemm, name, error)   # the interpreter truncates to bf16 (tests/test_grouped_gemm.py)
            if name == "one-weight":   # and it is not the layer's answer: the rows of experts 2 and 3 differ
                layer = probe.reference(gemm, a, weights, offs_host, [2], lambda e: e)[1]
                assert ((got[5:26] - layer).norm() / layer.norm()).item() > 0.5
    assert probe.equal_offsets(10, 4, "cpu").tolist() == [0, 3, 6, 8, 10]
    print("GEMM L2 PROBE OK")
    """)


def test_probe_constructions_under_interpreter():
    run_interpreted(SCRIPT, "GEMM L2 PROBE OK", SCRIPTS, timeout=600)
