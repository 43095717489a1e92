"""The benchmark harness: floor arithmetic by hand, variant names, the ranking against the best baseline, the
emulated-EP shape, the CPU refusal, exit codes, result names that never overwrite, and the result files of tiny
end-to-end runs (gloo ranks: a skipped backend, an own-process backend, --emulate-ep).

Tests never judge times; the end-to-end runs check that the files and columns exist and that the check passes.
"""

import csv
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from weave_moe.bench import report
from weave_moe.bench.config import BenchConfig, emulated_spec
from weave_moe.bench.floor import FloorConstants, layer_floor, rank_traffic
from weave_moe.bench.variants import Variant, parse_variant, parse_variants
from weave_moe.cli import main
from weave_moe.commands.bench import parse_models
from weave_moe.models import MoESpec

# E = 4 experts on EP = 2 ranks: rank 0 owns experts {0, 1}, rank 1 owns {2, 3}. -1 = no expert.
IDS_RANK0 = [[0, 1], [0, 2], [3, -1]]
IDS_RANK1 = [[2, 3], [1, -1], [-1, -1], [2, -1]]
HIDDEN, INTERMEDIATE = 10, 5  # 6 * H * I = 300 FLOPs per (token, expert) pair


def test_rank_traffic_by_hand():
    traffic = rank_traffic([torch.tensor(IDS_RANK0), np.array(IDS_RANK1)], num_experts=4)
    # pairs on rank 0: rank 0's (0, 1, 0) + rank 1's (1) = 4; on rank 1: rank 0's (2, 3) + rank 1's (2, 3, 2) = 5.
    assert traffic.pairs.tolist() == [4, 5]
    # rank 0 -> 1: tokens 1 and 2 (token 0 stays home); rank 1 -> 0: token 1 only (token 0 has both experts at home).
    assert traffic.dispatch_sent.tolist() == [2, 1]
    assert traffic.dispatch_received.tolist() == [1, 2]
    assert traffic.combine_sent.tolist() == [1, 2]
    assert traffic.combine_received.tolist() == [2, 1]
    # 3 rows each way per rank, 10 bf16 elements per row.
    assert traffic.bytes_sent(HIDDEN).tolist() == [60, 60]
    assert traffic.bytes_received(HIDDEN).tolist() == [60, 60]


def test_dispatch_dedups_experts_on_the_same_rank():
    # One token of rank 0 with both of its experts on rank 1: one row out, one row back, two pairs of GEMM.
    traffic = rank_traffic([np.array([[2, 3]]), np.zeros((0, 2), dtype=np.int64)], num_experts=4)
    assert traffic.dispatch_sent.tolist() == [1, 0]
    assert traffic.combine_received.tolist() == [1, 0]
    assert traffic.pairs.tolist() == [0, 2]


def test_layer_floor_by_hand():
    traffic = rank_traffic([np.array(IDS_RANK0), np.array(IDS_RANK1)], num_experts=4)
    # 1e-9 TFLOP/s = 1000 FLOP/s; 1e-7 GB/s = 100 B/s.
    slow_gemm = FloorConstants(gemm_tflops=1e-9, peer_gbps=1e-7, source="test")
    floor = layer_floor(traffic, HIDDEN, INTERMEDIATE, slow_gemm)
    assert floor.flops == [1200.0, 1500.0]
    assert floor.compute_s == pytest.approx([1.2, 1.5])
    assert floor.comm_s == pytest.approx([0.6, 0.6])
    assert (floor.floor_s, floor.bound, floor.slowest_rank) == (pytest.approx(1.5), "compute", 1)
    # 10 B/s: comm 6 s on both ranks beats compute; the first rank with the max is reported.
    slow_link = FloorConstants(gemm_tflops=1e-9, peer_gbps=1e-8, source="test")
    floor = layer_floor(traffic, HIDDEN, INTERMEDIATE, slow_link)
    assert (floor.floor_s, floor.bound, floor.slowest_rank) == (pytest.approx(6.0), "comm", 0)


def test_weights_term_is_part_of_the_floor():
    # Experts hit: rank 0 {0, 1} (both), rank 1 {2, 3} (both); a third layout leaves expert 1 unused.
    traffic = rank_traffic([np.array(IDS_RANK0), np.array(IDS_RANK1)], num_experts=4)
    assert traffic.experts_hit.tolist() == [2, 2]
    # 3 * H * I * 2 B = 300 B per expert; 1e-7 GB/s = 100 B/s -> 6 s per rank, above compute (1.5 s) and comm (0.6 s)
    floor = layer_floor(traffic, HIDDEN, INTERMEDIATE, FloorConstants(gemm_tflops=1e-9, peer_gbps=1e-7, hbm_gbps=1e-7))
    assert floor.weights_s == pytest.approx([6.0, 6.0]) and floor.weights_floor_s == pytest.approx(6.0)
    assert (floor.floor_s, floor.bound, floor.slowest_rank) == (pytest.approx(6.0), "weights", 0)
    # a fast HBM: the weights term no longer binds, the floor is the compute term again
    fast = layer_floor(traffic, HIDDEN, INTERMEDIATE, FloorConstants(gemm_tflops=1e-9, peer_gbps=1e-7, hbm_gbps=1.0))
    assert (fast.floor_s, fast.bound) == (pytest.approx(1.5), "compute")
    sparse = rank_traffic([np.array([[0, 2], [0, -1]]), np.array([[3, 0]])], num_experts=4)
    assert sparse.experts_hit.tolist() == [1, 2]
    # ids outside [0, E) are not experts (the layer rejects them; the floor must not crash on -1 padding)
    assert rank_traffic([np.array([[-1, -1]])], num_experts=4).experts_hit.tolist() == [0]


def test_single_rank_has_no_nvlink_bytes():
    traffic = rank_traffic([np.array(IDS_RANK0)], num_experts=4)
    floor = layer_floor(traffic, HIDDEN, INTERMEDIATE, FloorConstants(gemm_tflops=1e-9, peer_gbps=1.0))
    assert floor.bytes_sent == [0.0] and floor.floor_s == pytest.approx(5 * 300 / 1000)


