"""The megakernel simulator: every tile once, every dependency respected, deterministic, never below the floor."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from weave_moe import routing
from weave_moe.models import MoESpec
from weave_moe.plan import MAX_CHUNKS, HardwareProfile, Plan, Workload, physical_floor_us, plan
from weave_moe.sim import KINDS, plot_timeline, simulate

PROFILE = HardwareProfile.load_named("h200_default")  # uncalibrated docs/platform.md figures: the model's properties
GEMM_KINDS = [KINDS.index(k) for k in ("gemm0", "gemm1", "stolen")]


@dataclass(frozen=True)
class Case:
    model: str
    world: int
    tokens: int
    skew: float
    rank: int = 0


CASES = [
    Case("qwen3-30b-a3b", 2, 512, 1.0),
    Case("deepseek-v2-lite", 4, 333, 3.0, rank=3),
    Case("phi-3.5-moe", 4, 256, 4.0, rank=1),
    Case("qwen3-30b-a3b", 2, 0, 1.0),
    Case("qwen3-30b-a3b", 4, 1, 1.0, rank=2),
]

PLANS = [
    Plan(PROFILE.num_sms, 1, 0, 0.0, "serial"),
    Plan(20, 1, 0, 0.0, "static:20"),
    Plan(16, 4, 0, 0.0, "static:16,4"),
    Plan(12, 3, 5, 0.0, "weave"),
    Plan(1, 8, 2, 0.0, "weave"),
    Plan(PROFILE.num_sms - 1, 2, 1000, 0.0, "weave"),
]


def _workload(case: Case) -> Workload:
    spec = MoESpec.from_name(case.model)
    ids = [
        routing.skewed(case.tokens, spec.num_experts, spec.top_k, skew=case.skew, layer=1, seed=r)[0]
        for r in range(case.world)
    ]
    return Workload.from_routing(spec, ids, case.rank, chunk_counts=range(1, MAX_CHUNKS + 1))


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c.model}-ep{c.world}-T{c.tokens}-skew{c.skew}")
def workload(request):
    return _workload(request.param)


@pytest.mark.parametrize("p", PLANS, ids=lambda p: f"{p.policy}-c{p.c}-K{p.K}-s{p.n_steal}")
def test_every_tile_once_and_every_dependency(workload, p):
    result = simulate(workload, PROFILE, p)
    tl = result.timeline
    K = 1 if p.is_serial else p.K
    tiles0, tiles1 = workload.gemm_tiles(K, PROFILE)
    stage = tl.stage
    assert int((stage == 0).sum()) == tiles0 and int((stage == 1).sum()) == tiles1
    assert np.isin(tl.kind[stage >= 0], GEMM_KINDS).all()
    # groups: each (chunk, expert, M block) has exactly n0 GEMM0 and n1 GEMM1 tiles
    n0 = -(-workload.spec.intermediate_size // PROFILE.block_n0)
    n1 = -(-workload.spec.hidden_size // PROFILE.block_n1)
    if tiles0:
        assert np.bincount(tl.group[stage == 0]).tolist() == [n0] * (tiles0 // n0)
        assert np.bincount(tl.group[stage == 1]).tolist() == [n1] * (tiles1 // n1)
        # GEMM1 waits for every GEMM0 tile of its group
        group_done = np.zeros(tiles0 // n0)
        np.maximum.at(group_done, tl.group[stage == 0], tl.end[stage == 0])
        assert (tl.start[stage == 1] >= group_done[tl.group[stage == 1]] - 1e-9).all()
        # GEMM0 waits for its chunk's arrival
        assert (tl.start[stage == 0] >= result.arrival_us[tl.chunk[stage == 0]] - 1e-9).all()
    # combine of chunk j waits for its GEMM1 tiles plus a flag round trip
    combine = (tl.kind == KINDS.index("combine")) & (tl.chunk < K)
    ready = result.chunk_done_us[tl.chunk[combine]] + PROFILE.flag_round_trip_us
    assert (tl.start[combine] >= ready - 1e-9).all()
    # roles: GEMM tiles on comm CTAs are "stolen", at most n_steal each, and only after that CTA's dispatch
    if not p.is_serial:
        on_comm = tl.sm < p.c
        assert not np.isin(tl.kind[on_comm], [KINDS.index("gemm0"), KINDS.index("gemm1")]).any()
        stolen = tl.kind == KINDS.index("stolen")
        assert (np.bincount(tl.sm[stolen], minlength=p.c) <= p.n_steal).all()
        assert not np.isin(tl.kind[~on_comm], [KINDS.index("dispatch"), KINDS.index("stolen")]).any()
    # one task at a time per SM, inside [0, latency]
    for sm in range(PROFILE.num_sms):
        mine = tl.sm == sm
        order = np.argsort(tl.start[mine], kind="stable")
        starts, ends = tl.start[mine][order], tl.end[mine][order]
        assert (starts[1:] >= ends[:-1] - 1e-9).all()
    assert (tl.end <= result.latency_us + 1e-9).all() and (tl.start >= 0).all()
    assert 0.0 <= result.sm_active <= 1.0 and 0.0 <= result.overlap <= 1.0
    assert result.latency_us >= physical_floor_us(workload, PROFILE) - 1e-9


def test_deterministic(workload):
    p = plan(workload, PROFILE)
    a, b = simulate(workload, PROFILE, p), simulate(workload, PROFILE, p)
    assert a.latency_us == b.latency_us
    for name in ("sm", "kind", "start", "end", "chunk", "group", "stage"):
        assert np.array_equal(getattr(a.timeline, name), getattr(b.timeline, name))


def test_model_tracks_simulator():
    """The cost model is a closed form of the simulated schedule: within 5% on a mid-size layer."""
    w = _workload(Case("deepseek-v2-lite", 4, 2048, 3.0, rank=1))
    for policy in ("serial", "spatial", "static:20,4", "weave"):
        p = plan(w, PROFILE, policy)
        assert simulate(w, PROFILE, p).latency_us == pytest.approx(p.predicted_us, rel=0.05)


def test_plot_timeline_writes_png(tmp_path):
    w = _workload(CASES[1])
    result = simulate(w, PROFILE, Plan(12, 3, 5, 0.0, "weave"))
    path = tmp_path / "t.png"
    plot_timeline(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_command(tmp_path, capsys):
    from weave_moe.cli import main

    path = tmp_path / "timeline.png"
    assert main(["simulate", "--model", "deepseek-v2-lite", "--tokens", "128", "--ep", "4", "--rank", "1",
                 "--policy", "static:20,2", "--timeline", str(path)]) == 0
    assert "simulated kernel:" in capsys.readouterr().out and path.exists()
