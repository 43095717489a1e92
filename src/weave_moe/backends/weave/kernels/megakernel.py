"""The persistent MoE megakernel: dispatch -> GEMM0 (+SiLU-mul) -> GEMM1 -> combine -> reduce in one launch.

Grid = number of SMs (one CTA each), launched cooperatively so that all CTAs are resident (a grid that cannot be
resident fails at launch instead of hanging). Each CTA walks a small state machine over phases:

    phase 0  dispatch   CTAs with index < C only: claim dispatch tasks (atomic counter), copy rows to the
                        destination's receive buffer, release-add the row count onto the destination's arrival flag
                        for (this source, chunk).
    phase 1  GEMM       compute CTAs until the queue is empty; comm CTAs for at most N_STEAL tiles ("bubble
                        stealing", right after dispatch). Tasks come in DAG order (GEMM0 of chunk c, then GEMM0 of
                        c+1, then GEMM1 of c, ...). GEMM0 waits for chunk c to have arrived from every source;
                        GEMM1 waits for all GEMM0 column tiles of its M tile.
    phase 2  combine    claim combine blocks in chunk order; wait for the chunk's GEMM1 tiles (in a launch that
                        also ran the GEMM phase; a combine launch starts after the GEMM launches have ended); write
                        the weighted sum over local experts to the source rank's combine buffer; release-add onto
                        its flag.
    phase 3  reduce     every CTA: wait for all destinations' combine rows, sum them per token into `out`.

Which phases a launch runs: with STAGE = -1 (compile-time) the phases PHASE_FIRST..PHASE_LAST (runtime; 0..3 for
the one-launch policies). With STAGE = s in 0..3 the launch runs phase s alone, exactly as PHASE_FIRST = PHASE_LAST = s
would, and only that phase's code is compiled in (PHASE_FIRST / PHASE_LAST are then ignored); STAGE = 4
(STAGE_COMBINE_REDUCE) runs phases 2 and 3 in one launch, as PHASE_FIRST = 2, PHASE_LAST = 3 would. The `serial`
policy runs its stages as such launches (dispatch, GEMMs, combine + reduce), so its dispatch and combine + reduce
launches hold none of the GEMM tiles' code, shared memory or register pressure (sm_90 figures:
tests/test_megakernel_cpu.py).

Buffers come from `weave_moe.backends.weave.workspace.SymmetricWorkspace`; peers are reached through `peer_base_ptr` (int64 base
address of every rank's symmetric buffer) plus byte offsets.
"""

import triton
import triton.language as tl

from weave_moe.backends.weave.kernels import sync, tiles
from weave_moe.backends.weave.kernels.peers import call_io_ptr, peer_ptr

# Control block (int32, local, zeroed every call): claim counters, then per-chunk GEMM1 counters, then per-M-tile
# GEMM0 counters.
# (tl.constexpr: Triton reads module globals only when they are compile-time constants.)
CTRL_DISPATCH = tl.constexpr(0)
CTRL_GEMM = tl.constexpr(1)
CTRL_COMBINE = tl.constexpr(2)
CTRL_REDUCE = tl.constexpr(3)
CTRL_GEMM1_DONE = tl.constexpr(8)    # [MAX_CHUNKS]
CTRL_GEMM0_DONE = tl.constexpr(16)   # [num M tiles]
# STAGE of the launch that runs the combine and reduce phases (2, 3) together (module docstring)
STAGE_COMBINE_REDUCE = tl.constexpr(4)
CTRL_SIZE_FIXED = 16
# ROW_ALIGNMENT (kernels/peers.py): the byte alignment of x, out and every region of the symmetric buffers
# Lanes of the reduce's poll of the destinations' combine flags, one per rank: >= EP (the backend allows EP <= 31, a
# token's destinations being one int32 bit mask)
RANK_LANES = tl.constexpr(32)

