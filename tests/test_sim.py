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
    K = 1 if p.is_serial(PROFILE.num_sms) else p.K
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
        assert (tl.ready[stage == 1] >= group_done[tl.group[stage == 1]] - 1e-9).all()
        # GEMM0 waits for its chunk's arrival
        assert (tl.ready[stage == 0] >= result.arrival_us[tl.chunk[stage == 0]] - 1e-9).all()
    # combine of chunk j waits for its GEMM1 tiles plus a flag round trip
    combine = (tl.kind == KINDS.index("combine")) & (tl.chunk < K)
    ready = result.chunk_done_us[tl.chunk[combine]] + PROFILE.flag_round_trip_us
    assert (tl.ready[combine] >= ready - 1e-9).all()
    # roles: GEMM tiles on comm CTAs are "stolen", at most n_steal each, and only after that CTA's dispatch
    if not p.is_serial(PROFILE.num_sms):
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
    for name in ("sm", "kind", "start", "ready", "end", "chunk", "group", "stage"):
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


# ---- utilisation: one definition for simulated and measured timelines (docs/utilisation.md) ----------------------

def _worked_example_events():
    """The worked example of docs/utilisation.md, as the kernel records it: (cta, kind, start_ns, end_ns, ready_ns)."""
    us = 1000
    return [(0, "dispatch", 0, 2 * us, 0), (0, "combine", 2 * us, 10 * us, 7 * us),
            (1, "gemm0", 0, 6 * us, 1 * us), (1, "spin", 6 * us, 6500, 6500), (1, "gemm1", 6500, 8 * us, 6500)]


def test_utilisation_worked_example():
    from weave_moe.sim import measured_result

    u = measured_result(_worked_example_events(), 2, plan=None).utilisation
    assert u.span_us == pytest.approx(10.0)
    assert u.sm_active == pytest.approx(11.5 / 20)            # work: 2 + 3 + 5 + 1.5 SM-us of 2 SMs x 10 us
    assert u.waiting == pytest.approx(6.0 / 20)               # combine 2-7, gemm0 0-1
    assert u.spin == pytest.approx(0.5 / 20) and u.idle == pytest.approx(2.0 / 20)
    assert u.gemm_active == pytest.approx(6.5 / 20) and u.comm_active == pytest.approx(5.0 / 20)
    assert u.overlap == pytest.approx(2.0 / 10)               # comm work [0,2) [7,10) meets GEMM work [1,6) [6.5,8)
    # the same events without their ready stamps (the old recording) count waits as work
    old = measured_result([e[:4] for e in _worked_example_events() if e[1] != "spin"], 2, plan=None).utilisation
    assert old.sm_active == pytest.approx(17.5 / 20) and old.overlap == pytest.approx(7.5 / 10)


def test_events_from_buffer_splits_wait_work_spin_and_launches():
    from weave_moe.sim import events_from_buffer

    names = ("dispatch", "gemm0", "gemm1", "combine", "reduce", "stolen_gemm0", "stolen_gemm1")
    t = 10**12  # %globaltimer is absolute
    buffer = np.zeros((2, 8, 4), dtype=np.int64)
    buffer[0, 0] = (0, t, t + 500, t)                    # dispatch, no wait
    buffer[0, 1] = (3, t + 700, t + 2000, t + 1500)      # combine: 200 ns spin before it, waits 800 ns
    buffer[0, 4] = (4, t + 5000, t + 5100, t + 4990)     # reduce in a later launch (staged): ready clamped to start
    buffer[1, 0] = (1, t + 100, t + 900, 0)              # an old four-field row: ready = start
    events = events_from_buffer(buffer, names)
    assert [tuple(e) for e in events] == [
        (0, "dispatch", 0, 500, 0), (0, "spin", 500, 700, 700), (0, "combine", 700, 2000, 1500),
        (0, "reduce", 5000, 5100, 5000), (1, "gemm0", 100, 900, 100)]
    assert events_from_buffer(np.zeros((2, 8, 4), dtype=np.int64), names) == []
    with pytest.raises(ValueError, match="MAX_EVENTS, 4"):
        events_from_buffer(np.zeros((2, 8, 3), dtype=np.int64), names)


