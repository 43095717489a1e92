"""A discrete-event, tile-level simulation of one rank's megakernel for one layer.

What it models (the megakernel's contract; `weave_moe.plan.cost_model` is the closed-form shortcut it checks):
- Grid = N CTAs, one per SM. CTA index < c: comm role; else compute role. `serial` (c = N): every CTA dispatches,
  then runs GEMM tiles, then combines.
- Dispatch: the comm CTAs move each chunk's rows in chunk order (coarsened: one block per CTA per chunk, the chunk's
  bytes split evenly). Remote bytes go at the NVLink rate of c CTAs, local rows at the local-copy rate; peers are
  assumed to run the same schedule, so a chunk's incoming rows land when its outgoing rows are written (the larger
  of the two directions sets the time, NVLink being full duplex). Chunk j has arrived one flag round trip after its
  last block.
- GEMM tiles, each simulated individually, in one DAG-ordered queue: for chunk j = 0..K-1, GEMM0 tiles of chunk j
  (expert, M block, N block), then its GEMM1 tiles. A CTA that becomes free claims the next tile (atomic counter)
  and waits for its dependency: a GEMM0 tile for its chunk's arrival, a GEMM1 tile for every GEMM0 tile of the same
  (chunk, expert, M block) (its SiLU-mul h rows). Compute CTAs claim until the queue is empty; comm CTAs claim up to
  n_steal tiles right after dispatch (one role switch), then combine.
- Combine: chunk j is ready one flag round trip after its last GEMM1 tile. Its work (remote rows back to their
  source, weighted-sum reads of every GEMM row) is split into blocks claimed in chunk order. Comm CTAs start after
  their steal window; compute CTAs join after the queue empties (one role switch). A CTA's rate is the curve's rate
  for the number of CTAs in the combine role when the block's work starts, divided evenly.
- Final reduce: every CTA enters it when it has no combine block left, waits for the last combine block plus a flag
  round trip, then all N CTAs sum the rows of their share of the rank's tokens (local copy rate of N CTAs).
- Waits as the kernel records them: a task's event starts when its CTA claims it, waits until its dependency is met
  (`ready`), then works; a role switch is recorded as "spin" (outside tasks). So the simulated timeline splits into
  work, waiting, spin and idle exactly as a measured one (`weave_moe.sim.timeline.utilisation`).

Shape legend: N = SMs, c = comm CTAs, K = chunks.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from weave_moe.plan import HardwareProfile, Plan, Workload
from weave_moe.sim.timeline import (COMBINE, DISPATCH, GEMM0, GEMM1, SPIN, STOLEN, Timeline, Utilisation, UtilisationFigures,
                                     utilisation)

__all__ = ["simulate", "SimResult"]


@dataclass(frozen=True)
class SimResult(UtilisationFigures):
    """What one simulated layer did on one rank.

    Attributes:
        latency_us: kernel start (launch included) to the end of the final reduce.
        utilisation: work-based figures of the timeline (docs/utilisation.md); `sm_active` and `overlap` read it.
        timeline: every task each SM ran (claim, dependency met, end) and every role switch.
        arrival_us: [K] time chunk j had arrived.
        chunk_done_us: [K] time chunk j's GEMM1 tiles were all done.
        plan: the plan simulated.
    """

    latency_us: float
    utilisation: Utilisation
    timeline: Timeline
    arrival_us: np.ndarray
    chunk_done_us: np.ndarray
    plan: Plan


def simulate(workload: Workload, profile: HardwareProfile, plan: Plan, *, combine_blocks: int | None = None) -> SimResult:
    """Simulate `plan` for `workload` on `profile`'s GPU.

    Args:
        workload: one rank's layer (exact chunk counts are used when it has them for plan.K).
        profile: hardware curves and tile shape.
        plan: c, K, n_steal (c = N or policy "serial": all CTAs run each phase in turn).
        combine_blocks: blocks each chunk's combine is cut into (default N: enough for every CTA to help).

    Returns:
        SimResult; deterministic for the same inputs.
    """
    N = profile.num_sms
    serial = plan.is_serial(N)
    c = N if serial else int(plan.c)
    K = 1 if serial else int(plan.K)
    if not 1 <= c <= N or not 1 <= K:
        raise ValueError(f"plan has c={plan.c}, K={plan.K}; need 1 <= c <= {N}, K >= 1")
    f, sigma = profile.flag_round_trip_us, profile.role_switch_us
    row = float(workload.row_bytes)
    split = workload.chunk_split(K)
    events: list[tuple] = []   # (sm, kind, start, ready, end, chunk, group, stage): see Timeline
    record = events.append

    # ---- dispatch: one block per comm CTA per chunk, in chunk order ------------------------------------------------
    rate_remote = profile.comm_bytes_per_us[c] / c      # bytes/us of one CTA among c
    rate_local = profile.local_bytes_per_us[c] / c
    t = profile.launch_us
    arrival = np.empty(K)
    for j in range(K):
        remote = max(int(split.send_remote_rows[j]), int(split.recv_remote_rows[j])) * row / c
        local = int(split.local_rows[j]) * row / c
        duration = remote / rate_remote + local / rate_local
        if duration > 0:
            for sm in range(c):
                record((sm, DISPATCH, t, t, t + duration, j, -1, -1))
        t += duration
        arrival[j] = t + f
    dispatch_end = t

    # ---- GEMM tiles: list scheduling in DAG order == atomic claiming by whichever CTA is free first ---------------
    num_compute = N - c if not serial else N
    rate_gemm = profile.gemm_flops_per_us_per_sm[num_compute]
    t0 = profile.gemm0_tile_flops(workload.spec.hidden_size) / rate_gemm + profile.per_tile_overhead_us
    t1 = profile.gemm1_tile_flops(workload.spec.intermediate_size) / rate_gemm + profile.per_tile_overhead_us
    n_blocks0 = -(-workload.spec.intermediate_size // profile.block_n0)
    n_blocks1 = -(-workload.spec.hidden_size // profile.block_n1)
    budget = {}
    heap: list[tuple[float, int]] = []
    if serial:
        for sm in range(N):
            heap.append((dispatch_end + sigma, sm))
            budget[sm] = -1                     # unlimited
    else:
        for sm in range(c, N):
            heap.append((profile.launch_us, sm))
        if plan.n_steal > 0:
            for sm in range(c):
                heap.append((dispatch_end + sigma, sm))
                budget[sm] = int(plan.n_steal)
    if sigma > 0:
        for switch, sm in heap:
            if switch > profile.launch_us:      # dispatch -> GEMM role switch
                record((sm, SPIN, dispatch_end, switch, switch, -1, -1, -1))
    heapq.heapify(heap)
    comm_free = {sm: dispatch_end for sm in range(c)}
    chunk_done = arrival.copy()
    num_groups = 0
    heappop, heappush = heapq.heappop, heapq.heappush
    for j in range(K):
        m_blocks = (split.expert_rows[j] + profile.block_m - 1) // profile.block_m
        group_ready = []
        ready_j = arrival[j]
        first_group = num_groups
        for m_count in m_blocks.tolist():
            for _ in range(m_count):
                done = ready_j
                group = num_groups
                num_groups += 1
                for _ in range(n_blocks0):
                    free, sm = heappop(heap)
                    start = free if free > ready_j else ready_j
                    end = start + t0
                    record((sm, STOLEN if sm < c and not serial else GEMM0, free, start, end, j, group, 0))
                    if end > done:
                        done = end
                    _release(heap, budget, comm_free, sm, end, c, serial)
                group_ready.append(done)
        last = chunk_done[j]
        for group, ready in enumerate(group_ready, start=first_group):
            for _ in range(n_blocks1):
                free, sm = heappop(heap)
                start = free if free > ready else ready
                end = start + t1
                record((sm, STOLEN if sm < c and not serial else GEMM1, free, start, end, j, group, 1))
                if end > last:
                    last = end
                _release(heap, budget, comm_free, sm, end, c, serial)
        chunk_done[j] = last

    # ---- combine blocks ---------------------------------------------------------------------------------------------
    join = []                                           # (time the CTA enters the combine role, sm)
    for free, sm in heap:                              # CTAs still claiming when the queue ran dry
        if sm < c and not serial:
            comm_free[sm] = free
        else:
            join.append((free + sigma, sm))
            if sigma > 0:                              # GEMM -> combine role switch
                record((sm, SPIN, free, free + sigma, free + sigma, -1, -1, -1))
    join.extend((comm_free[sm], sm) for sm in range(c) if not serial)
    join.sort()
    join_times = [time for time, _ in join]
    heap = list(join)
    heapq.heapify(heap)
    blocks = combine_blocks or N
    for j in range(K):
        remote = max(int(split.send_remote_rows[j]), int(split.recv_remote_rows[j])) * row
        local = (int(split.expert_rows[j].sum()) + int(split.local_rows[j])) * row
        if remote + local == 0:
            continue
        ready = chunk_done[j] + f
        for _ in range(blocks):
            free, sm = heappop(heap)
            start = free if free > ready else ready
            active = bisect_right(join_times, start) or 1
            duration = (remote / blocks) / (profile.comm_bytes_per_us[active] / active) + (local / blocks) / (
                profile.local_bytes_per_us[active] / active)
            record((sm, COMBINE, free, start, start + duration, j, -1, -1))
            heappush(heap, (start + duration, sm))

    # ---- final reduce on all N CTAs ---------------------------------------------------------------------------------
    combine_end = max([time for time, _ in heap] + [float(chunk_done.max(initial=0.0)), dispatch_end])
    reduce_bytes = (workload.reduce_rows + workload.num_tokens) * row
    reduce_duration = (reduce_bytes / N) / (profile.local_bytes_per_us[N] / N)
    start = combine_end + f
    if reduce_duration > 0:
        entered = {sm: free for free, sm in heap}     # every CTA, when it ran out of combine blocks
        for sm in range(N):
            record((sm, COMBINE, min(entered.get(sm, start), start), start, start + reduce_duration, K, -1, -1))
    latency = start + reduce_duration

    timeline = Timeline.from_events(events, N)
    return SimResult(
        latency_us=float(latency),
        utilisation=utilisation(timeline),
        timeline=timeline,
        arrival_us=arrival,
        chunk_done_us=chunk_done,
        plan=plan,
    )


def _release(heap, budget, comm_free, sm, end, c, serial) -> None:
    """Put a CTA back in the claim queue, unless it is a comm CTA whose steal budget is spent."""
    if serial or sm >= c:
        heapq.heappush(heap, (end, sm))
        return
    budget[sm] -= 1
    if budget[sm] > 0:
        heapq.heappush(heap, (end, sm))
    else:
        comm_free[sm] = end  # the role switch was charged once, before the first stolen tile
