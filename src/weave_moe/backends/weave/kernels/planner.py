"""The planner on the GPU: `weave_moe.plan.plan` for every rank, evaluated from the global counts by one tiny kernel.

Input: the counts vector of `exchange.CountsFormat` (int32 `[EP tokens | EP*EP rows sent s -> d | E pairs]`, any
words after these are ignored). Output: `[EP, 4]` int32, row d = rank d's plan `(c, K, n_steal, predicted_us as fp32
bits)`; c = N means the serial schedule. Every program plans the ranks d = pid, pid + P, ... (P programs; one program
plans them all, as a megakernel prologue would; P = EP plans them side by side).

What the kernel evaluates is `weave_moe.plan.cost_model`: for rank d the workload of `Workload.from_counts` (remote rows
= max(rows sent, rows received) minus the local rows, GEMM M tiles with every expert's pairs split evenly over K
chunks as `even_split` does), formulas (1)-(13) over the grid K = 1..MAX_CHUNKS x c = 1..N-1 at once, and the policy's
choice among them (ties to the smallest K, then the smallest c, as `np.argmin` over the host's [K, c] grid).

Arithmetic: fp32 where the host uses float64, in the host's operation order, with IEEE division (`div_rn`) and no
fused multiply-adds (launched with `enable_fp_fusion=False`), so `planner_mirror.mirror` (planner_mirror.py: numpy
float32, the same operations in the same order) reproduces the kernel bit for bit on the CPU. Integer quantities (tile counts, the steal cap tiles // c)
are exact integers, as the host's float64 values of them are. The host precomputes per profile, once: the reciprocal
curves 1/bw(x), 1/lbw(x), 1/rate(x) at every SM count x = 0..N (fp32 of the float64 reciprocal), the tile FLOPs, and
for "per_iteration" the comm CTA count of each token bucket 2^b, b = 0..31. fp32 and float64 can order two
candidates differently when their latencies agree to ~1e-7 (a near-tie) or when formula (7)'s floor sits on an
integer; tests/test_device_planner.py bounds what that costs against the Python planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
import triton
import triton.language as tl

from weave_moe.backends.weave.exchange import CountsFormat
from weave_moe.backends.weave.kernels import sync
from weave_moe.models import BYTES_PER_ELEMENT, MoESpec
from weave_moe.plan import MAX_CHUNKS, HardwareProfile, Plan, parse_policy
from weave_moe.plan.cost_model import _per_iteration_c

__all__ = ["DevicePlanner", "plan_kernel", "plan_rank", "POLICY_CODES", "POLICY_ARGS", "PER_ITERATION_BUCKETS",
           "compile_planner_ptx"]

#: Policy name -> the kernel's POLICY constexpr.
POLICY_CODES = {"weave": 0, "spatial": 1, "static": 2, "per_iteration": 3, "serial": 4}

#: `plan_rank`'s integer arguments that come from the profile and the policy (`DevicePlanner.policy_args`), in
#: its order
POLICY_ARGS = ("num_sms", "comm_sms_limit", "n0_per_mtile", "n1_per_mtile", "static_c", "static_k")

#: Warps of the planner's launch. Its time is mostly a chain of block-wide reductions (each through shared memory and
#: a CTA barrier across warps): 13 per rank, 3.15 us per rank at 4 warps on an H200 (one program per rank,
#: bench/results/eval6-emu-h200-2b24350); since cut to 9 (K = 1's tile counts from one, the choice by one key;
#: 24-26 bar.sync in the sm_90 PTX at 4 warps, were 29-31), unmeasured. At 1 warp 5 bar.sync and 2.5x the
#: instructions per thread; fewer warps untimed (`launch(num_warps=)`, device_planner_check.py sweeps them). The
#: plans do not depend on it: its sums are of integers, its minima exact.
NUM_WARPS = 4

#: Token buckets 2^0 .. 2^31 of the per_iteration policy (T is an int32 in the counts vector).
PER_ITERATION_BUCKETS = 32

# The fp32 model table: scalars at fixed slots, then three curves of N + 1 entries (index = SM count). tl.constexpr:
# the kernel reads module globals only when they are compile-time constants; the host uses their `.value`.
_ROW_BYTES = tl.constexpr(0)
_FLOPS0 = tl.constexpr(1)
_FLOPS1 = tl.constexpr(2)
_FLAG_US = tl.constexpr(3)
_SWITCH_US = tl.constexpr(4)
_TILE_US = tl.constexpr(5)
_LAUNCH_US = tl.constexpr(6)
_CALL_US = tl.constexpr(7)
_SERIAL_GEMM_RATIO = tl.constexpr(8)
_NUM_SCALARS = tl.constexpr(9)
_BIG = tl.constexpr(1 << 30)
_NO_KEY = tl.constexpr((1 << 63) - 1)


# ---- the kernel ---------------------------------------------------------------------------------------------------
@triton.jit
def plan_rank(counts_ptr, model_ptr, per_iteration_ptr, out_ptr, d, tokens_offset, send_rows_offset, pairs_offset,
              world_size, num_local_experts, num_sms, comm_sms_limit, n0_per_mtile, n1_per_mtile, static_c, static_k,
              POLICY: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_LOCAL_E: tl.constexpr, BLOCK_C: tl.constexpr,
              MAX_CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr):
    # -- rank d's workload (Workload.from_counts) --
    offs_ep = tl.arange(0, BLOCK_P)
    ep_mask = offs_ep < world_size
    send_base = counts_ptr + send_rows_offset
    sent = tl.sum(tl.load(send_base + d * world_size + offs_ep, mask=ep_mask, other=0), axis=0)
    received = tl.sum(tl.load(send_base + offs_ep * world_size + d, mask=ep_mask, other=0), axis=0)
    local = tl.load(send_base + d * world_size + d)
    num_tokens = tl.load(counts_ptr + tokens_offset + d)
    remote_rows = tl.maximum(sent - local, received - local)
    offs_e = tl.arange(0, BLOCK_LOCAL_E)
    pairs_base = counts_ptr + pairs_offset + d * num_local_experts
    expert_rows = tl.load(pairs_base + offs_e, mask=offs_e < num_local_experts, other=0)
    num_pairs = tl.sum(expert_rows, axis=0)
    # M tiles for K = 1..MAX_CHUNKS: chunk j of K holds (j+1)*n//K - j*n//K rows of an expert with n pairs. int32:
    # exact while n * MAX_CHUNKS < 2^31 (n <= EP * T_max, pairs of one expert: millions at most).
    ks = tl.arange(0, MAX_CHUNKS) + 1
    rows_2d = expert_rows[:, None]
    ks_2d = ks[None, :]
    mtiles_2d = tl.zeros([BLOCK_LOCAL_E, MAX_CHUNKS], dtype=tl.int32)
    chunk_start = tl.zeros([BLOCK_LOCAL_E, MAX_CHUNKS], dtype=tl.int32)
    for j in tl.static_range(MAX_CHUNKS):
        chunk_end = ((j + 1) * rows_2d) // ks_2d
        mtiles_2d += tl.where(j < ks_2d, (chunk_end - chunk_start + BLOCK_M - 1) // BLOCK_M, 0)
        chunk_start = chunk_end
    m_tiles = tl.sum(mtiles_2d, axis=0)                                       # [MAX_CHUNKS] int32
    n0_int = m_tiles * n0_per_mtile
    n1_int = m_tiles * n1_per_mtile
    tiles_int = n0_int + n1_int
    # K = 1's tile counts from one reduction (each one a CTA-wide reduction: the kernel's time is mostly these)
    m_tiles_k1 = tl.sum(tl.where(ks == 1, m_tiles, 0), axis=0)
    tiles_k1 = m_tiles_k1 * (n0_per_mtile + n1_per_mtile)
    has_tiles = tiles_k1 > 0

    # -- scalars (cost_model._inputs) --
    row_bytes = tl.load(model_ptr + _ROW_BYTES)
    flops0 = tl.load(model_ptr + _FLOPS0)
    flops1 = tl.load(model_ptr + _FLOPS1)
    f = tl.load(model_ptr + _FLAG_US)
    sigma = tl.load(model_ptr + _SWITCH_US)
    tile_us = tl.load(model_ptr + _TILE_US)
    launch_us = tl.load(model_ptr + _LAUNCH_US)
    call_us = tl.load(model_ptr + _CALL_US)
    rho = tl.load(model_ptr + _SERIAL_GEMM_RATIO)
    curves = model_ptr + _NUM_SCALARS
    inv_bw_all = tl.load(curves + num_sms)
    inv_lbw_all = tl.load(curves + (num_sms + 1) + num_sms)
    inv_rate_all = tl.load(curves + 2 * (num_sms + 1) + num_sms)
    remote_b = remote_rows.to(tl.float32) * row_bytes
    local_b = local.to(tl.float32) * row_bytes
    pairs_b = num_pairs.to(tl.float32) * row_bytes
    combine_local_b = pairs_b + local_b
    combine_all = remote_b * inv_bw_all + combine_local_b * inv_lbw_all
    reduce_us = ((sent + num_tokens).to(tl.float32) * row_bytes) * inv_lbw_all
    n0_f = n0_int.to(tl.float32)
    n1_f = n1_int.to(tl.float32)
    tiles_f = tiles_int.to(tl.float32)
    tile_flops = (n0_f * flops0 + n1_f * flops1)[:, None]                      # [K, 1]
    tile_overhead = (tiles_f * tile_us)[:, None]
    inv_tiles = tl.math.div_rn(tl.full([MAX_CHUNKS], 1.0, tl.float32), tl.maximum(tiles_f, 1.0))[:, None]

    # -- the candidate grid: formulas (1)-(12) (cost_model.predict_grid) --
    cs = tl.arange(0, BLOCK_C)[None, :] + 1                                    # [1, C]
    kk = ks[:, None]                                                           # [K, 1]
    c_ok = cs <= num_sms - 1
    c_index = tl.where(c_ok, cs, 1)
    inv_bw = tl.load(curves + c_index)
    inv_lbw = tl.load(curves + (num_sms + 1) + c_index)
    inv_rate = tl.load(curves + 2 * (num_sms + 1) + (num_sms - c_index))
    cs_f = cs.to(tl.float32)
    kk_f = kk.to(tl.float32)
    inv_ks = tl.math.div_rn(tl.full([MAX_CHUNKS, 1], 1.0, tl.float32), kk_f)
    capacity = ((num_sms - c_index) * kk).to(tl.float32)                       # [K, C]
    inv_capacity = tl.math.div_rn(tl.full([MAX_CHUNKS, BLOCK_C], 1.0, tl.float32), capacity)
    steal_den = 1.0 + cs_f * inv_capacity
    dispatch = remote_b * inv_bw + local_b * inv_lbw                           # (1)
    combine_c = dispatch + pairs_b * inv_lbw                                   # (2)
    ratio = tl.math.div_rn(combine_all + tl.zeros_like(combine_c), combine_c + 1e-12)
    work = tile_flops * inv_rate + tile_overhead                               # (4), (5)
    tau_f = tl.where(has_tiles, flops1 * inv_rate + (tile_us + f), f)
    a0 = dispatch * inv_ks + f                                                 # (6)
    if POLICY == 0:
        use_steal = has_tiles
    else:
        use_steal = has_tiles & (tiles_k1 < 0)
    mean_tile = work * inv_tiles
    slack = ((a0 - dispatch) + work * inv_capacity) + ((tau_f - f) - sigma)    # (7)
    steal_den_all = tl.where(use_steal, mean_tile * steal_den, 1.0)
    steal = tl.math.floor(tl.math.div_rn(tl.maximum(slack, 0.0), steal_den_all))
    steal_cap = (tiles_int[:, None] // c_index).to(tl.float32)
    steal = tl.where(use_steal, tl.minimum(steal, steal_cap), 0.0)
    steal_us = steal * mean_tile
    g = (work - cs_f * steal_us) * inv_capacity                                # (8)
    comm_free = dispatch + (steal_us + sigma * (steal > 0.0).to(tl.float32))
    e0_f = (a0 + g) + tau_f                                                    # (9), plus f
    e_last_f = (tl.maximum(a0 + (kk_f - 1.0) * g, dispatch + f) + g) + tau_f
    fc = tl.maximum(tl.maximum(comm_free, e0_f) + combine_c, e_last_f + combine_c * inv_ks)   # (10)
    latency = (e_last_f + (fc - e_last_f) * ratio) + ((launch_us + f) + reduce_us)            # (11), (12)
    latency = latency + call_us

    # -- formula (13), the serial schedule --
    t0 = flops0 * inv_rate_all + tile_us
    t1 = flops1 * inv_rate_all + tile_us
    n0_k1 = (m_tiles_k1 * n0_per_mtile).to(tl.float32)   # = n0_f at K = 1 (an integer, exact in fp32)
    n1_k1 = (m_tiles_k1 * n1_per_mtile).to(tl.float32)
    serial_work = n0_k1 * t0 + n1_k1 * t1
    tau = tl.where(has_tiles, t1, 0.0)
    dispatch_all = remote_b * inv_bw_all + local_b * inv_lbw_all
    combine_serial = remote_b * inv_bw_all + combine_local_b * inv_lbw_all
    serial = call_us + launch_us
    serial = serial + dispatch_all
    serial = serial + f
    serial = serial + sigma
    serial = serial + tl.math.div_rn(serial_work, num_sms.to(tl.float32)) * rho   # A8
    serial = serial + tau * rho
    serial = serial + f
    serial = serial + combine_serial
    serial = serial + f
    serial = serial + reduce_us

    # -- the policy's candidates and its choice (cost_model.plan) --
    if POLICY == 1:
        valid = (cs <= comm_sms_limit) & (kk == 1)
    elif POLICY == 2:
        valid = (cs == static_c) & (kk == static_k)
    elif POLICY == 3:
        buckets = tl.arange(0, 32)
        powers = tl.full([32], 1, tl.int64) << buckets.to(tl.int64)
        bucket = tl.sum(((powers < num_tokens) & (buckets < 31)).to(tl.int32), axis=0)
        per_iteration_c = tl.load(per_iteration_ptr + bucket)
        valid = (cs == per_iteration_c) & (kk == 1)
    else:  # weave; serial evaluates the grid too but never picks from it
        valid = (cs <= comm_sms_limit) & (kk >= 1)
    masked = tl.where(valid, latency, float("inf"))
    flat = (kk - 1) * BLOCK_C + (cs - 1)
    # the fastest valid candidate and, among equal latencies, the smallest K then c, by ONE reduction: a key with the
    # latency above the candidate's index, the latency's IEEE bits made to order as its value (a negative float's
    # bits but the sign flipped: an involution); no valid candidate: best = inf, pick = _BIG
    bits = masked.to(tl.int32, bitcast=True)
    key = (tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) << 32) | flat.to(tl.int64)
    smallest = tl.min(tl.min(tl.where(valid, key, _NO_KEY), axis=1), axis=0)
    found = smallest != _NO_KEY
    best_bits = (smallest >> 32).to(tl.int32)
    best_bits = tl.where(best_bits < 0, best_bits ^ 0x7FFFFFFF, best_bits)
    best = tl.where(found, best_bits.to(tl.float32, bitcast=True), float("inf"))
    pick = tl.where(found, (smallest & 0xFFFFFFFF).to(tl.int32), _BIG)
    best_c = pick % BLOCK_C + 1
    best_k = pick // BLOCK_C + 1
    steal_int = steal.to(tl.int32)
    best_steal = tl.max(tl.max(tl.where(flat == pick, steal_int, 0), axis=1), axis=0)
    if POLICY == 4:
        use_serial = serial == serial
    elif POLICY == 0:
        use_serial = serial < best  # no split at all is faster: c = N is the serial schedule (cost_model.plan)
    else:
        use_serial = serial != serial
    best_c = tl.where(use_serial, num_sms, best_c)
    best_k = tl.where(use_serial, 1, best_k)
    best_steal = tl.where(use_serial, 0, best_steal)
    best = tl.where(use_serial, serial, best)
    row = out_ptr + d * 4
    tl.store(row + 0, best_c)
    tl.store(row + 1, best_k)
    tl.store(row + 2, best_steal)
    tl.store(row + 3, best.to(tl.int32, bitcast=True))


@triton.jit
def _clock_cycles():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def plan_kernel(counts_ptr, model_ptr, per_iteration_ptr, out_ptr, timing_ptr, num_batches, counts_stride,
                tokens_offset, send_rows_offset, pairs_offset, world_size, num_local_experts, num_sms, comm_sms_limit,
                n0_per_mtile, n1_per_mtile, static_c, static_k,
                POLICY: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_LOCAL_E: tl.constexpr, BLOCK_C: tl.constexpr,
                MAX_CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, TIMING: tl.constexpr = False):
    """Every rank's plan from the global counts (module docstring), for `num_batches` counts vectors.

    Args:
        counts_ptr: int32 counts vectors (`exchange.CountsFormat`), vector b at counts_ptr + b * counts_stride (a
            layer call plans one: num_batches = 1; tests and the GPU check plan many in one launch); its fields
            start at tokens_offset, send_rows_offset and pairs_offset (CountsFormat's).
        model_ptr: fp32 model table (`DevicePlanner.model`).
        per_iteration_ptr: int32 [PER_ITERATION_BUCKETS] comm CTAs per token bucket (read by POLICY 3 only).
        out_ptr: int32 [num_batches, EP, 4] (c, K, n_steal, predicted_us fp32 bits).
        timing_ptr: int64 [programs, 4] (TIMING only): SM clock and %globaltimer at each program's start and end.
        static_c, static_k: the plan of POLICY 2 ("static:<c>,<K>").
    """
    sync.pdl_enter()
    pid = tl.program_id(0)
    if TIMING:
        start_cycles = _clock_cycles()
        start_ns = sync.global_time_ns()
    for item in range(pid, num_batches * world_size, tl.num_programs(0)):
        batch = item // world_size
        plan_rank(counts_ptr + batch.to(tl.int64) * counts_stride, model_ptr, per_iteration_ptr,
                  out_ptr + batch.to(tl.int64) * world_size * 4, item % world_size, tokens_offset, send_rows_offset,
                  pairs_offset, world_size, num_local_experts, num_sms, comm_sms_limit, n0_per_mtile, n1_per_mtile,
                  static_c, static_k, POLICY, BLOCK_P, BLOCK_LOCAL_E, BLOCK_C, MAX_CHUNKS, BLOCK_M)
    if TIMING:
        tl.debug_barrier()
        end_cycles = _clock_cycles()
        end_ns = sync.global_time_ns()
        tl.store(timing_ptr + pid * 4 + 0, start_cycles)
        tl.store(timing_ptr + pid * 4 + 1, end_cycles)
        tl.store(timing_ptr + pid * 4 + 2, start_ns)
        tl.store(timing_ptr + pid * 4 + 3, end_ns)


# ---- the host side --------------------------------------------------------------------------------------------------
def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class DevicePlanner:
    """The device planner of one layer shape, EP size, profile and policy (host tables built once).

    Attributes:
        model: [8 + 3 (N + 1)] float32: row bytes, tile FLOPs, f, sigma, o, launch, call overhead, then 1/bw(x),
            1/lbw(x) (bytes/us) and 1/rate(x) (FLOP/us per SM) at x = 0..N.
        per_iteration_c: [PER_ITERATION_BUCKETS] int32, c of the per_iteration policy for T in bucket b (T <= 2^b);
            zeros for other policies.
    """

    spec: MoESpec
    world_size: int
    profile: HardwareProfile
    policy: str = "weave"
    model: np.ndarray = field(init=False, repr=False)
    per_iteration_c: np.ndarray = field(init=False, repr=False)
    _device_tables: dict = field(init=False, repr=False, default_factory=dict, compare=False)
    _launch_args: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.spec.num_experts % self.world_size:
            raise ValueError(f"num_experts={self.spec.num_experts} is not divisible by EP={self.world_size}")
        name, args = parse_policy(self.policy)
        profile, spec, N = self.profile, self.spec, self.profile.num_sms
        if name == "static" and not (1 <= args[0] <= N - 1 and 1 <= args[1] <= MAX_CHUNKS):
            raise ValueError(f"policy {self.policy!r}: c must lie in [1, {N - 1}] and K in 1..{MAX_CHUNKS}")
        scalars = np.zeros(_NUM_SCALARS.value, dtype=np.float64)
        scalars[_ROW_BYTES.value] = spec.hidden_size * BYTES_PER_ELEMENT
        scalars[_FLOPS0.value] = profile.gemm0_tile_flops(spec.hidden_size)
        scalars[_FLOPS1.value] = profile.gemm1_tile_flops(spec.intermediate_size)
        scalars[_FLAG_US.value] = profile.flag_round_trip_us
        scalars[_SWITCH_US.value] = profile.role_switch_us
        scalars[_TILE_US.value] = profile.per_tile_overhead_us
        scalars[_LAUNCH_US.value] = profile.launch_us
        scalars[_CALL_US.value] = profile.call_overhead_us
        scalars[_SERIAL_GEMM_RATIO.value] = profile.serial_gemm_time_ratio
        curves = [1.0 / profile.comm_bytes_per_us, 1.0 / profile.local_bytes_per_us,
                  1.0 / profile.gemm_flops_per_us_per_sm]
        model = np.concatenate([scalars] + curves).astype(np.float32)
        model.flags.writeable = False
        object.__setattr__(self, "model", model)
        buckets = np.zeros(PER_ITERATION_BUCKETS, dtype=np.int32)
        if name == "per_iteration":
            for b in range(PER_ITERATION_BUCKETS):
                buckets[b] = _per_iteration_c(spec, self.world_size, 1 << b, profile)
        buckets.flags.writeable = False
        object.__setattr__(self, "per_iteration_c", buckets)
        object.__setattr__(self, "_launch_args", dict(self.scalar_args(), **self.constants()))

    # -- launch parameters --
    @property
    def num_local_experts(self) -> int:
        return self.spec.num_experts // self.world_size

    @cached_property
    def counts_format(self) -> CountsFormat:
        """Where the counts vector's fields start (the planner reads tokens, rows sent and expert pairs)."""
        return CountsFormat(self.world_size, self.spec.num_experts, status_words=0)

    @property
    def counts_words(self) -> int:
        """Words of the counts vector the kernel reads: up to the end of the expert pairs."""
        return self.counts_format.expert_pairs_offset + self.spec.num_experts

    def scalar_args(self) -> dict:
        """`plan_kernel`'s integer arguments: where the counts vector's fields start, EP, E_local, then
        `policy_args()`."""
        fmt = self.counts_format
        return dict(tokens_offset=fmt.tokens_offset, send_rows_offset=fmt.send_rows_offset,
                    pairs_offset=fmt.expert_pairs_offset, world_size=self.world_size,
                    num_local_experts=self.num_local_experts, **self.policy_args())

    def policy_args(self) -> dict:
        """The integer arguments of `plan_rank` that come from the profile and the policy, not from the counts
        vector (a kernel that plans after building the counts, kernels/counts.py, has the others already)."""
        profile, spec = self.profile, self.spec
        name, args = parse_policy(self.policy)
        static_c, static_k = args if name == "static" else (1, 1)
        return dict(zip(POLICY_ARGS, (profile.num_sms, profile.comm_sms_limit,
                                      -(-spec.intermediate_size // profile.block_n0),
                                      -(-spec.hidden_size // profile.block_n1), static_c, static_k)))

    def constants(self) -> dict:
        """Compile-time sizes: the candidate grid spans c = 1..BLOCK_C, the largest c the policy can pick (the
        profile's cap on c for the searching policies, e.g. 48 of 131 on the calibrated H200: a 4x smaller grid).
        BLOCK_P covers the ranks, BLOCK_LOCAL_E one rank's experts."""
        name, args = parse_policy(self.policy)
        largest_c = args[0] if name == "static" else self.profile.comm_sms_limit
        return dict(POLICY=POLICY_CODES[name], BLOCK_P=_next_pow2(self.world_size),
                    BLOCK_LOCAL_E=_next_pow2(self.num_local_experts), BLOCK_C=_next_pow2(largest_c),
                    MAX_CHUNKS=MAX_CHUNKS, BLOCK_M=self.profile.block_m)

    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(model [fp32], per_iteration_c [int32]) on `device`, copied once per device."""
        key = str(device)
        if key not in self._device_tables:
            self._device_tables[key] = (torch.from_numpy(self.model.copy()).to(device),
                                        torch.from_numpy(self.per_iteration_c.copy()).to(device))
        return self._device_tables[key]

    def launch(self, counts: torch.Tensor, out: torch.Tensor, num_programs: int | None = None,
               timing: torch.Tensor | None = None, num_warps: int = NUM_WARPS) -> torch.Tensor:
        """Enqueue the planner on `counts`' device: `out` gets every rank's (c, K, n_steal, predicted_us bits).

        Args:
            counts: int32 counts vector [>= counts_words] (a layer call), or a batch of them [B, >= counts_words];
                words past counts_words are not read.
            out: int32 [EP, 4] (or [B, EP, 4] for a batch), contiguous, on the same device.
            num_programs: programs of the grid (default: one per rank and vector; 1: one program plans them all).
            timing: int64 [programs, 4] to record each program's (start, end) SM clock and %globaltimer (GPU only).
            num_warps: warps per program (NUM_WARPS).
        """
        batched = counts.dim() == 2
        if counts.dtype != torch.int32 or counts.dim() not in (1, 2) or counts.shape[-1] < self.counts_words \
                or counts.stride(-1) != 1:
            raise ValueError(f"counts must be int32 [>= {self.counts_words}] or [B, >= {self.counts_words}] with "
                             f"unit stride in its last dim, got {counts.dtype} {tuple(counts.shape)}")
        num_batches = counts.shape[0] if batched else 1
        shape = (num_batches, self.world_size, 4) if batched else (self.world_size, 4)
        if out.dtype != torch.int32 or tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous int32 {list(shape)} tensor, got {out.dtype} "
                             f"{tuple(out.shape)}")
        model, per_iteration = self.tables(counts.device)
        grid = (num_programs or num_batches * self.world_size,)
        if timing is not None and (timing.dtype != torch.int64 or tuple(timing.shape) != (grid[0], 4)):
            raise ValueError(f"timing must be int64 [{grid[0]}, 4], got {timing.dtype} {tuple(timing.shape)}")
        options = {} if sync.INTERPRETER.value else dict(enable_fp_fusion=False)
        plan_kernel[grid](counts, model, per_iteration, out, out if timing is None else timing, num_batches,
                          counts.stride(0) if batched else 0, **self._launch_args, TIMING=timing is not None,
                          num_warps=num_warps, **options, **sync.LAUNCH)
        return out

    def decode(self, rows) -> list[Plan]:
        """Plans of a host copy of the output ([EP, 4] int32 tensor or array, or nested lists)."""
        rows = np.asarray(rows.cpu() if isinstance(rows, torch.Tensor) else rows, dtype=np.int32).reshape(-1, 4)
        predicted = rows[:, 3].copy().view(np.float32)
        return [Plan(int(c), int(k), int(s), float(p), self.policy)
                for (c, k, s, _), p in zip(rows.tolist(), predicted.tolist())]


def compile_planner_ptx(planner: DevicePlanner, capability: int = 90, timing: bool = False,
                        num_warps: int = NUM_WARPS) -> str:
    """The planner kernel's PTX for `sm_<capability>`, compiled without a GPU with the launch's options."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"counts_ptr": "*i32", "model_ptr": "*fp32", "per_iteration_ptr": "*i32", "out_ptr": "*i32",
                 "timing_ptr": "*i64", "num_batches": "i32", "counts_stride": "i32"}
    signature.update({name: "i32" for name in planner.scalar_args()})
    constants = dict(planner.constants(), TIMING=timing)
    signature.update({name: "constexpr" for name in constants})
    source = ASTSource(fn=plan_kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": num_warps, "enable_fp_fusion": False})
    return compiled.asm["ptx"]