def test_floor_constants_from_profile():
    import dataclasses

    from weave_moe.plan import HardwareProfile

    profile = HardwareProfile.default()
    constants = FloorConstants.from_profile(profile)
    assert constants.gemm_tflops == max(profile.gemm_tflops) and constants.peer_gbps == max(profile.comm_gbps)
    assert constants.hbm_gbps == profile.hbm_read_gbps == 4240.0 and profile.name in constants.source
    # a profile written before hbm_read_gbps existed loads with 0 and falls back to the default rate
    old = HardwareProfile.from_dict({k: v for k, v in profile.to_dict().items() if k != "hbm_read_gbps"})
    assert old.hbm_read_gbps == 0.0
    assert FloorConstants.from_profile(old).hbm_gbps == FloorConstants().hbm_gbps
    assert FloorConstants.from_profile(dataclasses.replace(profile, hbm_read_gbps=3000.0)).hbm_gbps == 3000.0
    with pytest.raises(ValueError):
        FloorConstants(gemm_tflops=0.0)
    with pytest.raises(ValueError, match="hbm_read_gbps"):
        dataclasses.replace(profile, hbm_read_gbps=-1.0)


def test_stage_breakdown_is_median_over_sets_of_max_over_ranks():
    from weave_moe.bench.harness import _gather_stages, _stage_times

    class Layer:  # reports fixed stage times, like the nccl backend does on CUDA
        calls = 0

        def __call__(self, x, ids, weights, timings=None):
            Layer.calls += 1
            timings.update(dispatch=float(Layer.calls), total=10.0 * Layer.calls)

    stages = _stage_times(Layer(), [(None, None, None)] * 3, SimpleNamespace(type="cuda"))
    assert stages == {"dispatch": [1.0, 2.0, 3.0], "total": [10.0, 20.0, 30.0]}
    assert _gather_stages(stages, 1) == {"dispatch": 2.0, "total": 20.0}
    assert _stage_times(Layer(), [(None, None, None)], SimpleNamespace(type="cpu")) == {}


def test_variant_names():
    assert parse_variant("nccl") == Variant("nccl", "nccl", None)
    assert parse_variant("weave") == Variant("weave", "weave", "weave")
    assert parse_variant("weave:static:20").policy == "static:20"
    assert [v.name for v in parse_variants("nccl, weave:static:20,4,weave")] == ["nccl", "weave:static:20,4", "weave"]
    assert parse_variants("weave:static:20,4")[0].policy == "static:20,4"
    for bad, message in (("ncl", "unknown backend 'ncl'"), ("nccl:serial", "only the weave backend"),
                         ("weave:statc:2", "valid policies"), ("nccl,nccl", "given twice"), (" , ", "no variant")):
        with pytest.raises(ValueError, match=message):
            parse_variants(bad)


def test_variants_with_kernel_settings(monkeypatch):
    """`weave...@key=value`: one run A/Bs kernel configurations side by side; the settings reach the layer's
    KernelConfig on top of WEAVE_MOE_KERNEL_CONFIG, and a typo fails at parse time, naming the variant."""
    from weave_moe.backends.weave.config import KERNEL_CONFIG_ENV, KernelConfig

    monkeypatch.setenv(KERNEL_CONFIG_ENV, "decode_stages=off,block_h=256")
    names = [v.name for v in parse_variants("nccl,weave:serial@independent_scan=off@block_h=128,weave:static:20,4@"
                                            "fork_prologue=0,weave")]
    assert names == ["nccl", "weave:serial@independent_scan=off@block_h=128", "weave:static:20,4@fork_prologue=0",
                     "weave"]
    variant = parse_variant("weave:serial@independent_scan=off@block_h=128")
    assert (variant.backend, variant.policy, variant.kernel_config) == ("weave", "serial",
                                                                        "independent_scan=off,block_h=128")
    options = variant.layer_options()
    assert options["policy"] == "serial"
    config = options["config"]
    assert (config.independent_scan, config.block_h, config.decode_stages) == (False, 128, False)   # env, then ours
    assert config == KernelConfig(independent_scan=False, block_h=128, decode_stages=False)
    assert parse_variant("weave:static:20,4@fork_prologue=0").policy == "static:20,4"
    assert parse_variant("weave:serial").layer_options() == dict(policy="serial")   # no config: the layer's default
    assert parse_variant("nccl").layer_options() == {}
    # under --emulate-ep a weave layer plans on the device as a rank of that EP would: serial_at_ep1 off, below the
    # environment and the variant (a key of either wins); other backends take no KernelConfig
    emulated = parse_variant("weave").layer_options(emulated=True)
    assert emulated["config"] == KernelConfig(serial_at_ep1=False, block_h=256, decode_stages=False)
    assert parse_variant("weave@serial_at_ep1=on").layer_options(emulated=True)["config"].serial_at_ep1
    monkeypatch.setenv(KERNEL_CONFIG_ENV, "serial_at_ep1=on")
    assert parse_variant("weave:serial").layer_options(emulated=True)["config"].serial_at_ep1
    assert parse_variant("nccl").layer_options(emulated=True) == {}
    monkeypatch.setenv(KERNEL_CONFIG_ENV, "decode_stages=off,block_h=256")
    for bad, message in (("nccl@tma=0", "only the weave backend"), ("weave@", "empty @ setting"),
                         ("weave:serial@independnt_scan=off", "variant 'weave:serial@independnt_scan=off'"),
                         ("weave@block_h=wide", "must be an integer")):
        with pytest.raises(ValueError, match=message):
            parse_variants(bad)


def test_validate_uses_the_same_parser():
    import inspect

    from weave_moe import validate

    source = inspect.getsource(validate.main)
    assert "parse_variants(args.variants)" in source and "re.split" not in source


def test_model_arguments():
    specs = parse_models(None, [])
    assert [s.name for s in specs][:2] == ["deepseek-v3", "phi-3.5-moe"] and len(specs) == 6
    (custom,) = parse_models(None, ["8,2,64,32"])
    assert (custom.num_experts, custom.top_k, custom.hidden_size, custom.intermediate_size) == (8, 2, 64, 32)
    with pytest.raises(ValueError):
        parse_models(None, ["8,2,64"])


# --------------------------------------------------------------------------------------------------------------------
# ranking against the best baseline (synthetic rows)


