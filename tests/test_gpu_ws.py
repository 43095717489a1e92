"""The warp-specialised Gluon GEMMs (kernels/ws_gemm.py, kernels/ws_decode.py) on one Hopper GPU: each default
config on a small problem (experts of 0 / 1 / few / many rows, rows past them) against the fp32 reference, outputs
poisoned, as scripts/ws_gemm_probe.py checks them before timing (its `smoke`, in child processes so that a hang
names its config)."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def _probe():
    path = Path(__file__).resolve().parent.parent / "scripts" / "ws_gemm_probe.py"
    spec = importlib.util.spec_from_file_location("ws_gemm_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


@pytest.mark.parametrize("decode", [False, True])
def test_default_configs_match_the_reference(decode):
    import torch

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("wgmma and TMA: Hopper or newer")
    probe = _probe()
    texts = (probe.DEFAULT_DECODE_CONFIGS if decode else probe.DEFAULT_CONFIGS).split(",")
    results = probe.smoke_all(texts, decode, timeout_s=180)
    assert all(verdict.startswith("PASS") for verdict in results.values()), results