# Timeline (TIMELINE=True): int64 [grid, MAX_EVENTS, 4], one row per task a CTA ran, in order:
#     [kind (EVENT_*), start_ns (claimed), end_ns (done), ready_ns (its dependency wait ended; = start if none)]
# %globaltimer ns; unwritten rows stay zero; staged launches write stage s from row s * MAX_EVENTS // 4. Gaps between
# consecutive rows are the CTA claiming its next task or switching phase. Parsed by weave_moe.sim.measured.
EVENT_DISPATCH = tl.constexpr(0)
EVENT_GEMM0 = tl.constexpr(1)
EVENT_GEMM1 = tl.constexpr(2)
EVENT_COMBINE = tl.constexpr(3)
EVENT_REDUCE = tl.constexpr(4)
EVENT_STOLEN_GEMM0 = tl.constexpr(5)
EVENT_STOLEN_GEMM1 = tl.constexpr(6)
EVENT_NAMES = ("dispatch", "gemm0", "gemm1", "combine", "reduce", "stolen_gemm0", "stolen_gemm1")


@triton.jit
def _claim(counter_ptr, TIMELINE: tl.constexpr):
    """(next task index of a queue, the claim's %globaltimer when TIMELINE): one relaxed atomic per claim."""
    task = tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
    t_start = tl.full([], 0, tl.int64)
    if TIMELINE:
        t_start = sync.global_time_ns()
    return task, t_start


#: ONE_ROW_TASKS: in task tables of one row per task (a decode call's, KernelConfig.decode_stages) dispatch / combine
#: task j is row j of its table's rows (the rows are cut into blocks of one in segment order, layout.py and
#: kernels/tables_emit.py; tests/test_tables.py checks it on every such table). A launch compiled for one-row tasks
#: (DISPATCH_ROWS / COMBINE_ROWS == 1) therefore takes the row from the task index, so that the row's loads (its
#: token and slot; its pair positions, weights and token) do not wait for the task row's load: one dependent round
#: trip less per task on a decode call's chain. The task row still gives the destination or source and the chunk.


@triton.jit
def _take(counter_ptr, own, offset, num_tasks, OWN: tl.constexpr, TIMELINE: tl.constexpr):
    """(task, the take's %globaltimer when TIMELINE, own for the next take) of a queue of `num_tasks` tasks that every
    CTA of the launch works: `own` >= 0 is this CTA's first task (its index pid), taken without an atomic, and the
    queue's claims count from `offset` (the grid size) after them, so tasks [0, grid) go one to each CTA and the rest
    to whoever claims first; where there is no rest (num_tasks <= offset) a CTA's next take returns num_tasks (none
    left) without the claim's atomic either. `own` < 0 (and `offset` 0): every task from the queue, as `_claim`. The
    first task of a launch without GEMM then starts one atomic round trip (and the CTA barrier that broadcasts its
    result) earlier, and at decode sizes, where every task is a CTA's own, the CTA that did one goes on to the next
    phase (the dispatch launch's final wait, the reduce after a combine) one round trip earlier too. OWN False
    (a launch that never owns tasks: the one-launch kernel, the interpreter): `_claim` alone, none of the branches
    compiled (they cost the one-launch kernel 16 bytes more of spilled registers)."""
    if not OWN:
        task, t_start = _claim(counter_ptr, TIMELINE)
    else:
        t_start = tl.full([], 0, tl.int64)
        if own >= 0:
            task = own
            if TIMELINE:
                t_start = sync.global_time_ns()
        elif num_tasks <= offset:
            task = num_tasks
            if TIMELINE:
                t_start = sync.global_time_ns()
        else:
            task, t_start = _claim(counter_ptr, TIMELINE)
            task += offset
    return task, t_start, tl.full([], -1, tl.int32)


@triton.jit
def _prefetch_l1(pointer):
    """Start bringing the line at `pointer` into this SM's L1 (`prefetch.global.L1`), so that a load of it issued
    later, behind an instruction that waits for other data, finds it there or on its way. Nothing under the
    interpreter."""
    if not sync.INTERPRETER:
        tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [pointer], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _task_row(tasks_ptr, task):
    """The four int32 columns of a dispatch or combine task (layout.DISPATCH_COLUMNS / COMBINE_COLUMNS)."""
    row = tasks_ptr + task * 4
    return tl.load(row + 0), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)


