"""The cost model and the planner: predicted latency of one rank's layer for each (c, K), and the best plan.

Shape legend: N = SMs (CTAs), c = comm CTAs, K = chunks, s = n_steal (GEMM tiles each comm CTA steals).

The paper's equations (13)-(14) did not survive, so this model is our own. It is a closed form per candidate, evaluated
for all c in 1..N-1 and K in 1..MAX_CHUNKS at once with numpy (about a thousand candidates in tens of microseconds).

Inputs (per rank, from `Workload`; B = 2H bytes per row):
    R  = max(remote rows sent, remote rows received) in dispatch (= in combine, transposed)
    L  = local rows (own tokens with a local expert), P = GEMM rows (pairs), Q = rows the final reduce reads,
    T  = own tokens, n0(K), n1(K) = GEMM0 / GEMM1 tiles with K chunks (partial M tiles padded to full ones).
From `HardwareProfile`: bw(x) NVLink bytes/us with x CTAs, lbw(x) local copy bytes/us, rate(x) GEMM FLOP/us per SM
when x SMs run GEMM tiles, f = flag round trip, sigma = role switch, o = per-tile overhead, launch.

Formulas (times in us from kernel start, after `launch`):
    D    = R*B / bw(c) + L*B / lbw(c)                   dispatch on the c comm CTAs                       (1)
    C(x) = R*B / bw(x) + (P + L)*B / lbw(x)             combine work if x CTAs did all of it              (2)
    Z    = (Q + T)*B / lbw(N)                           final reduce on all N SMs                         (3)
    t0   = 2*BM*2*BN0*H / rate(N-c) + o,  t1 = 2*BM*BN1*I / rate(N-c) + o   GEMM tile times             (4)
    W    = n0(K)*t0 + n1(K)*t1,  tbar = W / (n0 + n1)   GEMM work in SM-us, mean tile                      (5)
    a_j  = D*(j+1)/K + f                                arrival of chunk j (dispatch runs in chunk order)  (6)
    s    = floor(max(0, a_0 + W/((N-c)K) + tau - D - sigma) / (tbar * (1 + c/((N-c)K))))                   (7)
           (the comm CTAs' stolen tiles end when chunk 0's GEMMs do: D + sigma + s*tbar = E_0 solved for s)
    g    = (W - c*s*tbar) / ((N-c)*K)                   GEMM time per chunk on the compute CTAs            (8)
    E_0  = a_0 + g + tau,  E_last = max(a_0 + K*g, a_{K-1} + g) + tau    chunk GEMMs done                  (9)
    Fc   = max(D + [s>0]*(sigma + s*tbar) + C(c),  E_0 + f + C(c),  E_last + f + C(c)/K)                   (10)
    F    = E_last + f + (Fc - E_last - f) * C(N)/C(c)   after E_last every CTA joins combine               (11)
    latency = launch + F + f + Z                                                                           (12)
    serial (c = N, K = 1): launch + D(N) + f + sigma + rho*(W(N)/N + tau) + f + C(N) + f + Z             (13)
with tau = t1 (the last tile of a chunk finishes about one tile after the chunk's mean finish).

Assumptions (each a simplification the simulator does not share, so `sim` can check them):
    A1 NVLink is full duplex and peers run the same c, so the rank's dispatch time is set by the larger of what it
       sends and what it receives; its peers' plans are not consulted (each rank plans alone, as in the kernel).
    A2 The comm CTAs do remote writes and local copies one after another (same CTAs, summed times).
    A3 Combine reads every GEMM row once (y, at local bandwidth) and writes one row per received token; the remote
       part costs like dispatch.
    A4 GEMM tiles are spread evenly over the compute CTAs (dynamic claiming): continuous work W / (N - c) per chunk,
       plus one tile `tau` for the tail and dependency waits; the chunk pipeline is limited either by arrivals
       (a_j + g) or by compute (a_0 + (j+1)g), a max of two lines, so every max over chunks has a closed form.
    A5 GEMM throughput per SM is the profile's at N - c SMs; stolen tiles run at the same per-SM rate.
    A6 Combine of chunk j starts after its GEMMs plus one flag round trip; once the GEMM queue is empty all N CTAs
       share the remaining combine (at C(N), not the c-CTA rate).
    A7 Metadata (ids, weights, flags) is ignored next to rows of H >= 2048 bf16.
    A8 The serial schedule's GEMM time is the megakernel tiles' (rho = 1) or, where the layer runs a serial plan's
       GEMMs as the grouped GEMMs, that times the profile's measured `grouped_gemm_time_ratio` (rho,
       `HardwareProfile.with_grouped_serial`); the split schedules always run the megakernel's tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from weave_moe.models import MoESpec
from weave_moe.plan.profile import HardwareProfile
from weave_moe.plan.workload import MAX_CHUNKS, Workload, even_split

__all__ = ["Plan", "plan", "predict", "predict_grid", "physical_floor_us", "plans_serial", "POLICIES",
           "STATIC_BASELINE_C", "parse_policy"]

#: Policy names `plan()` accepts ("static" takes ":<c>[,<K>]").
POLICIES = ("serial", "spatial", "static:<c>[,<K>]", "per_iteration", "weave")

#: The static split the paper compares with (DeepEP's default 20 comm SMs).
STATIC_BASELINE_C = 20


@dataclass(frozen=True)
class Plan:
    """One rank's schedule for one layer.

    Attributes:
        c: comm CTAs (CTA index < c), in [1, N-1]; c = N means `serial` (all CTAs do every phase in turn).
        K: chunks, in 1..MAX_CHUNKS.
        n_steal: GEMM tiles each comm CTA claims right after dispatch (0 = no stealing).
        predicted_us: the cost model's latency for this plan.
        policy: the policy string that produced it.
    """

    c: int
    K: int
    n_steal: int
    predicted_us: float
    policy: str

    def is_serial(self, num_sms: int) -> bool:
        """The serial schedule on a grid of `num_sms` CTAs (every CTA runs dispatch, GEMMs and combine in turn):
        policy "serial", or a plan with c >= N (the planner found no split faster). The one test of it."""
        return self.policy == "serial" or self.c >= num_sms


def parse_policy(policy: str) -> tuple[str, tuple[int, ...]]:
    """("static", (c, K)) for "static:<c>[,<K>]", (name, ()) for the others; ValueError naming the valid ones."""
    if not isinstance(policy, str):
        raise ValueError(f"policy must be a string, one of {', '.join(POLICIES)}; got {policy!r}")
    if policy in ("serial", "spatial", "per_iteration", "weave"):
        return policy, ()
    if policy.startswith("static:"):
        try:
            values = tuple(int(v) for v in policy[len("static:"):].split(","))
        except ValueError:
            values = ()
        if len(values) in (1, 2):
            return "static", values if len(values) == 2 else (values[0], 1)
    raise ValueError(f"unknown policy {policy!r}; valid policies: {', '.join(POLICIES)}")


# ---- the model ------------------------------------------------------------------------------------------------------
def _inputs(workload: Workload, profile: HardwareProfile) -> dict:
    """Per-(workload, profile) scalars and [MAX_CHUNKS, 1] tile counts; cached on the workload."""
    key = ("model_inputs", id(profile))
    cached = workload._cache.get(key)
    if cached is not None and cached["profile"] is profile:
        return cached
    spec, row, N = workload.spec, float(workload.row_bytes), profile.num_sms
    m_tiles = workload.m_tiles(profile.block_m)
    n0 = m_tiles * float(-(-spec.intermediate_size // profile.block_n0))
    n1 = m_tiles * float(-(-spec.hidden_size // profile.block_n1))
    tiles = n0 + n1
    local = workload.local_rows * row
    remote = max(workload.dispatch_send_rows, workload.dispatch_recv_rows) * row
    pairs = workload.num_pairs * row
    flops0 = float(profile.gemm0_tile_flops(spec.hidden_size))
    flops1 = float(profile.gemm1_tile_flops(spec.intermediate_size))
    inv_lbw_all = 1.0 / profile.local_bytes_per_us[N]
    values = {
        "profile": profile,
        "remote_bytes": remote,
        "local_bytes": local,
        "combine_local_bytes": pairs + local,
        "combine_extra_bytes": pairs,
        "combine_all_us": remote / profile.comm_bytes_per_us[N] + (pairs + local) * inv_lbw_all,
        "reduce_us": (workload.reduce_rows + workload.num_tokens) * row * inv_lbw_all,
        "n0": n0[:, None],
        "n1": n1[:, None],
        "tiles": tiles[:, None],
        "inv_tiles": (1.0 / np.maximum(tiles, 1.0))[:, None],
        "tile_flops": (n0 * flops0 + n1 * flops1)[:, None],
        "tile_overhead": (tiles * profile.per_tile_overhead_us)[:, None],
        "tau_overhead": profile.per_tile_overhead_us,
        "has_tiles": bool(tiles[0] > 0),
        "flops0": flops0,
        "flops1": flops1,
    }
    workload._cache[key] = values
    return values


class _Tables:
    """Per-profile arrays over the candidate grid (K rows x c columns), so a search is ~50 numpy ops."""

    def __init__(self, profile: HardwareProfile, cs: np.ndarray, ks: np.ndarray) -> None:
        N = profile.num_sms
        self.cs = cs.astype(np.float64)
        self.ks = ks
        self.kidx = ks[:, 0].astype(np.int64) - 1
        self.inv_ks = 1.0 / ks
        self.inv_bw = 1.0 / profile.comm_bytes_per_us[cs]
        self.inv_lbw = 1.0 / profile.local_bytes_per_us[cs]
        self.inv_rate = 1.0 / profile.gemm_flops_per_us_per_sm[N - cs]
        self.inv_capacity = 1.0 / ((N - self.cs) * ks)
        self.steal_denominator = 1.0 + self.cs * self.inv_capacity
        self.inv_cs = 1.0 / self.cs
        self.ks_minus_1 = ks - 1.0
        self.inv_bw_all = 1.0 / profile.comm_bytes_per_us[N]
        self.inv_lbw_all = 1.0 / profile.local_bytes_per_us[N]


def _tables(profile: HardwareProfile, cs=None, ks=None) -> _Tables:
    """The grid tables for these candidates, cached on the profile (the profile is frozen: cache beside its fields)."""
    cache = profile.__dict__.setdefault("_planner_tables", {})
    key = (None if cs is None else tuple(int(c) for c in np.ravel(cs)),
           None if ks is None else tuple(int(k) for k in np.ravel(ks)))
    tables = cache.get(key)
    if tables is None:
        cs_arr = np.arange(1, profile.comm_sms_limit + 1, dtype=np.int64) if cs is None else np.asarray(key[0], dtype=np.int64)
        ks_arr = np.arange(1, MAX_CHUNKS + 1) if ks is None else np.asarray(key[1])
        if cs_arr.size == 0 or cs_arr.min() < 1 or cs_arr.max() > profile.num_sms - 1:
            raise ValueError(f"comm CTA counts must lie in [1, {profile.num_sms - 1}], got {key[0]}")
        if ks_arr.size == 0 or ks_arr.min() < 1 or ks_arr.max() > MAX_CHUNKS:
            raise ValueError(f"chunk counts must lie in 1..{MAX_CHUNKS}, got {key[1]}")
        tables = _Tables(profile, cs_arr, ks_arr.astype(np.float64).reshape(-1, 1))
        cache[key] = tables
    return tables


def predict_grid(workload: Workload, profile: HardwareProfile, cs=None, ks=None, n_steal=None, allow_steal=True):
    """Predicted latency (us) and steal count for every (K, c) candidate of a split policy, formulas (1)-(12).

    Args:
        cs: comm CTA counts in [1, N-1] (default all of them).
        ks: chunk counts in 1..MAX_CHUNKS (default all).
        n_steal: force this steal count for every candidate instead of formula (7).
        allow_steal: False forces n_steal = 0.

    Returns:
        latency [len(ks), len(cs)] float64, n_steal [len(ks), len(cs)] int64.
    """
    t = _tables(profile, cs, ks)
    x = _inputs(workload, profile)
    f, sigma = profile.flag_round_trip_us, profile.role_switch_us
    kidx = t.kidx
    # Written for few numpy calls (each costs ~1 us at this size): the formulas are the numbered ones above.
    dispatch = x["remote_bytes"] * t.inv_bw + x["local_bytes"] * t.inv_lbw                    # (1)
    combine_c = dispatch + x["combine_extra_bytes"] * t.inv_lbw                                # (2)
    ratio = x["combine_all_us"] / (combine_c + 1e-12)                                          # C(N) / C(c)
    work = x["tile_flops"][kidx] * t.inv_rate + x["tile_overhead"][kidx]                       # (4), (5)
    tau_f = x["flops1"] * t.inv_rate + (x["tau_overhead"] + f) if x["has_tiles"] else f        # tau + f
    a0 = dispatch * t.inv_ks + f                                                               # (6)
    if not allow_steal or not x["has_tiles"]:
        steal = np.zeros(work.shape)
        g = work * t.inv_capacity                                                              # (8) with s = 0
        comm_free = dispatch
    else:
        mean_tile = work * x["inv_tiles"][kidx]
        if n_steal is not None:
            steal = np.full(work.shape, float(n_steal))
        else:                                                                                  # (7)
            slack = (a0 - dispatch) + work * t.inv_capacity + (tau_f - f - sigma)
            steal = np.floor(np.maximum(slack, 0.0) / (mean_tile * t.steal_denominator))
        steal = np.minimum(steal, np.floor(x["tiles"][kidx] * t.inv_cs))
        steal_us = steal * mean_tile
        g = (work - t.cs * steal_us) * t.inv_capacity                                          # (8)
        comm_free = dispatch + (steal_us + sigma * (steal > 0))
    e0_f = a0 + g + tau_f                                                                      # (9), plus f
    e_last_f = np.maximum(a0 + t.ks_minus_1 * g, dispatch + f) + g + tau_f
    fc = np.maximum(np.maximum(comm_free, e0_f) + combine_c, e_last_f + combine_c * t.inv_ks)  # (10)
    latency = e_last_f + (fc - e_last_f) * ratio + (profile.launch_us + f + x["reduce_us"])    # (11), (12)
    latency = latency + profile.call_overhead_us
    return latency, steal.astype(np.int64)


def _predict_serial(workload: Workload, profile: HardwareProfile) -> float:
    """Formula (13): dispatch, GEMMs, combine one after another on all N CTAs."""
    N = profile.num_sms
    x = _inputs(workload, profile)
    f, sigma = profile.flag_round_trip_us, profile.role_switch_us
    bw, lbw = profile.comm_bytes_per_us[N], profile.local_bytes_per_us[N]
    rate = profile.gemm_flops_per_us_per_sm[N]
    t0 = x["flops0"] / rate + profile.per_tile_overhead_us
    t1 = x["flops1"] / rate + profile.per_tile_overhead_us
    work = float(x["n0"][0, 0] * t0 + x["n1"][0, 0] * t1)
    tau = t1 if x["tiles"][0, 0] > 0 else 0.0
    dispatch = x["remote_bytes"] / bw + x["local_bytes"] / lbw
    combine = x["remote_bytes"] / bw + x["combine_local_bytes"] / lbw
    rho = profile.serial_gemm_time_ratio  # A8
    return float(profile.call_overhead_us + profile.launch_us + dispatch + f + sigma + work / N * rho + tau * rho + f
                 + combine + f + x["reduce_us"])


def predict(workload: Workload, profile: HardwareProfile, c: int, K: int = 1, n_steal: int | None = None) -> tuple[float, int]:
    """(predicted latency us, n_steal) of one split candidate; n_steal=None uses formula (7). c = N is serial."""
    if c == profile.num_sms:
        return _predict_serial(workload, profile), 0
    _check_c_k(c, K, profile)
    latency, steal = predict_grid(workload, profile, cs=[c], ks=[K], n_steal=n_steal)
    return float(latency[0, 0]), int(steal[0, 0])


def physical_floor_us(workload: Workload, profile: HardwareProfile) -> float:
    """No schedule beats this: launch + max(GEMM FLOPs at peak, dispatch + combine bytes at peak NVLink)."""
    compute = workload.flops / (profile.gemm_peak_tflops * 1e6)
    remote = 2 * max(workload.dispatch_send_bytes, workload.dispatch_recv_bytes)
    comm = remote / (profile.peer_bandwidth_gbps * 1e3)
    return profile.launch_us + max(compute, comm)


def _check_c_k(c: int, K: int, profile: HardwareProfile) -> None:
    if not 1 <= c <= profile.num_sms - 1:
        raise ValueError(f"c={c} must lie in [1, {profile.num_sms - 1}] (N = {profile.num_sms})")
    if not 1 <= K <= MAX_CHUNKS:
        raise ValueError(f"K={K} must lie in 1..{MAX_CHUNKS}")


# ---- the planner ----------------------------------------------------------------------------------------------------
def plan(workload: Workload, profile: HardwareProfile | None = None, policy: str = "weave") -> Plan:
    """This rank's plan for this layer under `policy` (deterministic: same counts, same plan on every rank).

    Policies: "serial" (c = N, K = 1), "spatial" (best c for K = 1, no stealing), "static:<c>[,<K>]" (fixed, no
    stealing), "per_iteration" (c from the token count alone, K = 1, no stealing, like Comet), "weave" (best (c, K)
    with formula (7)'s stealing, or c = N (the serial schedule) when formula (13) predicts less than every split).
    Ties go to the smallest K, then the smallest c. `Plan.c == N` always means the serial schedule.
    """
    profile = HardwareProfile.default() if profile is None else profile
    name, args = parse_policy(policy)
    N = profile.num_sms
    if name == "serial":
        return Plan(N, 1, 0, _predict_serial(workload, profile), policy)
    if name == "static":
        c, K = args
        _check_c_k(c, K, profile)
        latency, _ = predict_grid(workload, profile, cs=[c], ks=[K], allow_steal=False)
        return Plan(c, K, 0, float(latency[0, 0]), policy)
    if name == "per_iteration":
        c = _per_iteration_c(workload.spec, workload.world_size, workload.num_tokens, profile)
        latency, _ = predict_grid(workload, profile, cs=[c], ks=[1], allow_steal=False)
        return Plan(c, 1, 0, float(latency[0, 0]), policy)
    if name == "spatial":
        latency, _ = predict_grid(workload, profile, ks=[1], allow_steal=False)
        best = int(np.argmin(latency[0]))
        return Plan(best + 1, 1, 0, float(latency[0, best]), policy)
    latency, steal = predict_grid(workload, profile)
    flat = int(np.argmin(latency))
    k_index, c_index = divmod(flat, latency.shape[1])
    best = float(latency[k_index, c_index])
    serial = _predict_serial(workload, profile)
    if serial < best:  # no split at all is one of the schedules the kernel can run: c = N means serial
        return Plan(N, 1, 0, serial, policy)
    return Plan(c_index + 1, k_index + 1, int(steal[k_index, c_index]), best, policy)


@lru_cache(maxsize=1024)
def _per_iteration_c(spec: MoESpec, world_size: int, num_tokens: int, profile: HardwareProfile) -> int:
    """Comet-like: one c per token-count bucket (next power of two), chosen for balanced routing of that size."""
    bucket = 1 << max(0, math.ceil(math.log2(max(num_tokens, 1))))
    workload = _balanced_workload(spec, world_size, bucket)
    latency, _ = predict_grid(workload, profile, ks=[1], allow_steal=False)
    return int(np.argmin(latency[0])) + 1


@lru_cache(maxsize=256)
def plans_serial(spec: MoESpec, world_size: int, max_tokens: int, profile: HardwareProfile,
                 policy: str = "weave") -> bool:
    """Whether `policy` plans the serial schedule for balanced routing at every token count of 1, 8, 64, ...
    (x8) up to `max_tokens`, and at `max_tokens`: a layer whose plan would not depend on its routing in practice
    (the weave backend's KernelConfig.serial_at_ep1 asks it at EP = 1; tests/test_plan.py checks that on the shipped
    profile the sample stands for uniform and skewed routing)."""
    counts = {max(1, max_tokens)} | {t for t in (8 ** i for i in range(8)) if t <= max_tokens}
    return all(plan(_balanced_workload(spec, world_size, t), profile, policy).is_serial(profile.num_sms)
               for t in sorted(counts))


def _balanced_workload(spec: MoESpec, world_size: int, num_tokens: int) -> Workload:
    """Expected counts when every rank has `num_tokens` tokens routed uniformly (k distinct experts of E)."""
    num_local_experts = spec.num_experts // world_size
    # P(a token has >= 1 of its k experts on a given rank) = 1 - C(E - E_local, k) / C(E, k)
    miss = math.comb(spec.num_experts - num_local_experts, spec.top_k) / math.comb(spec.num_experts, spec.top_k)
    rows = int(round(num_tokens * (1.0 - miss)))
    # EP sources x T tokens x k pairs, 1/EP of them on this rank's experts: T * k pairs, spread evenly.
    counts = np.full(world_size, rows, dtype=np.int64)
    received = int(counts.sum())
    # rounding guard: every received row carries 1..k pairs (rows round to 0 when a token rarely visits this rank)
    pairs = min(max(num_tokens * spec.top_k, received), spec.top_k * received)
    expert_rows = even_split(np.int64(pairs), num_local_experts)
    return Workload.from_counts(spec, world_size, 0, counts, counts, expert_rows, num_tokens=num_tokens)
