"""The benchmark harness: floor arithmetic by hand, result files of a tiny end-to-end run, failures recorded.

Tests never judge times; the end-to-end run checks that the files and columns exist and that the check passes.
"""

import csv
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from weave_moe.bench import report
from weave_moe.bench.floor import FloorConstants, layer_floor, rank_traffic
from weave_moe.bench.harness import parse_variant
from weave_moe.commands.bench import _split_variants, parse_models

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


def test_weights_bound_by_hand():
    # Experts hit: rank 0 {0, 1} (both), rank 1 {2, 3} (both); a third layout leaves expert 1 unused.
    traffic = rank_traffic([np.array(IDS_RANK0), np.array(IDS_RANK1)], num_experts=4)
    assert traffic.experts_hit.tolist() == [2, 2]
    # 3 * H * I * 2 B = 300 B per expert; 1e-7 GB/s = 100 B/s -> 6 s per rank; not part of the floor.
    floor = layer_floor(traffic, HIDDEN, INTERMEDIATE, FloorConstants(gemm_tflops=1e-9, peer_gbps=1e-7, hbm_gbps=1e-7))
    assert floor.weights_s == pytest.approx([6.0, 6.0]) and floor.weights_floor_s == pytest.approx(6.0)
    assert floor.floor_s == pytest.approx(1.5)
    sparse = rank_traffic([np.array([[0, 2], [0, -1]]), np.array([[3, 0]])], num_experts=4)
    assert sparse.experts_hit.tolist() == [1, 2]
    # ids outside [0, E) are not experts (the layer rejects them; the floor must not crash on -1 padding)
    assert rank_traffic([np.array([[-1, -1]])], num_experts=4).experts_hit.tolist() == [0]


def test_single_rank_has_no_nvlink_bytes():
    traffic = rank_traffic([np.array(IDS_RANK0)], num_experts=4)
    floor = layer_floor(traffic, HIDDEN, INTERMEDIATE, FloorConstants(gemm_tflops=1e-9, peer_gbps=1.0))
    assert floor.bytes_sent == [0.0] and floor.floor_s == pytest.approx(5 * 300 / 1000)


def test_floor_constants_from_profile():
    assert FloorConstants.from_profile(SimpleNamespace()) == FloorConstants()
    constants = FloorConstants.from_profile(SimpleNamespace(name="h200", gemm_peak_tflops=650.0))
    assert (constants.gemm_tflops, constants.peer_gbps) == (650.0, FloorConstants().peer_gbps)
    assert "profile h200" in constants.source
    with pytest.raises(ValueError):
        FloorConstants(gemm_tflops=0.0)


def test_floor_constants_take_the_peak_of_a_profile_curve():
    profile = SimpleNamespace(name="curves", gemm_tflops=(100.0, 700.0, 650.0), comm_gbps=(20.0, 350.0))
    constants = FloorConstants.from_profile(profile)
    assert (constants.gemm_tflops, constants.peer_gbps) == (700.0, 350.0)


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
    assert parse_variant("nccl") == parse_variant("nccl")
    assert (parse_variant("nccl").backend, parse_variant("nccl").policy) == ("nccl", None)
    assert parse_variant("weave").policy == "weave"
    assert parse_variant("weave:static:20").policy == "static:20"
    assert _split_variants("nccl,weave:static:20,4,weave") == ["nccl", "weave:static:20,4", "weave"]


def test_model_arguments():
    specs = parse_models(None, [])
    assert [s.name for s in specs][:2] == ["deepseek-v3", "phi-3.5-moe"] and len(specs) == 6
    (custom,) = parse_models(None, ["8,2,64,32"])
    assert (custom.num_experts, custom.top_k, custom.hidden_size, custom.intermediate_size) == (8, 2, 64, 32)
    with pytest.raises(ValueError):
        parse_models(None, ["8,2,64"])


def _row(model, tokens, routing, variant, median_ms, error=""):
    return dict(model=model, tokens_per_rank=tokens, routing=routing, variant=variant, median_ms=median_ms,
                error=error, floor_ms=0.5, x_floor=median_ms / 0.5 if median_ms else None, check_passed=None)