@triton.jit
def _record(timeline_ptr, pid, num_events, kind, t_start, t_ready, MAX_EVENTS: tl.constexpr):
    if num_events < MAX_EVENTS:
        event = timeline_ptr + (pid.to(tl.int64) * MAX_EVENTS + num_events) * 4
        tl.store(event, tl.full([], 0, tl.int64) + kind)
        tl.store(event + 1, t_start)
        tl.store(event + 2, sync.global_time_ns())
        tl.store(event + 3, t_ready)
    return num_events + 1


@triton.jit
def _wait_chunk_arrived(arrival_ptr, arrival_expected_ptr, status_ptr, chunk, world_size, timeout_ns,
                        MAX_CHUNKS: tl.constexpr):
    """Wait (bounded) until every source's dispatch rows of `chunk` have arrived; 1 if they did, 0 on a timeout."""
    ok = 1
    for source in range(0, world_size):
        expected = tl.load(arrival_expected_ptr + source * MAX_CHUNKS + chunk)
        ok = ok & sync.wait_at_least(arrival_ptr + source * MAX_CHUNKS + chunk, expected, status_ptr,
                                     sync.ERROR_ARRIVAL_TIMEOUT, source * 16 + chunk, timeout_ns, True)
    return ok


@triton.jit(do_not_specialize=["rank", "world_size", "num_tokens", "num_comm_ctas", "num_steal", "PHASE_FIRST",
                              "PHASE_LAST", "recv_offset", "comb_offset", "flags_offset", "timeout_ns"])