def _row(model, tokens, routing, variant, median_ms, error="", skipped="", check_passed=None, floor_ms=0.5):
    return dict(model=model, tokens_per_rank=tokens, routing=routing, variant=variant,
                backend=variant.partition(":")[0], median_ms=None if error or skipped else median_ms, error=error,
                skipped=skipped, floor_ms=floor_ms, x_floor=median_ms / floor_ms if median_ms else None,
                check_passed=check_passed, lib_compute_ms=None)


def _rows():
    """Two token bands. At 128: nccl 4, symm 2 (best), deepep skipped, weave 1. At 512: symm failed its check, so
    nccl 3 is the best though symm's time is lower. At 4096: only nccl ran (symm errored); weave 12 vs nccl 8."""
    skip = "ImportError: no deep_ep"
    rows = []
    for tokens, nccl, symm, weave, symm_check in ((128, 4.0, 2.0, 1.0, True), (512, 3.0, 1.0, 1.5, False)):
        rows += [_row("m", tokens, "uniform", "nccl", nccl, check_passed=True),
                 _row("m", tokens, "uniform", "symm", symm, check_passed=symm_check),
                 _row("m", tokens, "uniform", "deepep", None, skipped=skip),
                 _row("m", tokens, "uniform", "weave", weave, check_passed=True)]
    rows += [_row("m", 4096, "uniform", "nccl", 8.0, floor_ms=4.0),
             _row("m", 4096, "uniform", "symm", None, error="boom"),
             _row("m", 4096, "uniform", "deepep", None, skipped=skip),
             _row("m", 4096, "uniform", "weave", 12.0, floor_ms=4.0)]
    return rows


def test_best_baseline_skips_skipped_failed_and_wrong_backends():
    rows = _rows()
    report.add_rankings(rows)
    weave = {r["tokens_per_rank"]: r for r in rows if r["variant"] == "weave"}
    best = weave[128]
    assert (best["best_baseline"], best["best_baseline_ms"], best["x_best_baseline"]) == ("symm", 2.0, 0.5)
    assert (weave[512]["best_baseline"], weave[512]["x_best_baseline"]) == ("nccl", 0.5)  # symm failed its check
    assert (weave[4096]["best_baseline"], weave[4096]["x_best_baseline"]) == ("nccl", 1.5)
    assert weave[128]["x_nccl"] == 0.25 and weave[128]["x_symm"] == 0.5 and weave[128]["x_deepep"] is None
    assert weave[512]["x_symm"] is None  # a baseline that failed its check is no reference for anyone
    skipped = next(r for r in rows if r["variant"] == "deepep")
    assert skipped["x_best_baseline"] is None and skipped["best_baseline"] == "symm"
    # a configuration with no baseline at all: no best baseline, no ratio
    lonely = [_row("m", 1, "skewed", "weave:serial", 1.0)]
    report.add_rankings(lonely)
    assert lonely[0]["best_baseline"] is None and lonely[0]["x_best_baseline"] is None


def test_summary_geomeans_per_token_band():
    rows = _rows()
    assert report.token_bands(rows) == [("128-512", 128, 512), ("4096", 4096, 4096)]
    table = {(s["tokens"], s["variant"]): s for s in report.summary(rows)}
    small, large = table["128-512", "weave"], table["4096", "weave"]
    assert small["x_best_baseline"] == pytest.approx(0.5)  # geomean(0.5, 0.5)
    assert small["x_nccl"] == pytest.approx(math.sqrt(0.25 * 0.5))
    assert small["x_symm"] == pytest.approx(0.5) and small["x_deepep"] is None  # only the 128 config has symm
    assert small["x_floor"] == pytest.approx(math.sqrt(2.0 * 3.0))
    assert (large["x_best_baseline"], large["x_floor"]) == (pytest.approx(1.5), pytest.approx(3.0))
    assert (small["configs"], small["failed"], small["skipped"], small["checks"]) == (2, 0, 0, "2/2")
    deepep = table["128-512", "deepep"]
    assert (deepep["skipped"], deepep["failed"], deepep["x_best_baseline"]) == (2, 0, None)
    assert table["4096", "symm"]["failed"] == 1
    assert report.geomean([None, 0.0, math.inf]) is None


def test_library_standing_takes_each_configurations_fastest_weave_variant():
    rows = _rows()
    assert report.library_standing(rows) == []   # no anchor: nothing to stand against
    anchors = {128: 1.2, 512: 1.0, 4096: 10.0}
    for row in rows:
        row["lib_compute_ms"] = anchors[row["tokens_per_rank"]]
    rows += [_row("m", 512, "uniform", "weave:serial", 0.9, check_passed=True),      # faster than weave: it counts
             _row("m", 128, "uniform", "weave:serial", 0.5, check_passed=False),     # failed its check: ignored
             _row("m", 4096, "uniform", "weave:serial", None, error="boom")]         # no time: ignored
    for row in rows[-3:]:
        row["lib_compute_ms"] = anchors[row["tokens_per_rank"]]
    standing = {s["tokens"]: s for s in report.library_standing(rows)}
    small, large = standing["128-512"], standing["4096"]
    # 128: weave 1.0 / 1.2; 512: weave:serial 0.9 / 1.0 (weave's 1.5 is slower); baselines never count
    assert (small["configs"], small["at_or_under"]) == (2, 2)
    assert small["geomean"] == pytest.approx(math.sqrt(1.0 / 1.2 * 0.9))
    assert small["worst"] == ("m", 512, "uniform", pytest.approx(0.9))
    assert (large["configs"], large["at_or_under"], large["worst"][3]) == (1, 0, pytest.approx(1.2))
    text = report.markdown(rows, {"name": "t"})
    assert "### Against the library compute" in text
    assert "- 4096 tokens per rank: at or under in 0 of 1, geomean 1.200, worst m 4096 uniform 1.200" in text