def test_speedups_and_geomean():
    rows = [_row("m", 1, "uniform", "nccl", 2.0), _row("m", 1, "uniform", "weave", 1.0),
            _row("m", 2, "uniform", "nccl", 8.0), _row("m", 2, "uniform", "weave", 1.0),
            _row("m", 2, "skewed", "weave", None, error="boom")]
    report.add_speedups(rows)
    assert [r["speedup_vs_nccl"] for r in rows] == [1.0, 2.0, 1.0, 8.0, None]
    (nccl, weave) = report.summary(rows)
    assert weave["speedup"] == pytest.approx(4.0) and weave["failed"] == 1
    assert report.geomean([None, 0.0, math.inf]) is None
    text = report.markdown(rows, {"name": "t"})
    assert "**geomean**" in text and "**4.00**" in text and "boom" in text


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny end-to-end run on 2 gloo ranks: nccl (must pass the check) and a backend that does not exist."""
    from weave_moe.cli import main

    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--model-dims", "8,2,64,32", "--tokens", "16,24", "--routing", "uniform,skewed",
                 "--variants", "nccl,no-such-backend", "--iters", "3", "--warmup", "1", "--rotate", "2", "--check",
                 "--device", "cpu", "--nproc", "2", "--name", "tiny", "--out", str(out), "--no-progress",
                 "--timeout", "120", "--attention"])
    return code, report.result_paths(str(out), "tiny")


def test_tiny_run_writes_every_file(tiny_run):
    code, paths = tiny_run
    assert code == 0
    for key in ("json", "csv", "md", "latency_png", "speedup_png"):
        with open(paths[key], "rb") as handle:
            assert len(handle.read()) > 100, key
    with open(paths["json"]) as handle:
        data = json.load(handle)
    metadata = data["metadata"]
    assert metadata["world_size"] == 2 and metadata["device"] == "cpu" and not metadata["partial"]
    assert metadata["command"].startswith("weave-moe bench") and "--model-dims 8,2,64,32" in metadata["command"]
    assert metadata["git_commit"]
    assert metadata["floor_constants"]["gemm_tflops"] > 0
    assert len(data["rows"]) == 2 * 2 * 2  # tokens x routing x variants


def test_tiny_run_csv_columns_and_check(tiny_run):
    _, paths = tiny_run
    with open(paths["csv"]) as handle:
        rows = list(csv.DictReader(handle))
    required = ["model", "tokens_per_rank", "routing", "backend", "policy", "median_ms", "p10_ms", "p90_ms", "tflops",
                "nvlink_gbps", "floor_ms", "pct_of_floor", "c", "K", "n_steal", "rel_error", "check_passed"]
    assert set(required) <= set(rows[0])
    nccl = [r for r in rows if r["variant"] == "nccl"]
    assert len(nccl) == 4
    for row in nccl:
        assert row["check_passed"] == "True" and float(row["rel_error"]) <= 1e-2, row
        assert float(row["median_ms"]) > 0 and float(row["floor_ms"]) > 0 and float(row["tflops"]) > 0
        assert float(row["p10_ms"]) <= float(row["median_ms"]) <= float(row["p90_ms"])
        assert row["error"] == ""


def test_tiny_run_records_a_failing_variant(tiny_run):
    _, paths = tiny_run
    with open(paths["csv"]) as handle:
        failed = [r for r in csv.DictReader(handle) if r["variant"] == "no-such-backend"]
    assert len(failed) == 4
    for row in failed:
        assert "no-such-backend" in row["error"] and row["median_ms"] == "" and row["check_passed"] == ""
    with open(paths["md"]) as handle:
        assert "## Errors" in handle.read()


def test_replot_rewrites_from_json(tiny_run, tmp_path):
    import shutil

    from weave_moe.cli import main

    _, paths = tiny_run
    copy = tmp_path / "again.json"
    shutil.copy(paths["json"], copy)
    assert main(["bench", "--replot", str(copy)]) == 0
    for suffix in (".csv", ".md", "_latency.png", "_speedup.png"):
        assert (tmp_path / f"again{suffix}").stat().st_size > 100


def test_tiny_run_end_to_end_estimate(tiny_run):
    _, paths = tiny_run
    with open(paths["e2e_csv"]) as handle:
        rows = list(csv.DictReader(handle))
    assert [r["variant"] for r in rows] == ["nccl"] * 4  # the failing variant has no estimate
    for row in rows:
        assert float(row["e2e_ms"]) == pytest.approx(float(row["attention_ms"]) + float(row["shared_ms"])
                                                     + float(row["moe_ms"]), rel=1e-4)
        assert float(row["e2e_speedup_vs_nccl"]) == 1.0
    with open(paths["md"]) as handle:
        assert "End-to-end estimate" in handle.read()


def test_e2e_rows_arithmetic():
    rows = [_row("m", 8, "uniform", "nccl", 3.0), _row("m", 8, "uniform", "weave", 1.0)]
    attention = [dict(model="m", tokens_per_rank=8, attention_ms=0.5, shared_ms=0.5, attention={})]
    nccl, weave = report.e2e_rows(rows, attention)
    assert (nccl["e2e_ms"], weave["e2e_ms"]) == (4.0, 2.0)
    assert weave["e2e_speedup_vs_nccl"] == 2.0 and weave["moe_speedup_vs_nccl"] == 3.0
    assert weave["moe_share"] == 0.5


@pytest.mark.parametrize("kind", ["gqa", "gqa-gated", "mla", "mla-lora"])
def test_attention_blocks_run_on_cpu(kind):
    from weave_moe.bench.attention import AttentionSpec, time_attention, time_shared_experts
    from weave_moe.models import MoESpec

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

    class Backend:
        last_plan = None

    class Layer:  # a backend whose plan depends on the input, as the weave backend's does
        backend = Backend()

        def __call__(self, x, ids, weights):
            self.backend.last_plan = SimpleNamespace(c=x, K=2, n_steal=3, predicted_us=10.0 * x, policy="weave")

    plans = _warm_up(Layer(), [(20, None, None), (24, None, None), (28, None, None)], warmup=1)  # fewer warm-up calls than sets: every set still seen
    assert [p["c"] for p in plans] == [20, 24, 28] and plans[1]["predicted_us"] == 240.0
    assert _gather_plans(plans, 1)[2] == [plans[2]]

    class NoPlans:
        def __call__(self, *inputs):
            pass

    assert _warm_up(NoPlans(), [(1,), (2,)], warmup=3) == [None, None]


def test_merge_two_runs(tiny_run, tmp_path):
    from weave_moe.cli import main

    _, paths = tiny_run
    assert main(["bench", "--merge", paths["json"], paths["json"], "--name", "both", "--out", str(tmp_path)]) == 0
    metadata, rows = report.load(str(tmp_path / "both.json"))
    assert len(rows) == 16 and len(metadata["merged_from"]) == 2
    assert (tmp_path / "both_latency.png").stat().st_size > 100
