"""Workloads for the device planner's parity checks, and the comparison with the Python planner.

Shared by tests/test_device_planner.py (CPU: mirror and interpreter) and scripts/device_planner_check.py (GPU), so
both draw the same random and adversarial counts vectors and judge them by the same rule. No pytest import: the GPU
script runs without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weave_moe.backends.weave.kernels.planner import DevicePlanner
from weave_moe.models import PAPER_MODELS, MoESpec
from weave_moe.plan import HardwareProfile, Workload, plan, predict

#: Relative latency gap (float64 re-evaluation) allowed when the device's choice differs: the issue's 0.5 %.
CHOICE_TOLERANCE = 5e-3
#: Relative gap between the device's fp32 predicted_us and the float64 value of the same plan. ~30 fp32 operations
#: of relative error 6e-8 each would give ~2e-6, but formula (8) subtracts the stolen work from the whole GEMM work,
#: (W - c * s * tbar), and with few compute CTAs (N - c = 1, s ~ 100) that difference cancels ~100x: the worst seen
#: in the 10^4 run is 1.3e-5 (c = 131, n_steal = 110).
PREDICTION_TOLERANCE = 1e-4


def small_profile() -> HardwareProfile:
    """An odd, small GPU: N = 20 SMs, no cap on c (c ranges to N - 1), a fast flag, different tile shape."""
    return HardwareProfile(name="odd-20", source="test", num_sms=20, comm_sms=[1, 3, 7, 19], comm_gbps=[9, 25, 50, 61],
                           local_sms=[1, 5, 20], local_gbps=[30, 140, 400], gemm_sms=[1, 11, 20],
                           gemm_tflops=[4.0, 40.0, 66.0], gemm_tile_efficiency=0.7, block_m=64, block_n0=64,
                           block_n1=96, launch_us=3.0, flag_round_trip_us=0.7, role_switch_us=0.4,
                           per_tile_overhead_us=0.3, call_overhead_us=0.0)


PROFILES = {"h200_measured": HardwareProfile.default, "h200_default": lambda: HardwareProfile.load_named("h200_default"),
            "odd20": small_profile,
            # a layer whose serial plans run the grouped GEMMs (formula (13) scaled, cost_model A8)
            "h200_grouped_serial": lambda: HardwareProfile.default().with_grouped_serial()}
ODD_SPECS = [MoESpec(6, 2, 72, 40), MoESpec(12, 3, 1000, 300), MoESpec(60, 4, 2048, 1408), MoESpec(7, 7, 136, 520),
             MoESpec(40, 1, 4096, 96)]
KINDS = ("uniform", "skewed", "empty_ranks", "tiny", "hot_expert", "huge", "all_zero", "decode")


@dataclass(frozen=True)
class Group:
    """Counts vectors [B, EP + EP^2 + E] of one (spec, EP, profile, policy)."""

    spec: MoESpec
    world_size: int
    profile_name: str
    policy: str
    counts: np.ndarray


def random_counts(spec: MoESpec, world_size: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """One counts vector (exchange.CountsFormat's first EP + EP^2 + E words) that Workload.from_counts accepts."""
    ep, num_local = world_size, spec.num_experts // world_size
    max_tokens = {"tiny": 2, "decode": 64, "huge": 32768}.get(kind, int(rng.choice([16, 256, 2048, 8192])))
    if kind == "all_zero":
        tokens = np.zeros(ep, dtype=np.int64)
    elif kind == "tiny":
        tokens = rng.integers(0, 2, ep)
    else:
        tokens = rng.integers(0, max_tokens + 1, ep)
    if kind == "empty_ranks":
        tokens[rng.random(ep) < 0.5] = 0
    # rank s sends to rank d a share of its tokens: uniform routing hits most ranks, skewed routing few
    share = rng.random((ep, ep)) if kind != "skewed" else rng.random((ep, ep)) ** 4
    if kind == "hot_expert":
        share[:] = 0.05
        share[:, rng.integers(ep)] = 1.0
    send = rng.binomial(tokens[:, None], np.clip(share, 0, 1))
    recv = send.sum(axis=0)
    pairs = np.zeros((ep, num_local), dtype=np.int64)
    for d in range(ep):
        high = min(spec.top_k, num_local) * recv[d]
        total = int(rng.integers(recv[d], high + 1)) if high > recv[d] else int(recv[d])
        if kind == "hot_expert":
            weights = np.full(num_local, 0.01 / num_local)
            weights[rng.integers(num_local)] = 1.0
        elif kind == "skewed":
            weights = rng.dirichlet(np.full(num_local, 0.2))
        else:
            weights = np.ones(num_local)
        pairs[d] = rng.multinomial(total, weights / weights.sum())
    return np.concatenate([tokens, send.ravel(), pairs.ravel()]).astype(np.int64)


def make_groups(num_vectors: int, seed: int, num_groups: int | None = None) -> list[Group]:
    """At least `num_vectors` counts vectors over shapes, EP sizes, kinds, profiles and policies (weave most often),
    in every (shape, EP, profile) group, or in `num_groups` of them drawn at random."""
    rng = np.random.default_rng(seed)
    specs = [MoESpec.from_name(name) for name in PAPER_MODELS] + ODD_SPECS
    combos = [(spec, ep, profile_name) for spec in specs for ep in range(1, 9) if spec.num_experts % ep == 0
              for profile_name in PROFILES]
    if num_groups is not None:
        combos = [combos[i] for i in sorted(rng.choice(len(combos), min(num_groups, len(combos)), replace=False))]
    # static:100 lies above the calibrated profile's cap on c (48): the cap binds the searching policies only
    policies = ["weave"] * 6 + ["spatial", "static:20,2", "static:3,8", "static:100,3", "per_iteration", "serial"]
    per_group = -(-num_vectors // len(combos))
    groups = []
    for spec, ep, profile_name in combos:
        policy = str(rng.choice(policies))
        if policy.startswith(("static:20", "static:100")) and profile_name == "odd20":
            policy = "static:19,1"
        kinds = rng.choice(KINDS, per_group)
        counts = np.stack([random_counts(spec, ep, str(kind), rng) for kind in kinds])
        groups.append(Group(spec, ep, profile_name, policy, counts))
    return groups


def python_plans(group: Group, profile: HardwareProfile, vector: np.ndarray):
    """(workloads, plans) of every rank of one counts vector, by the host path (`Workload.from_counts` + `plan`)."""
    ep, num_local = group.world_size, group.spec.num_experts // group.world_size
    send = vector[ep:ep + ep * ep].reshape(ep, ep)
    pairs = vector[ep + ep * ep:].reshape(ep, num_local)
    workloads = [Workload.from_counts(group.spec, ep, d, send[d], send[:, d], pairs[d], num_tokens=int(vector[d]))
                 for d in range(ep)]
    return workloads, [plan(w, profile, group.policy) for w in workloads]


def compare(groups: list[Group], device_rows: list[np.ndarray]) -> dict:
    """Parity statistics of device outputs ([B, EP, 4] per group) against the Python planner."""
    stats = dict(vectors=0, rank_plans=0, exact=0, same_c_k=0, within_tolerance=0, failures=[],
                 worst_gap=0.0, worst_case=None, worst_prediction_error=0.0)
    for group, rows in zip(groups, device_rows):
        profile = PROFILES[group.profile_name]()
        planner = DevicePlanner(group.spec, group.world_size, profile, group.policy)
        N = profile.num_sms
        for vector, device in zip(group.counts, rows):
            stats["vectors"] += 1
            workloads, plans = python_plans(group, profile, vector)
            for workload, host, mine in zip(workloads, plans, planner.decode(device)):
                stats["rank_plans"] += 1
                again = predict(workload, profile, mine.c, mine.K, n_steal=None if mine.c == N else mine.n_steal)[0]
                error = abs(mine.predicted_us - again) / max(again, 1e-9)
                stats["worst_prediction_error"] = max(stats["worst_prediction_error"], error)
                if (mine.c, mine.K, mine.n_steal) == (host.c, host.K, host.n_steal):
                    stats["exact"] += 1
                    continue
                stats["same_c_k"] += (mine.c, mine.K) == (host.c, host.K)
                gap = (again - host.predicted_us) / host.predicted_us
                case = dict(spec=group.spec.name, ep=group.world_size, profile=group.profile_name,
                            policy=group.policy, counts=vector.tolist(), rank=workload.rank, host=host.__dict__,
                            device=mine.__dict__, reevaluated_us=again, gap=gap)
                if gap > stats["worst_gap"]:
                    stats["worst_gap"], stats["worst_case"] = gap, case
                if gap <= CHOICE_TOLERANCE:
                    stats["within_tolerance"] += 1
                else:
                    stats["failures"].append(case)
    return stats