def test_markdown_and_csv_columns(tmp_path):
    rows = _rows()
    text = report.markdown(rows, {"name": "t", "emulate_ep": 2})
    assert text.startswith("# Benchmark t (emulated EP=2 on one GPU)")
    assert "### 128-512 tokens per rank" in text and "### 4096 tokens per rank" in text
    assert "| variant | configs | failed | skipped | checks | x best baseline | x nccl | x symm | x floor |" in text
    assert "**geomean 128-512**" in text and "symm 2 |" in text and "boom" in text and "no deep_ep" in text
    assert "## Failed checks" in text
    path = tmp_path / "rows.csv"
    report.add_rankings(rows)
    report.write_csv(rows, str(path))
    with open(path) as handle:
        header = next(csv.reader(handle))
    for column in ("best_baseline", "best_baseline_ms", "x_best_baseline", "x_floor", "lib_compute_ms", "x_nccl",
                   "x_symm", "x_deepep", "skipped", "emulate_ep", "floor_weights_ms"):
        assert column in header, column
    # which variants were replayed from CUDA graphs (--graph) is said once, above the tables
    assert "- timing:" not in text
    for row in rows:
        row["timing"] = "graph" if row["variant"].startswith("weave") else "eager"
    graphed = sorted({row["variant"] for row in rows if row["timing"] == "graph"})
    eager = sorted({row["variant"] for row in rows if row["timing"] == "eager"})
    assert (f"- timing: each call a replay of the call captured in a CUDA graph (as serving engines run decode) for "
            f"{', '.join(graphed)}; eager calls for {', '.join(eager)}") in report.markdown(rows, {"name": "t"})


def test_failed_rows_and_exit_code(monkeypatch, tmp_path, capsys):
    rows = _rows()
    report.add_rankings(rows)
    failed = report.failed_rows(rows)
    # symm at 512 failed its check, symm at 4096 raised; the skipped deepep rows fail nothing
    assert sorted((r["variant"], r["tokens_per_rank"]) for r in failed) == [("symm", 512), ("symm", 4096)]

    from weave_moe.bench import harness

    outcome = {}
    monkeypatch.setattr(harness, "launch", lambda config, nproc=None, device="auto": outcome["rows"])
    argv = ["bench", "--model-dims", "8,2,64,32", "--variants", "nccl", "--device", "cpu", "--out", str(tmp_path),
            "--name", "x"]
    outcome["rows"] = rows
    assert main(argv) == 1
    assert "configurations failed" in capsys.readouterr().err
    outcome["rows"] = [r for r in rows if r not in failed]
    assert main(argv) == 0


# --------------------------------------------------------------------------------------------------------------------
# single-GPU emulation, CPU safety, result names


def test_emulated_spec_matches_the_per_rank_work_of_ep_n():
    from weave_moe import routing

    model = MoESpec.from_name("qwen3-30b-a3b")  # E=128, k=8
    assert emulated_spec(model, 1) is model
    spec = emulated_spec(model, 2)
    assert (spec.num_experts, spec.top_k, spec.hidden_size, spec.intermediate_size, spec.name) == (64, 8, 2048, 768,
                                                                                                  model.name)
    tokens, ep = 512, 2
    # EP = 2 for real: the pairs each rank computes, from all ranks' tokens
    real_ids, _ = routing.uniform(tokens * ep, model.num_experts, model.top_k, seed=1)
    real = rank_traffic(list(real_ids.view(ep, tokens, model.top_k)), model.num_experts)
    emulated_ids, _ = routing.uniform(tokens, spec.num_experts, spec.top_k, seed=1)
    emulated = rank_traffic([emulated_ids], spec.num_experts)
    # total pairs: T * k per rank either way (exact on average over ranks), and so rows per local expert
    assert real.pairs.sum() / ep == emulated.pairs.sum() == tokens * model.top_k
    assert emulated.pairs.sum() / spec.num_experts == real.pairs.sum() / model.num_experts
    with pytest.raises(ValueError, match="not divisible"):
        emulated_spec(MoESpec(6, 2, 64, 32), 4)
    with pytest.raises(ValueError, match="top_k=8 > E / EP = 4"):
        emulated_spec(MoESpec(16, 8, 64, 32), 4)
    with pytest.raises(ValueError):
        BenchConfig(models=(MoESpec(16, 8, 64, 32),), emulate_ep=4)


def test_cpu_refuses_paper_size_models(capsys):
    from weave_moe.bench.harness import cpu_size_problem

    for argv in (["bench", "--check", "--device", "cpu"],  # the default: the six paper models
                 ["bench", "--models", "qwen3-30b-a3b", "--tokens", "128", "--device", "cpu"]):
        assert main(argv) == 2
        message = capsys.readouterr().err
        assert "CPU limit" in message and "--model-dims" in message and "qwen3-30b-a3b" in message
    tiny = BenchConfig(models=(MoESpec(8, 2, 64, 32),), tokens=(32,))
    assert cpu_size_problem(tiny, 2) is None
    assert "deepseek-v3 ~" in cpu_size_problem(BenchConfig(models=(MoESpec.from_name("deepseek-v3"),)), 2)
    assert cpu_size_problem(BenchConfig(models=(MoESpec.from_name("deepseek-v3"),), cpu_limit_mib=0), 2) is None


def test_bad_arguments_exit_2_with_a_message(capsys):
    assert main(["bench", "--variants", "ncl", "--model-dims", "8,2,64,32", "--device", "cpu"]) == 2
    assert "unknown backend 'ncl'" in capsys.readouterr().err
    assert main(["bench", "--emulate-ep", "2", "--nproc", "2", "--model-dims", "8,2,64,32", "--device", "cpu"]) == 2
    assert "one rank" in capsys.readouterr().err
    assert main(["bench", "--tokens", "8,32", "--max-tokens-per-rank", "16", "--model-dims", "8,2,64,32",
                 "--device", "cpu"]) == 2
    assert "max_tokens_per_rank must be 0 (the largest of tokens) or at least the largest of tokens (32), got 16" in \
        capsys.readouterr().err


def test_result_names_never_overwrite(tmp_path):
    from weave_moe.cli import build_parser
    from weave_moe.commands.bench import build_config

    assert report.unique_name(str(tmp_path), "run") == "run"
    (tmp_path / "run.json").write_text("{}")
    assert report.unique_name(str(tmp_path), "run") == "run-2"
    (tmp_path / "run-2_latency.png").write_text("")
    assert report.unique_name(str(tmp_path), "run") == "run-3"
    args = build_parser().parse_args(["bench", "--model-dims", "8,2,64,32", "--name", "run", "--out", str(tmp_path),
                                      "--device", "cpu"])
    config = build_config(args, ["weave-moe", "bench"])
    assert config.name == config.metadata["name"] == "run-3"


