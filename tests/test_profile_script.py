"""scripts/profile_layer.py's `kernel_timeline` on stand-in profiler events (no GPU here): GPU events only, in start
order, relative to the first; the call's span; when the first grouped GEMM's work can start (its start, or the
last end of the kernels before it: with PDL its CTAs start early and wait)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

from torch.autograd import DeviceType

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_layer.py"


def _script():
    spec = importlib.util.spec_from_file_location("profile_layer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(name, start, end, device=DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_kernel_timeline_orders_gpu_work_and_finds_the_first_gemm():
    events = [_event("_gemm0_kernel", 140.0, 160.0), _event("_pack_slot_kernel", 100.0, 104.0),
              _event("cudaGraphLaunch", 90.0, 95.0, DeviceType.CPU), _event("moe_megakernel", 120.0, 131.0),
              _event("_gemm1_kernel", 158.0, 170.5)]   # overlapping spans (PDL) are kept as measured
    timeline = _script().kernel_timeline(events)
    assert [name for name, _, _ in timeline["kernels"]] == ["_pack_slot_kernel", "moe_megakernel", "_gemm0_kernel",
                                                            "_gemm1_kernel"]
    assert timeline["kernels"][1] == ("moe_megakernel", 20.0, 11.0)
    assert timeline["span_us"] == 70.5 and timeline["before_gemm_us"] == 40.0
    assert _script().kernel_timeline([_event("moe_megakernel", 5.0, 9.0)])["before_gemm_us"] is None
    # a GEMM launched early (PDL) behind a gather that ends later, and a side-stream kernel ending before it
    early = [_event("_pack_slot_kernel", 0.0, 3.0), _event("_prologue_kernel", 4.0, 8.0),
             _event("_gather_rows_kernel", 5.0, 30.0), _event("_gemm0_kernel", 12.0, 80.0)]
    assert _script().kernel_timeline(early)["before_gemm_us"] == 30.0
    assert _script().kernel_timeline([])["span_us"] == 0.0
