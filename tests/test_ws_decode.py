"""The warp-specialised decode GEMMs (kernels/ws_decode.py) on the CPU: configs, argument checks, and the kernels
compiled for sm_90 exactly as a launch specialises them (Gluon has no interpreter; scripts/ws_gemm_probe.py --decode
runs them on a GPU). The weights are the wgmma's M side: m64nBTk16 instructions, the token rows as N."""

import re

import pytest
import torch

from weave_moe.backends.weave.kernels import sm90
from weave_moe.backends.weave.kernels import ws_decode as wsd
from weave_moe.backends.weave.kernels.grouped_tiles import build_tile_table_torch
from ws_operands import operands

HOPPER_SHARED = 232448


def _operands(gemm, hidden, inter, block_t, rows=64, experts=2, scale=False):
    return operands(gemm, hidden, inter, rows, block_t, False, experts, scale)


def test_configs_refuse_what_cannot_run():
    config = wsd.WsDecodeConfig()
    assert (config.block_m, config.num_warps, config.split_tail) == (16, 4, False)
    assert wsd.WsDecodeConfig(block_w=128, stages=4).num_warps == 8
    for bad, message in ((dict(block_t=12), "block_t"), (dict(block_w=32), "block_w"), (dict(block_k=32), "block_k"),
                         (dict(stages=1), "stages"), (dict(producer_regs=20), "producer_regs"),
                         (dict(block_w=128), "shared memory")):
        with pytest.raises(ValueError, match=message):
            wsd.WsDecodeConfig(**bad)


def test_launch_arguments_are_checked():
    a, w, out, tiles, _ = _operands(0, 256, 128, 16)
    config = wsd.WsDecodeConfig()
    with pytest.raises(ValueError, match="block_m = 16"):
        wsd.ws_decode_launch(0, a, w, out, build_tile_table_torch(torch.tensor([0, 32, 64], dtype=torch.int32), 32,
                                                                  64, False), config, num_sms=4)
    with pytest.raises(ValueError, match="out: expected"):
        wsd.ws_decode_launch(0, a, w, out[:, :8], tiles, config, num_sms=4)
    with pytest.raises(ValueError, match="GEMM1 only"):
        wsd.ws_decode_launch(0, a, w, out, tiles, config, scale=torch.empty(64), num_sms=4)


CASES = [  # (gemm, config, H, I, scale): Qwen3-30B-A3B's and DeepSeek-V3's shapes
    (0, wsd.WsDecodeConfig(), 2048, 768, False),
    (1, wsd.WsDecodeConfig(), 2048, 768, True),
    (0, wsd.WsDecodeConfig(block_t=8), 7168, 2048, False),
    (1, wsd.WsDecodeConfig(block_t=32, block_k=64, stages=6), 7168, 2048, False),
    (0, wsd.WsDecodeConfig(block_t=64, block_w=128, stages=4), 2048, 768, False),
]


@pytest.mark.parametrize("gemm,config,hidden,inter,scale", CASES, ids=lambda v: str(v))
def test_kernels_compile_for_hopper_with_the_weights_as_the_mma_rows(gemm, config, hidden, inter, scale, tmp_path):
    a, w, out, tiles, scale_t = _operands(gemm, hidden, inter, config.block_t, scale=scale)
    kernel, grid, args, kwargs = wsd.ws_decode_launch(gemm, a, w, out, tiles, config, scale=scale_t, num_sms=132)
    compiled = sm90.compile_for_sm90(kernel, args, kwargs)
    ptx = compiled.asm["ptx"]
    boxes = max(1, 2 * config.block_k // 128)   # a block row over the 128-byte swizzle: several boxes
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx") == 2 * boxes
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)) == {f"m64n{config.block_t}k16"}
    assert ptx.count("wgmma.mma_async") == config.block_k // 16
    counts = {int(v) for v in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx)}
    assert config.producer_regs in counts
    assert not re.search(r"\bbar\.sync\s+\d+;", ptx), "a CTA-wide bar.sync"
    assert not re.search(r"\.local\b", ptx), "local memory"
    assert 0 < compiled.metadata.shared <= HOPPER_SHARED, compiled.metadata.shared
    report = sm90.ptxas_report(ptx, tmp_path)
    assert "0 bytes stack frame" in report and "0 bytes spill stores" in report, report
