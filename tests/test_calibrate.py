"""weave_moe.plan.calibrate and `weave-moe calibrate` (CPU)."""

import json

import pytest

from weave_moe.cli import main
from weave_moe.models import MoESpec
from weave_moe.plan.calibrate import CURRENT_TILES, fit_profile, shipped_timeline_files
from weave_moe.plan.profile import HardwareProfile

N = 132
MODELS = ("deepseek-v3", "qwen3-30b-a3b")


def _synthetic(path, model, rate_per_sm, overhead_us, remote_gbps, local_gbps, c_split=20):
    """Two ranks, a serial run (c = N) and a static split, with tile times t = FLOPs / rate + overhead and dispatch
    tasks at the given aggregate rates; writes the file and its .meta.json sidecar."""
    spec = MoESpec.from_name(model)
    shape = CURRENT_TILES
    task_bytes = 16 * 2 * spec.hidden_size
    ranks = []
    for rank in range(2):
        variants = {}
        for variant, c in (("weave:serial", N), (f"weave:static:{c_split}", c_split)):
            events, clock = [], {}
            t_rem = c * task_bytes / (remote_gbps[c] * 1e3) * 1e3    # ns
            t_loc = c * 2 * task_bytes / (local_gbps[c] * 1e3) * 1e3
            order = [(0, t_loc if rank == 0 else t_rem)] * 64 + [(1, t_rem if rank == 0 else t_loc)] * 64
            for i, (_, dur) in enumerate(order):   # claimed in order, round robin over the c comm CTAs
                cta = i % c
                start = clock.get(cta, 0)
                events.append([cta, "dispatch", int(start), int(start + dur)])
                clock[cta] = start + dur
            dispatch_end = max(e[3] for e in events)
            gemm_ctas = range(N) if c == N else range(c, N)
            for stage in (0, 1):
                dur = (shape.flops(stage, spec) / rate_per_sm + overhead_us) * 1e3
                for cta in gemm_ctas:
                    start = max(clock.get(cta, 0), dispatch_end)
                    for _ in range(4):
                        kind = f"gemm{stage}" if c < N else f"stolen_gemm{stage}"
                        events.append([cta, kind, int(start), int(start + dur)])
                        start += dur
                    clock[cta] = start
            variants[variant] = dict(plan=dict(c=c, K=1, n_steal=0, predicted_us=0.0), events=events)
        ranks.append(variants)
    path.write_text(json.dumps(ranks))
    meta = dict(model=model, tokens=4096, block_m=shape.block_m, block_n0=shape.block_n0, block_n1=shape.block_n1)
    (path.parent / (path.name + ".meta.json")).write_text(json.dumps(meta))
    return path


def test_fit_recovers_synthetic_rates(tmp_path):
    rate, overhead = 4.5e6, 3.0      # FLOP/us per SM, us
    remote = {N: 380.0, 20: 250.0}
    local = {N: 2500.0, 20: 500.0}
    files = [_synthetic(tmp_path / f"syn-{m}-4096.json", m, rate, overhead, remote, local) for m in MODELS]
    base = HardwareProfile.default()
    profile, report = fit_profile(files, base, fit_falloff=False, date="2000-01-01")
    assert report["fitted"]["tile_tflops_per_sm"] == pytest.approx(rate / 1e6, rel=0.02)
    assert profile.per_tile_overhead_us == pytest.approx(overhead, abs=0.3)
    assert float(profile.gemm_throughput_tflops(N)) / N == pytest.approx(rate / 1e6, rel=0.02)
    for c in (20, N):
        assert float(profile.comm_bandwidth_gbps(c)) == pytest.approx(remote[c], rel=0.03)
        assert float(profile.local_bandwidth_gbps(c)) == pytest.approx(local[c], rel=0.03)
    assert (profile.block_m, profile.block_n0, profile.block_n1) == (128, 128, 256)
    assert "2000-01-01" in profile.source and "syn-deepseek-v3-4096.json" in profile.source
    assert max(profile.gemm_tflops) == max(base.gemm_tflops)    # the floor's peak is kept


def test_fit_on_shipped_timelines_round_trips(tmp_path):
    files = shipped_timeline_files()
    if not files:
        pytest.skip("bench/results/timelines not present")
    profile, report = fit_profile(files, date="2026-11-29")
    assert report["gemm_points"] and report["dispatch"]
    assert 0 < profile.gemm_tile_efficiency <= 1 and profile.per_tile_overhead_us >= 0
    path = tmp_path / "p.json"
    profile.save(path)
    assert HardwareProfile.load(path) == profile


def test_shipped_measured_profile_loads():
    profile = HardwareProfile.load_named("h200_measured")
    assert profile.name == "h200-measured" and "calibrated" in profile.source
    assert (profile.block_m, profile.block_n0, profile.block_n1) == (128, 128, 256)
    assert HardwareProfile.default().name == "h200-measured"  # the calibrated profile is the default
    assert HardwareProfile.default().call_overhead_us > 0 and HardwareProfile.default().max_comm_sms == 48
    with pytest.raises(ValueError, match="shipped"):
        HardwareProfile.load_named("nope")


def test_cli_from_timelines(tmp_path, capsys):
    files = [_synthetic(tmp_path / f"syn-{m}-4096.json", m, 4.0e6, 2.0, {N: 380.0, 20: 250.0},
                        {N: 2500.0, 20: 500.0}) for m in MODELS]
    out = tmp_path / "fitted.json"
    assert main(["calibrate", "--from-timelines", *map(str, files), "--out", str(out),
                 "--report", str(tmp_path / "r.json")]) == 0
    profile = HardwareProfile.load(out)
    assert float(profile.gemm_throughput_tflops(N)) / N == pytest.approx(4.0, rel=0.05)
    assert "UNVALIDATED" in capsys.readouterr().out


def test_cli_missing_file(tmp_path):
    assert main(["calibrate", "--from-timelines", str(tmp_path / "absent.json"), "--out",
                 str(tmp_path / "x.json")]) != 0


def test_cli_measure_without_cuda(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["calibrate", "--measure", "--out", str(tmp_path / "x.json")]) != 0
    assert "needs CUDA" in capsys.readouterr().out


def test_cli_hbm_without_cuda_and_nothing_to_do(tmp_path, capsys):
    import torch

    assert main(["calibrate", "--out", str(tmp_path / "x.json")]) == 2
    assert "--hbm" in capsys.readouterr().out
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["calibrate", "--hbm", "--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out and not (tmp_path / "x.json").exists()


def test_shipped_profiles_carry_the_hbm_read_bandwidth():
    from weave_moe.plan.calibrate import format_fit_table

    for name in ("h200_measured", "h200_default"):
        assert HardwareProfile.load_named(name).hbm_read_gbps == 4240.0
    profile = HardwareProfile.default()
    assert ("hbm_read_gbps (0 = not measured)", "4240", "4240") in format_fit_table(profile, profile)
