"""Workload counting, the hardware profile, the cost model and the planner (CPU, no timing)."""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from weave_moe.models import MoESpec
from weave_moe.plan import (
    MAX_CHUNKS,
    HardwareProfile,
    Plan,
    Workload,
    physical_floor_us,
    plan,
    plans_serial,
    predict,
)

PROFILE = HardwareProfile.load_named("h200_default")  # uncalibrated docs/platform.md figures: the model's properties
POLICIES = ["serial", "spatial", "static:20", "static:8,4", "per_iteration", "weave"]
SMALL = MoESpec(num_experts=16, top_k=4, hidden_size=2048, intermediate_size=768)


def _brute_force(spec, ids_per_rank, rank):
    """Per-token loops: (send [EP], recv [EP], expert rows [E_local])."""
    world = len(ids_per_rank)
    per_rank = spec.num_experts // world
    send = np.zeros(world, dtype=np.int64)
    recv = np.zeros(world, dtype=np.int64)
    experts = np.zeros(per_rank, dtype=np.int64)
    for source, ids in enumerate(ids_per_rank):
        for token in np.asarray(ids).tolist():
            dests = {e // per_rank for e in token if e >= 0}
            if source == rank:
                for d in dests:
                    send[d] += 1
            if rank in dests:
                recv[source] += 1
            for e in token:
                if e >= 0 and e // per_rank == rank:
                    experts[e - rank * per_rank] += 1
    return send, recv, experts


def _random_ids(rng, tokens, spec, minus_one=0.0):
    ids = np.stack([rng.permutation(spec.num_experts)[: spec.top_k] for _ in range(tokens)]) if tokens else np.zeros(
        (0, spec.top_k), dtype=np.int64)
    if minus_one and tokens:
        ids[rng.random(ids.shape) < minus_one] = -1
    return ids


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    tokens: tuple[int, ...]
    kind: str  # random | zero | all_local | all_remote | one_hot


CASES = [
    Case("random-ep2", 2, (37, 50), "random"),
    Case("random-ep4-odd", 4, (1, 0, 13, 29), "random"),
    Case("zero-tokens", 2, (0, 0), "zero"),
    Case("all-local", 4, (40, 40, 40, 40), "all_local"),
    Case("all-remote", 2, (64, 64), "all_remote"),
    Case("one-hot-expert", 4, (200, 200, 200, 200), "one_hot"),
]


def _case_ids(case: Case, spec=SMALL):
    rng = np.random.default_rng(7)
    per_rank = spec.num_experts // case.world
    ids = []
    for r, t in enumerate(case.tokens):
        if case.kind == "random":
            ids.append(_random_ids(rng, t, spec, minus_one=0.1))
        elif case.kind == "zero":
            ids.append(np.zeros((0, spec.top_k), dtype=np.int64))
        elif case.kind == "all_local":
            ids.append(np.stack([r * per_rank + rng.permutation(per_rank)[: spec.top_k] for _ in range(t)]))
        elif case.kind == "all_remote":
            other = (r + 1) % case.world
            ids.append(np.stack([other * per_rank + rng.permutation(per_rank)[: spec.top_k] for _ in range(t)]))
        else:  # every token picks expert 0 plus random others
            rows = []
            for _ in range(t):
                rest = rng.permutation(np.arange(1, spec.num_experts))[: spec.top_k - 1]
                rows.append(np.concatenate(([0], rest)))
            ids.append(np.stack(rows))
    return ids


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_from_routing_counts_match_brute_force(case):
    ids = _case_ids(case)
    for rank in range(case.world):
        wl = Workload.from_routing(SMALL, ids, rank, chunk_counts=range(1, MAX_CHUNKS + 1))
        send, recv, experts = _brute_force(SMALL, ids, rank)
        assert wl.send_rows.tolist() == send.tolist()
        assert wl.recv_rows.tolist() == recv.tolist()
        assert wl.expert_rows.tolist() == experts.tolist()
        assert wl.num_tokens == case.tokens[rank]
        assert wl.dispatch_send_bytes == (send.sum() - send[rank]) * SMALL.hidden_size * 2
        assert wl.combine_send_bytes == wl.dispatch_recv_bytes
        for k in range(1, MAX_CHUNKS + 1):
            split = wl.chunk_split(k)
            assert split.exact and split.num_chunks == k
            assert split.expert_rows.sum(axis=0).tolist() == experts.tolist()
            assert int(split.send_remote_rows.sum()) == wl.dispatch_send_rows
            assert int(split.recv_remote_rows.sum()) == wl.dispatch_recv_rows
            assert int(split.local_rows.sum()) == wl.local_rows


def test_chunks_follow_token_order():
    """Chunk j of K holds tokens [j*T//K, (j+1)*T//K) of every source (the kernel's convention)."""
    per_rank = SMALL.num_experts // 2
    # rank 0's first half of tokens go to local expert 0, second half to remote expert per_rank
    ids0 = np.array([[0, -1, -1, -1]] * 10 + [[per_rank, -1, -1, -1]] * 10)
    ids1 = np.array([[1, -1, -1, -1]] * 6)
    wl = Workload.from_routing(SMALL, [ids0, ids1], 0, chunk_counts=[2])
    split = wl.chunk_split(2)
    assert split.expert_rows[:, 0].tolist() == [10, 0]
    assert split.expert_rows[:, 1].tolist() == [3, 3]
    assert split.send_remote_rows.tolist() == [0, 10]
    assert split.local_rows.tolist() == [10, 0]


def test_from_routing_accepts_torch_and_rejects_bad_shapes():
    ids = [torch.tensor([[0, 5, 9, 15]], dtype=torch.int32), torch.zeros((0, 4), dtype=torch.int32)]
    wl = Workload.from_routing(SMALL, ids, 1)
    assert wl.recv_rows.tolist() == [1, 0]
    with pytest.raises(ValueError, match="divisible"):
        Workload.from_routing(SMALL, [ids[0]] * 3, 0)
    with pytest.raises(ValueError, match="lie in"):
        Workload.from_routing(SMALL, [np.array([[16, 0, 1, 2]]), ids[1]], 0)


def test_from_counts_matches_from_routing_and_validates():
    ids = _case_ids(CASES[1])
    wl = Workload.from_routing(SMALL, ids, 2)
    again = Workload.from_counts(SMALL, 4, 2, wl.send_rows, wl.recv_rows, wl.expert_rows, num_tokens=wl.num_tokens)
    assert plan(wl, PROFILE) == plan(again, PROFILE)
    with pytest.raises(ValueError, match="must be equal"):
        Workload.from_counts(SMALL, 2, 0, [3, 1], [2, 1], [5] * 8)
    with pytest.raises(ValueError, match="entries"):
        Workload.from_counts(SMALL, 2, 0, [3, 1, 0], [3, 1], [5] * 8)
    with pytest.raises(ValueError, match="sum\\(expert_rows\\)"):
        Workload.from_counts(SMALL, 2, 0, [3, 1], [3, 1], [0] * 8)


def test_profile_round_trip(tmp_path):
    path = tmp_path / "p.json"
    PROFILE.save(path)
    loaded = HardwareProfile.load(path)
    assert loaded == PROFILE
    assert "not calibrated" in PROFILE.source
    assert PROFILE.num_sms == 132
    assert PROFILE.comm_bandwidth_gbps(1) == pytest.approx(17.6)
    assert PROFILE.comm_bandwidth_gbps(1000) == pytest.approx(357)  # clamped at the last point
    with pytest.raises(ValueError, match="unknown"):
        HardwareProfile.from_dict({**PROFILE.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="ascending"):
        HardwareProfile.from_dict({**PROFILE.to_dict(), "comm_sms": [4, 2] + list(PROFILE.comm_sms[2:])})


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("policy", POLICIES)
def test_plans_are_valid_and_above_the_floor(case, policy):
    for rank, wl in enumerate(Workload.from_routing(SMALL, _case_ids(case), r) for r in range(case.world)):
        p = plan(wl, PROFILE, policy)
        assert isinstance(p, Plan) and p.policy == policy
        if policy == "serial" or (policy == "weave" and p.c == PROFILE.num_sms):
            assert (p.c, p.K, p.n_steal) == (PROFILE.num_sms, 1, 0)
            assert p.is_serial(PROFILE.num_sms)
        else:
            assert 1 <= p.c <= PROFILE.num_sms - 1
            assert 1 <= p.K <= MAX_CHUNKS
        assert p.n_steal >= 0
        if policy != "weave":
            assert p.n_steal == 0
        assert np.isfinite(p.predicted_us)
        assert p.predicted_us >= physical_floor_us(wl, PROFILE) - 1e-9


def test_static_policy_is_honoured_and_bad_policies_are_named():
    wl = Workload.from_routing(SMALL, _case_ids(CASES[0]), 0)
    assert (plan(wl, PROFILE, "static:8,4").c, plan(wl, PROFILE, "static:8,4").K) == (8, 4)
    assert plan(wl, PROFILE, "static:20").K == 1
    for bad in ("fast", "static:", "static:0", "static:200", "static:8,9", "static:a,b"):
        with pytest.raises(ValueError, match="serial|must lie"):
            plan(wl, PROFILE, bad)
    with pytest.raises(ValueError, match="weave"):
        plan(wl, PROFILE, "turbo")


def test_weave_is_the_best_candidate_and_never_worse_than_its_restrictions():
    spec = MoESpec.from_name("qwen3-30b-a3b")
    rng = np.random.default_rng(1)
    ids = [_random_ids(rng, 1024, spec) for _ in range(4)]
    wl = Workload.from_routing(spec, ids, 1)
    best = plan(wl, PROFILE, "weave")
    for policy in ("serial", "spatial", "static:20", "static:20,4", "per_iteration"):
        assert best.predicted_us <= plan(wl, PROFILE, policy).predicted_us + 1e-9
    for c in (1, 7, 20, 64, 131):
        for k in (1, 3, 8):
            assert best.predicted_us <= predict(wl, PROFILE, c, k)[0] + 1e-9
    assert predict(wl, PROFILE, best.c, best.K) == pytest.approx((best.predicted_us, best.n_steal))
    serial_wins = Workload.from_routing(MoESpec.from_name("deepseek-v3"), [_random_ids(rng, 256, spec)] * 2, 0)
    assert plan(serial_wins, PROFILE).predicted_us <= plan(serial_wins, PROFILE, "serial").predicted_us


@pytest.mark.parametrize("policy", ["spatial", "weave"])
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3", "phi-3.5-moe"])
def test_more_communication_never_yields_fewer_comm_sms(policy, model):
    """Same GEMM rows and received rows; the rows this rank sends grow: c* must not fall."""
    spec = MoESpec.from_name(model)
    per_rank = spec.num_experts // 4
    recv = [2000, 2000, 2000, 2000]
    expert_rows = np.full(per_rank, 16000 // per_rank, dtype=np.int64)
    previous = 0
    for remote in (0, 500, 1000, 2000, 4000, 8000, 16000, 32000, 64000):
        send = [2000, remote, remote, remote]
        wl = Workload.from_counts(spec, 4, 0, send, recv, expert_rows, num_tokens=max(send))
        c = plan(wl, PROFILE, policy).c
        assert c >= previous, (remote, c, previous)
        previous = c


def test_measured_profile_caps_comm_ctas_and_adds_call_overhead():
    """The default (calibrated) profile: split candidates stop at max_comm_sms; serial stays a candidate; the call
    overhead shifts every prediction by the same amount."""
    measured = HardwareProfile.default()
    spec = MoESpec.from_name("phi-3.5-moe")
    for remote in (0, 2000, 16000, 64000):
        rows = np.full(8, (4000 + remote) * 3 // 16)
        wl = Workload.from_counts(spec, 2, 0, [4000, remote], [4000, remote], rows, num_tokens=max(4000, remote))
        p = plan(wl, measured, "weave")
        assert p.c <= measured.max_comm_sms or p.c == measured.num_sms
    wl = Workload.from_counts(spec, 2, 0, [4000, 4000], [4000, 4000], np.full(8, 1500), num_tokens=4000)
    bare = dataclasses.replace(measured, call_overhead_us=0.0)
    assert plan(wl, measured, "serial").predicted_us == pytest.approx(plan(wl, bare, "serial").predicted_us
                                                                      + measured.call_overhead_us)
    assert plan(wl, measured, "static:20,2").predicted_us == pytest.approx(
        plan(wl, bare, "static:20,2").predicted_us + measured.call_overhead_us)


def test_plans_are_deterministic_across_ranks():
    """Every rank can compute every rank's plan from the same counts and gets the same answer."""
    spec = MoESpec.from_name("deepseek-v2-lite")
    rng = np.random.default_rng(3)
    ids = [_random_ids(rng, 300, spec) for _ in range(4)]
    first = [plan(Workload.from_routing(spec, ids, r), PROFILE) for r in range(4)]
    second = [plan(Workload.from_routing(spec, [torch.from_numpy(i) for i in ids], r), PROFILE)
              for r in range(4)]
    assert first == second


def test_plan_command(capsys):
    from weave_moe.cli import main

    assert main(["plan", "--model", "qwen3-30b-a3b", "--tokens", "64", "--ep", "2", "--skew", "2", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "c=20 us" in out and out.count("%") >= 4
    assert main(["plan", "--model", "qwen3-30b-a3b", "--tokens", "64", "--ep", "2", "--policy", "fast"]) == 2


def test_plan_command_plans_as_the_call_it_names(capsys):
    """`weave-moe plan --call resident` (the default, as the layer's default call) plans as a resident layer's device
    planner does (serial plans priced as the grouped GEMMs) and prints the kernels' time without the host call
    overhead, which was fitted on the host-driven call; `--call host` keeps both."""
    from dataclasses import replace

    from weave_moe.cli import main
    from weave_moe.commands.plan import layer_workloads, profile_for_call

    spec, shipped = MoESpec.from_name("qwen3-30b-a3b"), HardwareProfile.default()   # the calibrated H200 profile
    resident, host = profile_for_call(shipped, "resident"), profile_for_call(shipped, "host")
    assert host == shipped and resident == replace(shipped.with_grouped_serial(), call_overhead_us=0.0)
    wl = layer_workloads(spec, 1, 2)[0]
    assert plan(wl, resident).is_serial(shipped.num_sms)           # what the device planner of the layer picks
    assert not plan(wl, host).is_serial(shipped.num_sms)           # the host-driven call's megakernel tiles
    assert plan(wl, host).predicted_us - plan(wl, resident).predicted_us >= shipped.call_overhead_us * 0.9
    with pytest.raises(ValueError, match="call"):
        profile_for_call(shipped, "eager")
    assert main(["plan", "--model", "qwen3-30b-a3b", "--tokens", "1", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "resident call" in out and "serial (no comm SMs)" in out
    assert main(["plan", "--model", "qwen3-30b-a3b", "--tokens", "1", "--ep", "2", "--call", "host"]) == 0
    assert "host-driven call: us includes" in capsys.readouterr().out


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_per_iteration_plans_every_token_bucket(world_size):
    """The per_iteration policy plans a balanced workload per power-of-two bucket; at 1 token a rank's expected rows
    can round to 0, and its pairs must follow (a ValueError in Workload.from_counts before; found on the GPU by the
    device planner's check at EP=1 with 16 experts, top-2)."""
    from weave_moe.plan.cost_model import _per_iteration_c

    for spec in (MoESpec(16, 2, 4096, 6400), MoESpec.from_name("deepseek-v3")):
        for tokens in (1, 2, 3, 64, 8192):
            c = _per_iteration_c(spec, world_size, tokens, PROFILE)
            assert 1 <= c <= PROFILE.num_sms - 1


def _ep1_layers():
    """Seven models at EP = 1: each model's own experts, and its share at EP 2 / 4 / 8 (where E divides and k fits)."""
    from weave_moe.bench.config import emulated_spec
    from weave_moe.models import PAPER_MODELS

    for name in PAPER_MODELS + ("mixtral-8x7b",):
        for ep in (1, 2, 4, 8):
            try:
                yield name, ep, emulated_spec(MoESpec.from_name(name), ep)
            except ValueError:   # E not divisible by EP, or k > E / EP
                continue


def test_the_planner_plans_serial_at_ep1_with_the_grouped_gemms():
    """KernelConfig.serial_at_ep1 rests on this: with the shipped profile, in a layer whose serial plans run the
    grouped GEMMs (cost_model A8), the adaptive policy plans the serial schedule for every EP = 1 workload here
    (uniform and skewed routing, 1 to 16384 tokens), and `plans_serial`'s balanced sample says so too. A change of
    the cost model or of the profile that makes a split win at EP = 1 fails here: the setting must then be revisited."""
    from weave_moe.routing import skewed, uniform

    profile = HardwareProfile.default().with_grouped_serial()
    plans = 0
    for name, ep, spec in _ep1_layers():
        assert plans_serial(spec, 1, 16384, profile), (name, ep)
        for tokens in (1, 4, 16, 64, 256, 1024, 4096, 16384):
            for ids in (uniform(tokens, spec.num_experts, spec.top_k, seed=tokens)[0],
                        skewed(tokens, spec.num_experts, spec.top_k, skew=4.0, seed=tokens)[0]):
                workload = Workload.from_routing(spec, [ids], 0, chunk_counts=range(1, MAX_CHUNKS + 1))
                chosen = plan(workload, profile, "weave")
                assert chosen.is_serial(profile.num_sms), (name, ep, tokens, chosen)
                plans += 1
    assert plans > 300


def test_plans_serial_is_the_planners_answer_on_its_sample():
    """`plans_serial` is the planner's own answer on balanced routing at 1, 8, 64, ... tokens up to T_max and at
    T_max, not a constant: with the uncalibrated profile (the grouped GEMMs no faster than the megakernel's tiles)
    the planner splits Qwen3-30B-A3B's EP = 1 layer at 1-64 tokens, so `plans_serial` says no."""
    from weave_moe.plan.cost_model import _balanced_workload

    profile = PROFILE.with_grouped_serial()
    spec = MoESpec.from_name("qwen3-30b-a3b")
    for t_max, sample in ((600, (1, 8, 64, 512, 600)), (4096, (1, 8, 64, 512, 4096))):
        expected = all(plan(_balanced_workload(spec, 1, t), profile, "weave").is_serial(profile.num_sms)
                       for t in sample)
        assert plans_serial(spec, 1, t_max, profile) == expected
    assert not plan(_balanced_workload(spec, 1, 64), profile, "weave").is_serial(profile.num_sms)
    assert not plans_serial(spec, 1, 4096, profile)
    # the serial policy is serial everywhere; a static split never is
    assert plans_serial(spec, 1, 4096, profile, "serial")
    assert not plans_serial(spec, 1, 4096, profile, "static:20")
