"""The device planner's CPU mirror: `plan_rank` of kernels/planner.py in numpy float32, bit for bit.

Every operation of the kernel, in the same order and precision (fp32 values; integer tile counts, exact in both), vectorised over R
rank-workloads and the [K, c] candidate grid: `mirror` is its entry point. Change the kernel and this
file together; tests/test_device_planner.py compares them bit for bit under the interpreter, and
scripts/device_planner_check.py on the GPU.
"""

from __future__ import annotations

import numpy as np

from weave_moe.backends.weave.kernels.planner import (
    _CALL_US,
    _FLAG_US,
    _FLOPS0,
    _FLOPS1,
    _LAUNCH_US,
    _NUM_SCALARS,
    _ROW_BYTES,
    _SERIAL_GEMM_RATIO,
    _SWITCH_US,
    _TILE_US,
    POLICY_CODES,
    DevicePlanner,
)
from weave_moe.plan import MAX_CHUNKS, parse_policy

__all__ = ["mirror", "mirror_rows", "mirror_block"]


def mirror(planner: DevicePlanner, counts: np.ndarray) -> np.ndarray:
    """`planner`'s kernel output for a batch of counts vectors [B, >= counts_words] (int), computed with numpy
    float32 in the kernel's operation order: [B, EP, 4] int32, equal to the kernel's bit for bit."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 2 or counts.shape[1] < planner.counts_words:
        raise ValueError(f"counts must be [B, >= {planner.counts_words}], got {counts.shape}")
    batch, ep, num_local, fmt = counts.shape[0], planner.world_size, planner.num_local_experts, planner.counts_format
    send = counts[:, fmt.send_rows_offset:fmt.send_rows_offset + ep * ep].reshape(batch, ep, ep)
    pairs = counts[:, fmt.expert_pairs_offset:fmt.expert_pairs_offset + planner.spec.num_experts].reshape(
        batch, ep, num_local)
    ranks = np.arange(ep)
    inputs = dict(
        sent=send.sum(axis=2), received=send.sum(axis=1), local=send[:, ranks, ranks],
        num_tokens=counts[:, fmt.tokens_offset:fmt.tokens_offset + ep], expert_rows=pairs)
    out = mirror_rows(planner, {k: v.reshape((batch * ep,) + v.shape[2:]) for k, v in inputs.items()})
    return out.reshape(batch, ep, 4)


def mirror_rows(planner: DevicePlanner, x: dict, block: int = 512) -> np.ndarray:
    """`plan_rank` over R rank-workloads (arrays [R] and expert_rows [R, E_local]), `block` at a time."""
    total = x["sent"].shape[0]
    out = np.zeros((total, 4), dtype=np.int32)
    for start in range(0, total, block):
        part = {k: v[start:start + block] for k, v in x.items()}
        out[start:start + block] = mirror_block(planner, part)
    return out


def mirror_block(planner: DevicePlanner, x: dict) -> np.ndarray:
    f32 = np.float32
    model, args, N = planner.model, planner.scalar_args(), planner.profile.num_sms
    block_m = planner.profile.block_m
    policy = POLICY_CODES[parse_policy(planner.policy)[0]]
    sent, received, local, num_tokens = x["sent"], x["received"], x["local"], x["num_tokens"]
    remote_rows = np.maximum(sent - local, received - local)
    expert_rows = x["expert_rows"]
    num_pairs = expert_rows.sum(axis=1)
    ks = np.arange(1, MAX_CHUNKS + 1, dtype=np.int64)
    rows_3d = expert_rows[:, :, None]
    m_tiles = np.zeros((sent.shape[0], MAX_CHUNKS), dtype=np.int64)
    chunk_start = np.zeros_like(rows_3d)
    for j in range(MAX_CHUNKS):
        chunk_end = ((j + 1) * rows_3d) // ks
        m_tiles += np.where(j < ks, (chunk_end - chunk_start + block_m - 1) // block_m, 0).sum(axis=1)
        chunk_start = chunk_end
    n0_int, n1_int = m_tiles * args["n0_per_mtile"], m_tiles * args["n1_per_mtile"]
    tiles_int = n0_int + n1_int                                               # [R, K]
    has_tiles = (tiles_int[:, 0] > 0)[:, None, None]

    row_bytes, flops0, flops1 = model[_ROW_BYTES.value], model[_FLOPS0.value], model[_FLOPS1.value]
    f, sigma, tile_us = model[_FLAG_US.value], model[_SWITCH_US.value], model[_TILE_US.value]
    launch_us, call_us = model[_LAUNCH_US.value], model[_CALL_US.value]
    rho = model[_SERIAL_GEMM_RATIO.value]
    curves = model[_NUM_SCALARS.value:]
    inv_bw_curve, inv_lbw_curve, inv_rate_curve = curves[:N + 1], curves[N + 1:2 * (N + 1)], curves[2 * (N + 1):]
    inv_bw_all, inv_lbw_all, inv_rate_all = inv_bw_curve[N], inv_lbw_curve[N], inv_rate_curve[N]
    col = (slice(None), None, None)
    remote_b = (remote_rows.astype(f32) * row_bytes)[col]
    local_b = (local.astype(f32) * row_bytes)[col]
    pairs_b = (num_pairs.astype(f32) * row_bytes)[col]
    combine_local_b = pairs_b + local_b
    combine_all = remote_b * inv_bw_all + combine_local_b * inv_lbw_all
    reduce_us = (((sent + num_tokens).astype(f32) * row_bytes) * inv_lbw_all)[col]
    n0_f, n1_f, tiles_f = n0_int.astype(f32), n1_int.astype(f32), tiles_int.astype(f32)
    tile_flops = (n0_f * flops0 + n1_f * flops1)[:, :, None]                 # [R, K, 1]
    tile_overhead = (tiles_f * tile_us)[:, :, None]
    inv_tiles = (f32(1.0) / np.maximum(tiles_f, f32(1.0)))[:, :, None]

    cs = np.arange(1, N, dtype=np.int64)[None, None, :]                       # [1, 1, C]
    kk = ks[None, :, None]                                                    # [1, K, 1]
    inv_bw, inv_lbw = inv_bw_curve[cs], inv_lbw_curve[cs]
    inv_rate = inv_rate_curve[N - cs]
    cs_f, kk_f = cs.astype(f32), kk.astype(f32)
    inv_ks = f32(1.0) / kk_f
    inv_capacity = f32(1.0) / ((N - cs) * kk).astype(f32)
    steal_den = f32(1.0) + cs_f * inv_capacity
    dispatch = remote_b * inv_bw + local_b * inv_lbw
    combine_c = dispatch + pairs_b * inv_lbw
    ratio = combine_all / (combine_c + f32(1e-12))
    work = tile_flops * inv_rate + tile_overhead
    tau_f = np.where(has_tiles, flops1 * inv_rate + (tile_us + f), f)
    a0 = dispatch * inv_ks + f
    use_steal = has_tiles & (policy == 0)
    mean_tile = work * inv_tiles
    slack = ((a0 - dispatch) + work * inv_capacity) + ((tau_f - f) - sigma)
    steal_den_all = np.where(use_steal, mean_tile * steal_den, f32(1.0))
    steal = np.floor(np.maximum(slack, f32(0.0)) / steal_den_all)
    steal_cap = (tiles_int[:, :, None] // cs).astype(f32)
    steal = np.where(use_steal, np.minimum(steal, steal_cap), f32(0.0))
    steal_us = steal * mean_tile
    g = (work - cs_f * steal_us) * inv_capacity
    comm_free = dispatch + (steal_us + sigma * (steal > 0).astype(f32))
    e0_f = (a0 + g) + tau_f
    e_last_f = (np.maximum(a0 + (kk_f - f32(1.0)) * g, dispatch + f) + g) + tau_f
    fc = np.maximum(np.maximum(comm_free, e0_f) + combine_c, e_last_f + combine_c * inv_ks)
    latency = (e_last_f + (fc - e_last_f) * ratio) + ((launch_us + f) + reduce_us)
    latency = latency + call_us
    assert latency.dtype == np.float32 and steal.dtype == np.float32

    t0 = flops0 * inv_rate_all + tile_us
    t1 = flops1 * inv_rate_all + tile_us
    serial_work = n0_f[:, 0] * t0 + n1_f[:, 0] * t1
    tau = np.where(has_tiles[:, 0, 0], t1, f32(0.0))
    dispatch_all = remote_b[:, 0, 0] * inv_bw_all + local_b[:, 0, 0] * inv_lbw_all
    combine_serial = remote_b[:, 0, 0] * inv_bw_all + combine_local_b[:, 0, 0] * inv_lbw_all
    serial = call_us + launch_us
    for term in (dispatch_all, f, sigma, (serial_work / f32(N)) * rho, tau * rho, f, combine_serial, f,
                 reduce_us[:, 0, 0]):
        serial = serial + term
    serial = serial.astype(f32)

    batch = sent.shape[0]
    if policy == 1:
        valid = np.broadcast_to((cs <= args["comm_sms_limit"]) & (kk == 1), latency.shape)
    elif policy == 2:
        valid = np.broadcast_to((cs == args["static_c"]) & (kk == args["static_k"]), latency.shape)
    elif policy == 3:
        bucket = np.zeros(batch, dtype=np.int64)
        for b in range(31):
            bucket += (1 << b) < num_tokens
        per_iteration_c = planner.per_iteration_c[bucket][:, None, None]
        valid = (cs == per_iteration_c) & (kk == 1)
    else:
        valid = np.broadcast_to(cs <= args["comm_sms_limit"], latency.shape)
    masked = np.where(valid, latency, f32(np.inf)).reshape(batch, -1)
    pick = np.argmin(masked, axis=1)
    best = masked[np.arange(batch), pick]
    num_c = N - 1
    out = np.empty((batch, 4), dtype=np.int32)
    out[:, 0] = pick % num_c + 1
    out[:, 1] = pick // num_c + 1
    out[:, 2] = steal.reshape(batch, -1)[np.arange(batch), pick].astype(np.int32)
    out[:, 3] = best.astype(np.float32).view(np.int32)
    if policy in (0, 4):
        use_serial = np.full(batch, True) if policy == 4 else serial < best
        out[use_serial, :3] = (N, 1, 0)
        out[use_serial, 3] = serial[use_serial].view(np.int32)
    return out