def test_simulator_records_waits_like_the_kernel():
    """A static split with one chunk: comm CTAs claim a combine block after dispatch and wait for GEMM1 in it."""
    from weave_moe.sim import utilisation

    w = _workload(Case("qwen3-30b-a3b", 2, 512, 1.0))
    result = simulate(w, PROFILE, Plan(20, 1, 0, 0.0, "static:20"))
    tl = result.timeline
    assert result.utilisation == utilisation(tl)              # the one definition
    combine_on_comm = (tl.kind == KINDS.index("combine")) & (tl.sm < 20) & (tl.chunk == 0)
    assert (tl.ready[combine_on_comm] - tl.start[combine_on_comm]).min() > 0
    u = result.utilisation
    assert u.sm_active + u.waiting + u.spin + u.idle == pytest.approx(1.0)
    assert u.waiting > 0.05 and u.overlap == 0.0              # K = 1: nothing to overlap


def test_plot_legend_lists_what_is_drawn_and_the_role_line(tmp_path):
    from weave_moe.sim.timeline import role_line

    w = _workload(CASES[0])
    serial = simulate(w, PROFILE, Plan(PROFILE.num_sms, 1, 0, 0.0, "serial"))
    labels = plot_timeline(serial, tmp_path / "serial.png")
    assert {"dispatch", "gemm0", "gemm1", "combine"} <= set(labels)
    assert not any(label.startswith("stolen") for label in labels)       # nothing stolen in a serial schedule
    split = simulate(w, PROFILE, Plan(20, 1, 0, 0.0, "static:20"))
    labels = plot_timeline(split, tmp_path / "split.png", width_px=400)
    assert "combine waiting" in labels and not any(label.startswith("stolen") for label in labels)
    assert role_line(PROFILE.num_sms, PROFILE.num_sms)[0] is None and "serial" in role_line(132, 132)[1]
    assert role_line(20, 132) == (19.5, "SM (CTA index); the 20 comm CTAs above the line")


def test_plan_and_simulate_name_the_serial_schedule(capsys):
    from weave_moe.cli import main

    assert main(["simulate", "--model", "deepseek-v2-lite", "--tokens", "64", "--ep", "2", "--policy", "serial"]) == 0
    assert "serial (no comm SMs)" in capsys.readouterr().out
    assert main(["plan", "--model", "deepseek-v2-lite", "--tokens", "64", "--ep", "2", "--policy", "serial"]) == 0
    assert "serial (no comm SMs)" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["serial", "static:20", "weave"])
def test_kernel_timeline_splits_wait_and_work_on_gpu(policy):
    """On one GPU (EP=1): the timeline build of the kernel computes the same layer, and every event it records reads
    claim <= dependency met <= done; its figures add up (docs/utilisation.md)."""
    import torch

    from weave_moe.layer import ExpertParallelMoE
    from weave_moe.reference import assert_moe_close, reference_moe
    from weave_moe.sim import measured_result
    from weave_moe.testing import make_experts

    device = torch.device("cuda", 0)
    spec = MoESpec(num_experts=8, top_k=2, hidden_size=512, intermediate_size=256)
    ids, weights = routing.uniform(300, spec.num_experts, spec.top_k, seed=3)
    ids, weights = ids.to(device), weights.to(device)
    x = torch.randn(300, spec.hidden_size, device=device).to(torch.bfloat16)
    w13, w2 = make_experts(spec, spec.num_experts, seed=1, device=device)
    layer = ExpertParallelMoE(spec, backend="weave", policy=policy, device=device, max_tokens_per_rank=300,
                              timeline=True)
    layer.load_experts(w13, w2)
    for _ in range(2):
        out = layer(x, ids, weights)
    layer.backend.synchronize()
    assert_moe_close(out, reference_moe(x, ids, weights, w13, w2))
    events = layer.backend.last_timeline()
    assert all(e.start_ns <= e.ready_ns <= e.end_ns for e in events)
    kinds = {e.kind for e in events}
    assert {"dispatch", "combine", "reduce"} <= kinds and kinds & {"gemm0", "stolen_gemm0"}
    u = measured_result(events, layer.backend.num_sms, layer.backend.last_plan).utilisation
    assert 0 < u.sm_active <= 1 and u.sm_active + u.waiting + u.spin + u.idle == pytest.approx(1.0)