def moe_megakernel(
    # activations and weights
    x_ptr, out_ptr, w13_ptr, w2_ptr,
    # local work buffers
    recv_ptr, h_ptr, y_ptr, comb_ptr,
    # symmetric addressing: peer bases + byte offsets of this call's regions
    peer_base_ptr, recv_offset, comb_offset, flags_offset,
    arrival_ptr, comb_flag_ptr,
    # control and status
    ctrl_ptr, status_ptr, meta_ptr, plan_ptr, io_ptr, tokens_ptr, timeline_ptr,
    # task tables (weave_moe.backends.weave.layout)
    dispatch_tasks_ptr, send_token_ptr, send_slot_ptr,
    gemm_tasks_ptr, gather_ptr, arrival_expected_ptr, gemm1_expected_ptr,
    combine_tasks_ptr, combine_token_ptr, combine_pos_ptr, combine_weight_ptr,
    token_mask_ptr, combine_expected_ptr,
    # scalars
    rank, world_size, max_tokens, num_tokens, H, I,
    num_comm_ctas, num_steal, timeout_ns, PHASE_FIRST, PHASE_LAST,
    # compile-time
    TOP_K: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N0: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K: tl.constexpr,
    DISPATCH_ROWS: tl.constexpr, COMBINE_ROWS: tl.constexpr, REDUCE_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_FP32: tl.constexpr, TIMELINE: tl.constexpr, MAX_EVENTS: tl.constexpr,
    STAGES0: tl.constexpr = 3, STAGES1: tl.constexpr = 4, BLOCK_K1: tl.constexpr = 64,
    # TMA (KernelConfig.tma): host-built tensor descriptors of w13 [E_local*2I, H] and w2 [E_local*H, I]
    w13_desc=None, w2_desc=None, USE_TMA: tl.constexpr = False,
    # the device-resident call (KernelConfig.resident): what the host would pass per call is read from the device, so
    # one captured launch serves every call: the plan (`plan_ptr` [EP, 4]: c, K, n_steal, predicted; c >= grid is the
    # serial schedule in this launch), the addresses of x and out (`io_ptr` [2] int64) and T (`tokens_ptr`, the token
    # count word of this rank's routing message)
    RESIDENT: tl.constexpr = False,
    # -1: phases PHASE_FIRST..PHASE_LAST; 0..3: that phase alone, the other phases not compiled in; 4: phases 2 and 3
    # (module docstring)
    STAGE: tl.constexpr = -1,
    # w13 with gate row j at row 2j and up row j at 2j + 1 (the grouped GEMMs' layout; tiles.gemm0_tile INTERLEAVED)
    W13_INTERLEAVED: tl.constexpr = False,
    # GEMM0 tiles as one MMA over the interleaved w13's 2 * BLOCK_N0 rows (KernelConfig.wide_gemm0; tiles.gemm0_tile)
    WIDE_GEMM0: tl.constexpr = False,
    # a resident launch of an adaptive layer whose serial plans run their GEMMs as the grouped GEMMs between stage
    # launches (backend.py, _stages): with a serial plan the STAGE -1 launch runs the dispatch only and the STAGE 4
    # launch (combine + reduce) runs; with any other plan the STAGE -1 launch runs every phase and the STAGE 4 launch
    # does nothing
    GROUPED_SERIAL: tl.constexpr = False,
    # the row copies in 16-byte vectors (x, out and the peers' regions declared ROW_ALIGNMENT-aligned) and the
    # dispatch's steps pipelined in the launches without GEMM (KernelConfig.vector_rows)
    VECTOR_ROWS: tl.constexpr = True,
):
    sync.pdl_enter()
    pid = tl.program_id(0)
    if RESIDENT:
        x_ptr = call_io_ptr(io_ptr, 0, VECTOR_ROWS)
        out_ptr = call_io_ptr(io_ptr, 1, VECTOR_ROWS)
        num_tokens = tl.load(tokens_ptr)
        planned_c = tl.load(plan_ptr + rank * 4)
        serial = planned_c >= tl.num_programs(0)
        num_comm_ctas = tl.where(serial, tl.num_programs(0), planned_c)
        num_steal = tl.where(serial, 1 << 30, tl.load(plan_ptr + rank * 4 + 2))
    # the task counts, loaded before the status word's read (an atomic, broadcast through a CTA barrier that later
    # loads do not pass), so that both are in flight at once
    num_dispatch = tl.load(meta_ptr + 0)
    num_gemm = tl.load(meta_ptr + 1)
    num_combine = tl.load(meta_ptr + 2)
    num_reduce = tl.load(meta_ptr + 3)
    if STAGE >= 0:
        # a row task reads its peer's base address right after its task row (it needs the task's peer): from L1
        # then, not one more L2 round trip (the bases of 16 ranks per 128-byte line)
        _prefetch_l1(peer_base_ptr)
        if world_size > 16:
            _prefetch_l1(peer_base_ptr + 16)
    # A call refused before its kernel (sync.py: rejections) or a layer whose earlier kernel failed: no work, and the
    # output (in the launch that writes it) is NaN. The status word is read with an atomic: the same in every thread.
    refused = sync.status_set(status_ptr)
    n0_tiles = tl.cdiv(I, BLOCK_N0)
    # the phases of this launch; compile-time when STAGE >= 0 (so the reduce stage's refusal branch is static too)
    if STAGE == STAGE_COMBINE_REDUCE:
        first_phase: tl.constexpr = 2
        last_phase: tl.constexpr = 3
    elif STAGE >= 0:
        first_phase: tl.constexpr = STAGE
        last_phase: tl.constexpr = STAGE
    else:
        first_phase = PHASE_FIRST
        last_phase = PHASE_LAST
        if GROUPED_SERIAL:
            last_phase = tl.where(serial, 0, last_phase)
    # the phases whose code this launch compiles (each branch of the state machine below tests its own)
    RUN_DISPATCH: tl.constexpr = STAGE < 0 or STAGE == 0
    RUN_GEMM: tl.constexpr = STAGE < 0 or STAGE == 1
    RUN_COMBINE: tl.constexpr = STAGE < 0 or STAGE == 2 or STAGE == STAGE_COMBINE_REDUCE
    RUN_REDUCE: tl.constexpr = STAGE < 0 or STAGE == 3 or STAGE == STAGE_COMBINE_REDUCE
    is_comm = pid < num_comm_ctas
    phase = tl.where(is_comm, 0, 1)
    phase = tl.maximum(phase, first_phase)
    budget = tl.where(is_comm, num_steal, 1 << 30)
    arrived_chunks = 0        # bit c set: chunk c has arrived from every source (seen by this CTA)
    combinable_chunks = 0     # bit c set: chunk c's GEMM1 tiles are all done
    all_combined = 0
    # staged launches (serial) write each stage into its own quarter of the CTA's event rows
    num_events = first_phase * (MAX_EVENTS // 4)
    is_stealer = is_comm & (num_comm_ctas < tl.num_programs(0))
    if refused != 0:
        phase = last_phase + 1
        if last_phase == 3:
            for first_row in range(pid * REDUCE_ROWS, num_tokens, tl.num_programs(0) * REDUCE_ROWS):
                tiles.poison_rows(out_ptr, first_row, tl.minimum(num_tokens - first_row, REDUCE_ROWS), H, REDUCE_ROWS,
                                  BLOCK_H)
    if GROUPED_SERIAL and STAGE >= 0:
        phase = tl.where(serial, phase, last_phase + 1)   # another plan: the STAGE -1 launch did every phase
    # first tasks without the queue's atomic (`_take`) in a launch without GEMM, for the phases every CTA of it runs:
    # the combine and reduce always, the dispatch under a serial plan (every CTA a communication CTA). Not under the
    # interpreter, which runs the programs one after another: the first would wait (end of the dispatch, reduce) for
    # tasks that later programs own; there every task comes from the queues, as in the one-launch kernel
    grid = tl.num_programs(0)
    own_dispatch = tl.full([], -1, tl.int32)
    own_combine = tl.full([], -1, tl.int32)
    own_reduce = tl.full([], -1, tl.int32)
    OWN_TASKS: tl.constexpr = STAGE >= 0 and not sync.INTERPRETER
    if OWN_TASKS:
        own_dispatch = tl.where(num_comm_ctas >= grid, pid, -1)
        own_combine = pid
        own_reduce = pid
    dispatch_offset = tl.where(own_dispatch >= 0, grid, 0)
    combine_offset = tl.where(own_combine >= 0, grid, 0)
    reduce_offset = tl.where(own_reduce >= 0, grid, 0)
    while phase <= last_phase:
        if RUN_DISPATCH and phase == 0:
            task, t_start, own_dispatch = _take(ctrl_ptr + CTRL_DISPATCH, own_dispatch, dispatch_offset, num_dispatch,
                                                OWN_TASKS, TIMELINE)
            if task < num_dispatch:
                dest, chunk, start, count = _task_row(dispatch_tasks_ptr, task)
                if DISPATCH_ROWS == 1:   # one row per task (ONE_ROW_TASKS): task j is row j
                    start = task
                    count = 1
                dst = (peer_ptr(peer_base_ptr, dest, recv_offset, tl.bfloat16, VECTOR_ROWS)
                       + rank.to(tl.int64) * max_tokens * H)
                tiles.dispatch_rows(x_ptr, dst, send_token_ptr, send_slot_ptr, start, count, H,
                                    DISPATCH_ROWS, BLOCK_H, PIPELINED=VECTOR_ROWS and not RUN_GEMM)
                flag = peer_ptr(peer_base_ptr, dest, flags_offset, tl.int32) + rank * MAX_CHUNKS + chunk
                sync.signal_add(flag, count, True)
                if TIMELINE:
                    num_events = _record(timeline_ptr, pid, num_events, EVENT_DISPATCH, t_start, t_start, MAX_EVENTS)
            else:
                phase = 1
        elif RUN_GEMM and phase == 1:
            task = num_gemm
            if budget > 0:
                task = tl.atomic_add(ctrl_ptr + CTRL_GEMM, 1, sem="relaxed", scope="gpu")
            if task < num_gemm:
                if TIMELINE:
                    t_start = sync.global_time_ns()
                budget -= 1
                row = gemm_tasks_ptr + task * 8
                kind = tl.load(row + 0)
                chunk = tl.load(row + 1)
                expert = tl.load(row + 2)
                row_start = tl.load(row + 3)
                num_rows = tl.load(row + 4)
                n_start = tl.load(row + 5)
                mtile = tl.load(row + 6)
                if kind == 0:
                    if ((arrived_chunks >> chunk) & 1) == 0:
                        if _wait_chunk_arrived(arrival_ptr, arrival_expected_ptr, status_ptr, chunk, world_size,
                                               timeout_ns, MAX_CHUNKS) != 0:
                            arrived_chunks = arrived_chunks | (1 << chunk)
                    if TIMELINE:
                        t_ready = sync.global_time_ns()
                    tiles.gemm0_tile(recv_ptr, gather_ptr, w13_ptr, h_ptr, expert, row_start, num_rows, n_start,
                                     H, I, BLOCK_M, BLOCK_N0, BLOCK_K, DOT_FP32, STAGES0, w13_desc, USE_TMA,
                                     W13_INTERLEAVED, WIDE_GEMM0)
                    sync.signal_add(ctrl_ptr + CTRL_GEMM0_DONE + mtile, 1, False)
                    if TIMELINE:
                        num_events = _record(timeline_ptr, pid, num_events,
                                             tl.where(is_stealer, EVENT_STOLEN_GEMM0, EVENT_GEMM0), t_start, t_ready,
                                             MAX_EVENTS)
                else:
                    sync.wait_at_least(ctrl_ptr + CTRL_GEMM0_DONE + mtile, n0_tiles, status_ptr,
                                       sync.ERROR_GEMM0_TIMEOUT, mtile, timeout_ns, False)
                    if TIMELINE:
                        t_ready = sync.global_time_ns()
                    tiles.gemm1_tile(h_ptr, w2_ptr, y_ptr, expert, row_start, num_rows, n_start, H, I,
                                     BLOCK_M, BLOCK_N1, BLOCK_K1, DOT_FP32, STAGES1, w2_desc, USE_TMA)
                    sync.signal_add(ctrl_ptr + CTRL_GEMM1_DONE + chunk, 1, False)
                    if TIMELINE:
                        num_events = _record(timeline_ptr, pid, num_events,
                                             tl.where(is_stealer, EVENT_STOLEN_GEMM1, EVENT_GEMM1), t_start, t_ready,
                                             MAX_EVENTS)
            else:
                phase = 2
        elif RUN_COMBINE and phase == 2:
            task, t_start, own_combine = _take(ctrl_ptr + CTRL_COMBINE, own_combine, combine_offset, num_combine,
                                               OWN_TASKS, TIMELINE)
            if task < num_combine:
                if COMBINE_ROWS == 1:
                    # the row's token, pair positions and weights (ONE_ROW_TASKS: task j is row j) are on their way
                    # before the task row's source is used: the destination's address, computed first, would
                    # otherwise hold their loads back until the task row arrived (in-order issue; sm_90 SASS)
                    _prefetch_l1(combine_token_ptr + task)
                    _prefetch_l1(combine_pos_ptr + task * TOP_K)
                    _prefetch_l1(combine_weight_ptr + task * TOP_K)
                source, chunk, start, count = _task_row(combine_tasks_ptr, task)
                if COMBINE_ROWS == 1:   # one row per task (ONE_ROW_TASKS): task j is row j
                    start = task
                    count = 1
                # a launch without the GEMM phase (STAGE 2, 4) runs after the launches that did the GEMMs, which its
                # first statement waited for (sync.pdl_enter): their tiles are done and y is visible, so only the
                # one-launch kernel waits for a chunk's GEMM1 tiles (one acquire round trip less on the chain of a
                # decode call's combine)
                if STAGE < 0:
                    if ((combinable_chunks >> chunk) & 1) == 0:
                        expected = tl.load(gemm1_expected_ptr + chunk)
                        if sync.wait_at_least(ctrl_ptr + CTRL_GEMM1_DONE + chunk, expected, status_ptr,
                                              sync.ERROR_GEMM1_TIMEOUT, chunk, timeout_ns, False) != 0:
                            combinable_chunks = combinable_chunks | (1 << chunk)
                if TIMELINE:
                    t_ready = sync.global_time_ns()
                dst = (peer_ptr(peer_base_ptr, source, comb_offset, tl.bfloat16, VECTOR_ROWS)
                       + rank.to(tl.int64) * max_tokens * H)
                tiles.combine_rows(y_ptr, combine_pos_ptr, combine_weight_ptr, combine_token_ptr, dst, start, count,
                                   H, TOP_K, COMBINE_ROWS, BLOCK_H)
                flag = peer_ptr(peer_base_ptr, source, flags_offset, tl.int32) + world_size * MAX_CHUNKS + rank
                sync.signal_add(flag, count, True)
                if TIMELINE:
                    num_events = _record(timeline_ptr, pid, num_events, EVENT_COMBINE, t_start, t_ready, MAX_EVENTS)
            else:
                phase = 3
        elif RUN_REDUCE:  # phase 3
            task, t_start, own_reduce = _take(ctrl_ptr + CTRL_REDUCE, own_reduce, reduce_offset, num_reduce,
                                              OWN_TASKS, TIMELINE)
            if task < num_reduce:
                if all_combined == 0:
                    if STAGE >= 0:   # every destination's flag at once: one round of atomics per poll, not EP
                        all_combined = sync.wait_all_at_least(comb_flag_ptr, combine_expected_ptr, world_size,
                                                              status_ptr, sync.ERROR_COMBINE_TIMEOUT, 0, timeout_ns,
                                                              RANK_LANES, True)
                    else:            # one after another (the vector poll's lanes spilled the one-launch kernel)
                        ok = 1
                        for dest in range(0, world_size):
                            expected = tl.load(combine_expected_ptr + dest)
                            ok = ok & sync.wait_at_least(comb_flag_ptr + dest, expected, status_ptr,
                                                         sync.ERROR_COMBINE_TIMEOUT, dest, timeout_ns, True)
                        all_combined = ok
                if TIMELINE:
                    t_ready = sync.global_time_ns()
                start = task * REDUCE_ROWS
                count = tl.minimum(num_tokens - start, REDUCE_ROWS)
                tiles.reduce_rows(comb_ptr, token_mask_ptr, out_ptr, start, count, H, max_tokens, world_size,
                                  REDUCE_ROWS, BLOCK_H)
                if TIMELINE:
                    num_events = _record(timeline_ptr, pid, num_events, EVENT_REDUCE, t_start, t_ready, MAX_EVENTS)
            else:
                phase = 4
    # A launch that ends after the dispatch (STAGE 0; a GROUPED_SERIAL first launch under a serial plan) is followed by
    # launches that read the receive buffer without waiting for the peers' rows (the grouped GEMMs' row gather; STAGE
    # 1's tiles wait themselves, harmlessly twice): such a launch ends only once every row has arrived. One program
    # waits; the kernel boundary orders the next launch's reads after its acquire.
    # The counters are polled at once (sync.wait_all_at_least: one round of atomics, not one per flag): in the dispatch
    # launch every source's chunks, in the one-launch kernel each source's; a timeout's flag tag is source * 16 +
    # chunk either way, as `_wait_chunk_arrived` names it.
    if STAGE == 0 or (GROUPED_SERIAL and STAGE < 0):
        if (pid == 0) & (last_phase == 0):
            if STAGE == 0:   # every source's counters in one poll (their [source, chunk] words are contiguous)
                sync.wait_all_at_least(arrival_ptr, arrival_expected_ptr, world_size * MAX_CHUNKS, status_ptr,
                                       sync.ERROR_ARRIVAL_TIMEOUT, 0, timeout_ns, RANK_LANES * MAX_CHUNKS, True,
                                       GROUP=MAX_CHUNKS)
            else:            # the one-launch kernel: a source at a time (fewer lanes live beside its GEMM code)
                for source in range(0, world_size):
                    sync.wait_all_at_least(arrival_ptr + source * MAX_CHUNKS,
                                           arrival_expected_ptr + source * MAX_CHUNKS, MAX_CHUNKS, status_ptr,
                                           sync.ERROR_ARRIVAL_TIMEOUT, source * 16, timeout_ns, MAX_CHUNKS, True)