def test_help_works(capsys):
    for argv in (["--help"], ["bench", "--help"], ["calibrate", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
    assert "--emulate-ep" in capsys.readouterr().out


def test_python_dash_m_bench_help():
    import os
    import subprocess
    import sys

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "weave_moe.bench", "--help"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0 and "--emulate-ep" in done.stdout


def test_build_outcome_skipped_or_failed():
    """A backend that cannot be constructed here (RuntimeError / ImportError) is skipped; a bad option fails."""
    from weave_moe.bench.harness import _build_layer

    spec = MoESpec(8, 2, 64, 32)
    config = BenchConfig(models=(spec,), tokens=(8,))
    w13, w2 = torch.zeros(8, 64, 64, dtype=torch.bfloat16), torch.zeros(8, 64, 32, dtype=torch.bfloat16)
    cpu = torch.device("cpu")
    built = _build_layer(spec, parse_variant("nccl"), config, cpu, w13, w2)
    assert built.layer is not None and built.error is None and built.skipped is None
    weave = _build_layer(spec, parse_variant("weave:serial"), config, cpu, w13, w2)  # CUDA only
    assert weave.layer is None and weave.error is None and "CUDA" in weave.skipped
    wrong = _build_layer(spec, Variant("nccl:serial", "nccl", "serial"), config, cpu, w13, w2)
    assert wrong.layer is None and wrong.skipped is None and "ValueError" in wrong.error
    bad_weights = _build_layer(spec, parse_variant("nccl"), config, cpu, w13[:2], w2)
    assert bad_weights.skipped is None and "w13" in bad_weights.error


def test_process_groups_put_own_process_backends_last():
    from weave_moe.bench.harness import process_groups

    variants = tuple(parse_variants("nccl,reference,weave:serial,weave"))
    config = BenchConfig(models=(), variants=variants, own_process=("reference",))
    assert [[v.name for v in group] for group in process_groups(config)] == [["nccl", "weave:serial", "weave"],
                                                                             ["reference"]]
    assert len(process_groups(BenchConfig(models=(), variants=variants, own_process=()))) == 1
    only = BenchConfig(models=(), variants=variants[1:2], own_process=("reference",))
    assert [[v.name for v in g] for g in process_groups(only)] == [["reference"]]


# --------------------------------------------------------------------------------------------------------------------
# the library compute anchor


def test_local_group_sizes_by_hand():
    from weave_moe.bench.anchor import local_group_sizes

    ids = torch.tensor(IDS_RANK0 + IDS_RANK1)  # both ranks' tokens, E = 4 on EP = 2
    assert local_group_sizes(ids, 4, 2, 0) == [2, 2]  # expert 0: 2 pairs, expert 1: 2 pairs
    assert local_group_sizes(ids, 4, 2, 1) == [3, 2]
    assert local_group_sizes(ids, 4, 1, 0) == [2, 2, 3, 2]


def test_anchor_computes_the_expert_math():
    from weave_moe.bench.anchor import grouped_expert_compute, grouped_mm_usable, time_library_compute
    from weave_moe.reference import moe_error, reference_moe
    from weave_moe.testing import make_experts

    spec = MoESpec(4, 1, 64, 32)
    if grouped_mm_usable(torch.device("cpu"), spec.hidden_size, spec.intermediate_size) is not None:
        pytest.skip("torch._grouped_mm is not available here")
    w13, w2 = make_experts(spec, seed=3)
    sizes = [3, 0, 5, 1]  # an expert with no rows included
    expert_of_row = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    x = torch.randn(sum(sizes), spec.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    out = grouped_expert_compute(x, offsets, w13, w2)
    expected = reference_moe(x, expert_of_row[:, None], torch.ones(len(x), 1), w13, w2)
    # tolerance: the anchor rounds gate/up to bf16 before SiLU-mul (the reference keeps them fp32), ~2^-8 relative
    assert moe_error(out.float(), expected.float())[0] <= 1e-2
    assert time_library_compute([sizes, [0, 0, 0, 0]], w13, w2, iters=2) >= 0.0


# --------------------------------------------------------------------------------------------------------------------
# tiny end-to-end runs (gloo ranks on the CPU)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny run on 2 gloo ranks: nccl (must pass the check), weave (skipped: CUDA only), and the reference
    backend in ranks of its own (--own-process), so the run spawns two sets of ranks and joins their rows."""
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--model-dims", "8,2,64,32", "--tokens", "16,24", "--routing", "uniform,skewed",
                 "--variants", "nccl,reference,weave", "--own-process", "reference", "--iters", "3", "--warmup", "1",
                 "--rotate", "2", "--check", "--device", "cpu", "--nproc", "2", "--name", "tiny", "--out", str(out),
                 "--no-progress", "--timeout", "120", "--attention"])
    return code, report.result_paths(str(out), "tiny")


def test_tiny_run_writes_every_file(tiny_run):
    code, paths = tiny_run
    assert code == 0  # a skipped backend fails nothing
    for key in ("json", "csv", "md", "latency_png", "vs_baseline_png", "e2e_csv"):
        with open(paths[key], "rb") as handle:
            assert len(handle.read()) > 100, key
    with open(paths["json"]) as handle:
        data = json.load(handle)
    metadata = data["metadata"]
    assert metadata["world_size"] == 2 and metadata["device"] == "cpu" and not metadata["partial"]
    assert metadata["command"].startswith("weave-moe bench") and "--model-dims 8,2,64,32" in metadata["command"]
    assert metadata["git_commit"] and metadata["emulate_ep"] == 1
    assert metadata["floor_constants"]["hbm_gbps"] == 4240.0
    assert [r["variant"] for r in data["rows"][::4]] == ["nccl", "reference", "weave"]  # the config's order
    assert len(data["rows"]) == 2 * 2 * 3  # tokens x routing x variants
    import os

    assert sorted(os.listdir(os.path.dirname(paths["json"]))) == sorted(os.path.basename(p) for p in paths.values())


def test_tiny_run_csv_columns_and_check(tiny_run):
    _, paths = tiny_run
    with open(paths["csv"]) as handle:
        rows = list(csv.DictReader(handle))
    measured = [r for r in rows if r["variant"] in ("nccl", "reference")]
    assert len(measured) == 8
    for row in measured:
        assert row["check_passed"] == "True" and float(row["rel_error"]) <= 1e-2, row
        assert float(row["median_ms"]) > 0 and float(row["floor_ms"]) > 0 and float(row["tflops"]) > 0
        assert float(row["p10_ms"]) <= float(row["median_ms"]) <= float(row["p90_ms"])
        assert row["error"] == "" and row["skipped"] == ""
        # the anchor, measured by the first set of ranks, reaches the own-process rows too
        assert float(row["lib_compute_ms"]) > 0 and float(row["x_lib_compute"]) > 0
        assert row["best_baseline"] == "nccl" and float(row["x_best_baseline"]) > 0


def test_tiny_run_records_a_skipped_backend(tiny_run):
    _, paths = tiny_run
    with open(paths["csv"]) as handle:
        skipped = [r for r in csv.DictReader(handle) if r["variant"] == "weave"]
    assert len(skipped) == 4
    for row in skipped:
        assert "CUDA" in row["skipped"] and row["error"] == "" and row["median_ms"] == "" and row["check_passed"] == ""
    with open(paths["md"]) as handle:
        assert "## Skipped" in handle.read()


def test_replot_rewrites_from_json(tiny_run, tmp_path):
    import shutil

    _, paths = tiny_run
    copy = tmp_path / "again.json"
    shutil.copy(paths["json"], copy)
    assert main(["bench", "--replot", str(copy)]) == 0
    for suffix in (".csv", ".md", "_latency.png", "_vs_baseline.png"):
        assert (tmp_path / f"again{suffix}").stat().st_size > 100


def test_tiny_run_end_to_end_estimate(tiny_run):
    _, paths = tiny_run
    with open(paths["e2e_csv"]) as handle:
        rows = list(csv.DictReader(handle))
    assert [r["variant"] for r in rows] == ["nccl"] * 4 + ["reference"] * 4  # the skipped variant has no estimate
    for row in rows:
        assert float(row["e2e_ms"]) == pytest.approx(float(row["attention_ms"]) + float(row["shared_ms"])
                                                     + float(row["moe_ms"]), rel=1e-4)
    assert all(float(r["x_best_baseline_e2e"]) == 1.0 for r in rows if r["variant"] == "nccl")
    with open(paths["md"]) as handle:
        assert "End-to-end estimate" in handle.read()


def test_e2e_rows_arithmetic():
    rows = [_row("m", 8, "uniform", "nccl", 3.0), _row("m", 8, "uniform", "weave", 1.0)]
    attention = [dict(model="m", tokens_per_rank=8, attention_ms=0.5, shared_ms=0.5, attention={})]
    nccl, weave = report.e2e_rows(rows, attention)
    assert (nccl["e2e_ms"], weave["e2e_ms"]) == (4.0, 2.0)
    assert weave["x_best_baseline_e2e"] == 0.5 and weave["x_best_baseline"] == pytest.approx(1 / 3)
    assert weave["moe_share"] == 0.5


def test_emulated_run(tmp_path):
    """--emulate-ep 2 on one gloo rank: the rows say so, the layer held E/2 experts, the floor has no NVLink term."""
    assert main(["bench", "--model-dims", "8,2,64,32", "--tokens", "8", "--routing", "uniform", "--variants", "nccl",
                 "--emulate-ep", "2", "--iters", "2", "--warmup", "1", "--rotate", "1", "--check", "--device", "cpu",
                 "--name", "emulated", "--out", str(tmp_path), "--no-progress", "--timeout", "120"]) == 0
    metadata, rows = report.load(str(tmp_path / "emulated.json"))
    assert metadata["emulate_ep"] == 2 and metadata["world_size"] == 1
    (row,) = rows
    assert (row["emulate_ep"], row["num_experts"], row["num_local_experts"], row["world_size"]) == (2, 8, 4, 1)
    assert row["check_passed"] and row["floor_comm_ms"] == 0.0
    assert (tmp_path / "emulated.md").read_text().startswith("# Benchmark emulated (emulated EP=2 on one GPU)")
    assert metadata["max_tokens_per_rank"] == 8   # the largest of --tokens


def test_layers_sized_for_max_tokens_per_rank(tmp_path):
    """--max-tokens-per-rank: the layers are built for that T_max (a serving engine's decode batches in buffers sized
    for its largest batch), the run still checks every call, and the results say which T_max it was."""
    from weave_moe.bench.harness import _build_layer

    spec = MoESpec(8, 2, 64, 32)
    w13, w2 = torch.zeros(8, 64, 64, dtype=torch.bfloat16), torch.zeros(8, 64, 32, dtype=torch.bfloat16)
    for given, built in ((0, 8), (48, 48)):
        config = BenchConfig(models=(spec,), tokens=(1, 8), max_tokens_per_rank=given)
        layer = _build_layer(spec, parse_variant("nccl"), config, torch.device("cpu"), w13, w2).layer
        assert config.layer_max_tokens == built and layer.max_tokens_per_rank == built
    assert main(["bench", "--model-dims", "8,2,64,32", "--tokens", "1,8", "--max-tokens-per-rank", "48", "--routing",
                 "uniform", "--variants", "nccl", "--emulate-ep", "2", "--iters", "2", "--warmup", "1", "--rotate", "1",
                 "--check", "--device", "cpu", "--name", "tmax", "--out", str(tmp_path), "--no-progress",
                 "--timeout", "120"]) == 0
    metadata, rows = report.load(str(tmp_path / "tmax.json"))
    assert metadata["max_tokens_per_rank"] == 48 and [r["check_passed"] for r in rows] == [True, True]
    assert "- layers' max_tokens_per_rank: `48`" in (tmp_path / "tmax.md").read_text()


@pytest.mark.parametrize("kind", ["gqa", "gqa-gated", "mla", "mla-lora"])
def test_attention_blocks_run_on_cpu(kind):
    from weave_moe.bench.attention import AttentionSpec, time_attention, time_shared_experts

    spec = {
        "gqa": AttentionSpec("gqa", 64, 4, 2, 16),
        "gqa-gated": AttentionSpec("gqa", 64, 4, 1, 16, output_gate=True),
        "mla": AttentionSpec("mla", 64, 2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
        "mla-lora": AttentionSpec("mla", 64, 2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                                  qk_rope_head_dim=4, v_head_dim=8),
    }[kind]
    assert time_attention(spec, 32, "cpu", seq_len=16, iters=2, warmup=1) > 0
    shared = MoESpec(8, 2, 64, 32, num_shared_experts=2, shared_intermediate_size=16)
    assert time_shared_experts(shared, 32, "cpu", iters=2, warmup=1) > 0
    assert time_shared_experts(MoESpec(8, 2, 64, 32), 32, "cpu") == 0.0


def test_warm_up_records_each_sets_plan():
    from weave_moe.bench.harness import _gather_plans, _warm_up
    from weave_moe.plan import Plan

    class Backend:
        last_plan = None

    class Layer:  # a backend whose plan depends on the input, as the weave backend's does
        backend = Backend()
        last_plan = property(lambda self: self.backend.last_plan)

        def __call__(self, x, ids, weights):
            self.backend.last_plan = Plan(c=x, K=2, n_steal=3, predicted_us=10.0 * x, policy="weave")

    # fewer warm-up calls than sets: every set is still seen
    plans = _warm_up(Layer(), [(20, None, None), (24, None, None), (28, None, None)], warmup=1)
    assert [p["c"] for p in plans] == [20, 24, 28] and plans[1]["predicted_us"] == 240.0
    assert _gather_plans(plans, 1)[2] == [plans[2]]

    class NoPlans:
        backend = Backend()
        last_plan = None

        def __call__(self, *inputs):
            pass

    assert _warm_up(NoPlans(), [(1,), (2,)], warmup=3) == [None, None]


def test_merge_two_runs(tiny_run, tmp_path):
    _, paths = tiny_run
    assert main(["bench", "--merge", paths["json"], paths["json"], "--name", "both", "--out", str(tmp_path)]) == 0
    metadata, rows = report.load(str(tmp_path / "both.json"))
    assert len(rows) == 24 and len(metadata["merged_from"]) == 2
    assert (tmp_path / "both_latency.png").stat().st_size > 100
    # merging again under the same name keeps the first result
    assert main(["bench", "--merge", paths["json"], "--name", "both", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "both-2.json").exists() and len(report.load(str(tmp_path / "both.json"))[1]) == 24


def test_round_orders_put_every_variant_first_and_last_alike():
    from weave_moe.bench.harness import round_orders

    assert round_orders(3, 1) == [[0, 1, 2]]
    orders = round_orders(3, 6)
    assert all(sorted(order) == [0, 1, 2] for order in orders)
    assert sorted(order[0] for order in orders) == [0, 0, 1, 1, 2, 2]
    assert sorted(order[-1] for order in orders) == [0, 0, 1, 1, 2, 2]
    assert round_orders(1, 3) == [[0]] * 3


@pytest.mark.parametrize("anchor", [True, False])
def test_rounds_time_the_library_anchor_between_the_variants(monkeypatch, anchor):
    """With --rounds the library compute anchor is timed in every round, at its own slot of the round's order (the
    variants' and its own turn rotate alike), and the row's lib_compute_ms is the median of all its replays; without
    the anchor the variants' order is the one it was."""
    from weave_moe.bench import harness
    from weave_moe.bench.config import BenchConfig
    from weave_moe.bench.variants import parse_variants
    from weave_moe.models import MoESpec

    spec = MoESpec(8, 2, 64, 32, name="tiny")
    config = BenchConfig(models=(spec,), variants=parse_variants("nccl,reference"), iters=7, rounds=3,
                         anchor=anchor)
    events, anchor_ms = [], iter([[4.0, 6.0], [1.0], [3.0, 2.0]])   # median of all five: 3, no round's
    monkeypatch.setattr(harness, "_build_layer", lambda *args: harness._Outcome(layer="layer"))
    monkeypatch.setattr(harness, "_time_into", lambda run, outcome, inputs, calls, device:
                        events.append((config.variants.index(run.result["variant"]), calls)))

    def start(config_, outcome, inputs, world_size, device, names=iter(config.variants)):
        return harness._Run(dict(variant=next(names)), None, [])
    monkeypatch.setattr(harness, "_start", start)

    def anchor_round(config_, spec_, inputs, w13, w2, device, calls, times):
        events.append(("anchor", calls))
        times += next(anchor_ms)
        return None
    monkeypatch.setattr(harness, "_anchor_round", anchor_round)
    monkeypatch.setattr(harness, "_finish", lambda config_, model, spec_, variant, outcome, inputs, *rest:
                        dict(variant=variant, lib_compute_ms=inputs.lib_compute_ms))
    inputs = harness._ConfigInputs(tokens=4, routing="uniform", sets=[], floors=[], group_sizes=[[1, 2]])
    rows = harness._bench_in_rounds(config, spec, spec, {(4, "uniform"): inputs}, 0, 1, torch.device("cpu"),
                                    None, None, None)
    slots = len(config.variants) + anchor
    expected = [("anchor" if index == 2 else index, calls)
                for calls, order in zip([3, 2, 2], harness.round_orders(slots, 3)) for index in order]
    assert events == expected
    assert sum(1 for name, _ in events if name == "anchor") == (3 if anchor else 0)
    assert [row["lib_compute_ms"] for row in rows] == ([3.0, 3.0] if anchor else [None, None])


def test_rounds_must_fit_the_timed_calls():
    from weave_moe.bench.config import BenchConfig
    from weave_moe.models import MoESpec

    spec = MoESpec(8, 2, 64, 32, name="tiny")
    assert BenchConfig(models=(spec,), iters=4, rounds=4).rounds == 4
    for rounds in (0, 5):
        with pytest.raises(ValueError, match="rounds"):
            BenchConfig(models=(spec,), iters=4, rounds=rounds)


def test_tiny_run_in_interleaved_rounds(tmp_path):
    """`--rounds 2`: every variant's layer kept, each configuration timed in two rounds, the library anchor in each
    too (two gloo ranks: its collectives in step); the same rows (the config's order, every check passed) and
    exactly --iters timed calls per row."""
    code = main(["bench", "--model-dims", "8,2,64,32", "--tokens", "16", "--routing", "uniform,skewed",
                 "--variants", "nccl,reference", "--own-process", "", "--iters", "5", "--rounds", "2", "--warmup",
                 "1", "--rotate", "2", "--check", "--device", "cpu", "--nproc", "2", "--name", "rounds", "--out",
                 str(tmp_path), "--no-progress", "--timeout", "120", "--no-breakdown"])
    assert code == 0
    with open(report.result_paths(str(tmp_path), "rounds")["json"]) as handle:
        data = json.load(handle)
    rows = data["rows"]
    assert [(r["variant"], r["routing"]) for r in rows] == [("nccl", "uniform"), ("nccl", "skewed"),
                                                            ("reference", "uniform"), ("reference", "skewed")]
    for row in rows:
        assert row["check_passed"] and row["error"] in (None, "") and row["iters"] == 5, row
        assert row["median_ms"] > 0 and row["lib_compute_ms"] > 0 and row["x_lib_compute"] > 0, row


@pytest.mark.parametrize("wrong_call", [None, 0, 3])   # call 3: after the 2 warm-up calls
def test_check_covers_the_first_call_and_one_after_the_warm_up(wrong_call):
    """A variant is checked on its layer's first call (which compiles) and on a call after the warm-up: a layer
    wrong on either alone fails its row (the decode fault of 13165e6 was the first call alone)."""
    from types import SimpleNamespace

    from weave_moe.bench import harness
    from weave_moe.bench.config import BenchConfig

    torch.manual_seed(0)
    x = torch.randn(6, 8).bfloat16()
    ids, weights = torch.zeros(6, 1, dtype=torch.int32), torch.ones(6, 1)

    class Layer:
        calls, last_plan = 0, None

        def __call__(self, x, ids, weights):
            wrong = self.calls == wrong_call
            self.calls += 1
            return torch.zeros_like(x) if wrong else x.clone()

        def synchronize(self):
            pass

    inputs = SimpleNamespace(sets=[(x, ids, weights)], check_idx=torch.arange(6), reference=x.float())
    config = BenchConfig(models=("m",), check=True, warmup=2)
    run = harness._start(config, harness._Outcome(layer=Layer()), inputs, world_size=1, device=torch.device("cpu"))
    assert run.error is None
    assert run.result["check_passed"] is (wrong_call is None), run.result
    assert (run.result["rel_error"] == 0.0) is (wrong_call is None)


@pytest.mark.parametrize("replay_writes", [True, False])
def test_graph_timing_checks_the_captured_call_into_a_poisoned_output(monkeypatch, replay_writes):
    """`--graph`: a capturable layer's calls are captured (one graph per input set) after the warm-up; set 0's
    captured output is poisoned and replayed once, then checked, so a captured call that does not write its output
    fails the row. The timed loop replays the graphs (stubbed here: no CUDA on the CPU box)."""
    from types import SimpleNamespace

    from weave_moe.bench import harness
    from weave_moe.bench.config import BenchConfig

    x = torch.randn(6, 8).bfloat16()
    ids, weights = torch.zeros(6, 1, dtype=torch.int32), torch.ones(6, 1)

    class Layer:
        last_plan, capturable = None, True

        def __call__(self, x, ids, weights):
            return x.clone()

        def synchronize(self):
            pass

    class Graph:
        def __init__(self, out, value):
            self.out, self.value, self.replays = out, value, 0

        def replay(self):
            self.replays += 1
            if replay_writes:
                self.out.copy_(self.value)

    captured = []

    def capture_calls(layer, sets):
        outputs = [layer(*s) for s in sets]
        captured.extend(Graph(out, out.clone()) for out in outputs)
        return list(captured), outputs

    monkeypatch.setattr(harness, "_capture_calls", capture_calls)
    cuda = SimpleNamespace(type="cuda")   # only the device test reads it before the stubbed capture
    inputs = SimpleNamespace(sets=[(x, ids, weights)], check_idx=torch.arange(6), reference=x.float())
    config = BenchConfig(models=("m",), check=True, warmup=1, graph=True)
    run = harness._start(config, harness._Outcome(layer=Layer()), inputs, world_size=1, device=cuda)
    assert run.error is None and run.result["timing"] == "graph" and run.graphs == captured
    assert captured[0].replays == 1
    assert run.result["check_passed"] is replay_writes, run.result
    # not capturable (or not asked): eager, no graphs
    for layer_capturable, graph, device in ((False, True, cuda), (True, False, cuda),
                                            (True, True, torch.device("cpu"))):
        layer = Layer()
        layer.capturable = layer_capturable
        run = harness._start(BenchConfig(models=("m",), check=True, warmup=1, graph=graph), harness._Outcome(
            layer=layer), inputs, world_size=1, device=device)
        assert run.graphs is None and run.result["timing"] == "eager" and run.result["check_passed"]


def test_layers_say_whether_a_call_can_be_captured():
    """`ExpertParallelMoE.capturable`: the reference backend never; nccl at EP = 1 (no exchange, no host sync) unless
    the layer's own id check (a host sync, where the backend does not check ids) is on."""
    from weave_moe.layer import ExpertParallelMoE
    from weave_moe.models import MoESpec

    spec = MoESpec(8, 2, 64, 32, name="tiny")
    assert not ExpertParallelMoE(spec, backend="reference", max_tokens_per_rank=16, device="cpu",
                                 check_expert_ids=False).capturable
    assert ExpertParallelMoE(spec, backend="nccl", max_tokens_per_rank=16, device="cpu",
                             check_expert_ids=False).capturable
    assert not ExpertParallelMoE(spec, backend="nccl", max_tokens_per_rank=16, device="cpu").capturable


def test_graph_flag_reaches_the_config_and_the_csv():
    from weave_moe.cli import build_parser
    from weave_moe.commands.bench import build_config

    for argv, graph in ((["--graph"], True), ([], False)):
        args = build_parser().parse_args(["bench", "--model-dims", "8,2,64,32", "--device", "cpu", *argv])
        assert build_config(args, ["weave-moe", "bench"]).graph is graph
    assert "timing" in report.CSV_COLUMNS
