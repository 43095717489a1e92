"""The counts vector of the gathered routing messages, and the resident call's verdict, as one Triton launch.

Same inputs and outputs as `exchange.CountsFormat.build` followed (with VERDICT) by `CountsFormat.verdict`: the same
integers in every word of the counts vector, the same in-place replacement of ids outside [-1, E) by -1, the same
status word (tests/test_counts.py compares them bit for bit under the interpreter). Every offset comes from
`CountsFormat` and `RoutingMessage`; the kernel keeps no copy of either layout.

Shape legend: EP ranks, T_max = max_tokens_per_rank, k = top_k, KP = k padded to a power of 2, E experts,
E_local = E / EP.

Work split. Rank s's ids [T_max, k] are cut into blocks of BLOCK_T tokens; item s * blocks_per_rank + b is block b
of rank s. P programs (at most MAX_PROGRAMS) take items p, p + P, ... Per block, a program
  - counts the ids outside [-1, E) and stores -1 over them (in `messages`),
  - bins the remaining ids >= 0 over the experts (`tl.histogram`): pairs per expert,
  - counts, for each destination d, the tokens with at least one expert on d (rank d hosts experts
    [d * E_local, (d + 1) * E_local)): rows sent from s to d, a token counted once per destination (the dedup of
    `exchange.hit_matrix`), through a per-token bit mask of destinations (EP <= 31, as the backend requires).
Every block covers all T_max rows of a rank, as `build` does: rows past a rank's T hold -1 and count nothing.

Finishing without a second launch. A program keeps its sums in registers over its items, adds the non-zero ones into
`scratch` (the counts vector's send / pairs / bad-id fields, at their own offsets) with relaxed atomics, and counts
itself on the ticket word after them (`sync.arrive`: CTA barrier, then acq_rel, so its atomics are released). The
program that draws the last ticket has acquired every other program's sums; it reads them with atomic exchanges
against 0, which also leaves the scratch zero for the next launch (no memset launch, nothing to zero on the host),
resets the ticket, and writes the whole counts vector: tokens and headers copied from the messages, the sums, and the
status word as it was before this launch. Integer sums do not depend on the order of the atomics, so the result is
deterministic. With VERDICT it then writes the rejection into the status word (first error stays). A grid of one
program (EP * T_max * KP <= BLOCK_IDS: a decode layer at EP = 1) skips the scratch and the ticket, its sums being the
totals: on a decode call's chain that is the ticket's barrier and acq_rel round trip and the exchanges' round trip.
What the last program copies unchanged (tokens, headers, the status word) every program loads at its start, beside
its ids, so that those loads are not one more round trip after the ticket.

Planning in the same launch (`DeviceCounts(planner=...)`, KernelConfig.fused_planner). The last program, having
written the counts vector, evaluates the device planner (kernels/planner.py, `plan_rank`) for every rank from it, after
a CTA barrier that makes its threads' stores visible to each other: the plans land where the planner's own launch
would write them, one kernel earlier in the call's chain. Its ranks are planned one after another in that program
(the planner's own launch plans them side by side, one program each). Compiled without fused multiply-adds, as the
planner's launch is (the counts are integers: nothing else changes), so the plans equal `planner_mirror.mirror`'s bit
for bit.

Tile tables in the same launch (`build(tiles=)`, KernelConfig.chain_pairs). The last program, having written the
counts vector, builds the grouped GEMMs' tile tables of this rank's experts from its pairs per expert
(`grouped_tiles.tile_table_from_counts`, what `fill_tile_tables(form="counts")` writes as its own launch), after the
same CTA barrier: a paired decode call's GEMM0 can then read them before it waits for the pair dispatch between
them (kernels/ws_ring.py, "Chained launches": this launch ended before that one's CTAs passed their wait).

Why a grid: one program looping over EP * T_max * k ids (up to 2 M at EP 8, T_max 16384, k 16) would run one load
round trip per block in series; P programs run them side by side and the last program adds ~1 round trip of
atomics. No program waits for another, so the grid need not be resident at once.

No host sync, static shapes: the launch is captured in the resident call's CUDA graph and in the host-driven call's
counts graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weave_moe.backends.coordination import HEADER_CALL_WORD, HEADER_CODE_WORD, HEADER_WORDS
from weave_moe.backends.weave.kernels import sync
from weave_moe.backends.weave.kernels.grouped_tiles import tile_table_from_counts
from weave_moe.backends.weave.kernels.planner import POLICY_ARGS, DevicePlanner, plan_rank

__all__ = ["DeviceCounts", "counts_kernel", "compile_counts_ptx", "MAX_PROGRAMS"]

#: Programs of the grid at most: ~2 per SM of an H200 (132 SMs). More programs shorten each program's chain of
#: blocks; fewer cut the atomics into the scratch (each program adds up to E + EP^2 + EP words).
MAX_PROGRAMS = 256
#: ids per block (BLOCK_T tokens x KP slots): 16 per thread at 4 warps
BLOCK_IDS = 2048
NUM_WARPS = 4
#: tile-table entries the last program writes per step (`build(tiles=)`): [TILE_BLOCK, E_local] per step
TILE_BLOCK = tl.constexpr(32)

_CALL_WORD = tl.constexpr(HEADER_CALL_WORD)
_CODE_WORD = tl.constexpr(HEADER_CODE_WORD)
_REJECT_BAD_IDS = tl.constexpr(sync.REJECT_BAD_IDS)
_REJECT_PEER_FAILED = tl.constexpr(sync.REJECT_PEER_FAILED)
_REJECT_CALL_ORDER = tl.constexpr(sync.REJECT_CALL_ORDER)
_REJECTION_WORDS = tl.constexpr(4)   # [code, rank at fault, detail, this rank's call number] (kernels/sync.py)


@triton.jit
def _count_block(messages_ptr, item, blocks_per_rank, words, max_tokens, num_experts, num_local_experts, world_size,
                 K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    """Block `item`: (source rank, pairs per expert [BLOCK_E], rows sent per destination [BLOCK_P], bad ids); the
    bad ids are replaced by -1 in `messages`."""
    source = item // blocks_per_rank
    t = (item % blocks_per_rank) * BLOCK_T + tl.arange(0, BLOCK_T)
    jj = tl.arange(0, KP)
    in_range = (t[:, None] < max_tokens) & (jj[None, :] < K)
    ids_ptr = messages_ptr + source.to(tl.int64) * words + t[:, None] * K + jj[None, :]
    ids = tl.load(ids_ptr, mask=in_range, other=-1)
    bad = in_range & ((ids < -1) | (ids >= num_experts))
    tl.store(ids_ptr, tl.full([BLOCK_T, KP], -1, tl.int32), mask=bad)
    ids = tl.where(bad, -1, ids)
    routed = ids >= 0
    pairs = tl.histogram(tl.reshape(ids, [BLOCK_T * KP]), BLOCK_E, mask=tl.reshape(routed, [BLOCK_T * KP]))
    owner = tl.where(routed, ids // num_local_experts, -1)
    # bit d of a token's mask: it has an expert on rank d. One max along the token's slots per destination (within a
    # warp), then one reduction over the block's tokens for every destination at once.
    destinations = tl.zeros([BLOCK_T], dtype=tl.int32)
    for dest in range(0, world_size):
        destinations |= tl.max((owner == dest).to(tl.int32), axis=1) << dest
    pp = tl.arange(0, BLOCK_P)
    rows = tl.sum((destinations[:, None] >> pp[None, :]) & 1, axis=0)                     # [BLOCK_P]
    num_bad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
    return source, pairs, rows, num_bad


@triton.jit
def _verdict(status_ptr, headers, status, bad, rank, world_size,
             HEADER_WORDS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_STATUS: tl.constexpr):
    """`CountsFormat.verdict`: the rejection of the lowest rank at fault (a failed rank, else one at another call,
    else one that sent bad ids) into the status word, unless it already holds an error. `headers` [BLOCK_P,
    BLOCK_H]: every rank's header (this rank's among them: picked out in registers, not loaded again)."""
    pp = tl.arange(0, BLOCK_P)
    hh = tl.arange(0, BLOCK_H)
    ww = tl.arange(0, BLOCK_STATUS)
    mine = tl.sum(tl.where((pp == rank)[:, None] & (hh < HEADER_WORDS)[None, :], headers, 0), axis=0)
    code_word = tl.sum(tl.where(hh[None, :] == _CODE_WORD, headers, 0), axis=1)                   # [BLOCK_P]
    call_word = tl.sum(tl.where(hh[None, :] == _CALL_WORD, headers, 0), axis=1)
    differs = (hh[None, :] < _CODE_WORD) & (headers != mine[None, :])
    other_call = tl.sum(differs.to(tl.int32), axis=1) > 0
    failed = code_word != 0
    codes = tl.where(failed, _REJECT_PEER_FAILED,
                     tl.where(other_call, _REJECT_CALL_ORDER, tl.where(bad > 0, _REJECT_BAD_IDS, 0)))
    codes = tl.where(pp < world_size, codes, 0)
    details = tl.where(failed, code_word, tl.where(other_call, call_word, bad))
    first = tl.min(tl.where(codes != 0, pp, BLOCK_P), axis=0)
    first = tl.where(first < BLOCK_P, first, 0)
    code = tl.sum(tl.where(pp == first, codes, 0), axis=0)
    detail = tl.sum(tl.where(pp == first, details, 0), axis=0)
    my_call = tl.sum(tl.where(hh == _CALL_WORD, mine, 0), axis=0)
    rejection = tl.where(ww == 0, code, tl.where(ww == 1, first, tl.where(ww == 2, detail, my_call)))
    no_error_yet = tl.sum(tl.where(ww == 0, status, 0), axis=0) == 0
    tl.store(status_ptr + ww, rejection, mask=(ww < _REJECTION_WORDS) & no_error_yet & (code != 0))


@triton.jit(do_not_specialize=["rank"])
def counts_kernel(messages_ptr, status_ptr, scratch_ptr, counts_ptr, plans_ptr, model_ptr, per_iteration_ptr, rank,
                  world_size, words, max_tokens, num_experts, num_local_experts, blocks_per_rank, tokens_word,
                  header_word, tokens_offset, send_rows_offset, expert_pairs_offset, bad_ids_offset, headers_offset,
                  status_offset, status_words, num_sms, comm_sms_limit, n0_per_mtile, n1_per_mtile, static_c,
                  static_k, table0_ptr, num_tiles0_ptr, max_tiles0, table1_ptr, num_tiles1_ptr, max_tiles1,
                  K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_P: tl.constexpr, HEADER_WORDS: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_STATUS: tl.constexpr, VERDICT: tl.constexpr, PLAN: tl.constexpr, POLICY: tl.constexpr,
                  BLOCK_LOCAL_E: tl.constexpr, BLOCK_C: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                  BLOCK_M: tl.constexpr, TILE_KINDS: tl.constexpr, TILE_M0: tl.constexpr, TILE_TAIL0: tl.constexpr,
                  TILE_M1: tl.constexpr, TILE_TAIL1: tl.constexpr, TILE_E: tl.constexpr):
    """The counts vector (module docstring), with PLAN every rank's plan, and with TILE_KINDS 1 or 2 the tile tables
    of this rank's experts (module docstring, "Tile tables in the same launch").

    Args:
        messages_ptr: int32 [EP, words] gathered routing messages (`RoutingMessage`); bad ids become -1 in place.
        status_ptr: int32 [status_words] status word (kernels/sync.py); copied into the counts, then (VERDICT) the
            rejection, if any and the word holds no error yet.
        scratch_ptr: int32 [headers_offset + 1], zero before the launch and left zero after it (the counts vector's
            send / pairs / bad-id fields, then the ticket).
        counts_ptr: int32 [CountsFormat.size] output.
        rank: this rank (whose header the others must match).
        blocks_per_rank: ceil(T_max / BLOCK_T).
        tokens_word, header_word: `RoutingMessage` positions; *_offset: `CountsFormat` offsets.
        plans_ptr, model_ptr, per_iteration_ptr: with PLAN, the planner's output (int32 [EP, 4]) and tables
            (`DevicePlanner.tables`); num_sms .. static_k and POLICY .. BLOCK_M: its `policy_args()` and
            `constants()`. Not read without PLAN.
        table0_ptr .. max_tiles1: with TILE_KINDS, the `grouped_tiles.TileTable` buffers of the first and second
            tile kind (TILE_M0 / TILE_TAIL0: its block_m and split_tail; TILE_E: E_local as a power of two). Not read
            without it.
    """
    sync.pdl_enter()
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    pp = tl.arange(0, BLOCK_P)
    ee = tl.arange(0, BLOCK_E)
    hh = tl.arange(0, BLOCK_H)
    ww = tl.arange(0, BLOCK_STATUS)
    live = pp < world_size
    # what the last program copies into the counts vector and no program changes (the tokens and header words of the
    # messages, the status word), loaded by every program at its start beside its ids, not after its ticket
    message_ptr = messages_ptr + pp.to(tl.int64) * words
    tokens = tl.load(message_ptr + tokens_word, mask=live, other=0)
    headers_ok = live[:, None] & (hh[None, :] < HEADER_WORDS)
    headers = tl.load(message_ptr[:, None] + header_word + hh[None, :], mask=headers_ok, other=0)
    status = tl.load(status_ptr + ww, mask=ww < status_words, other=0)
    pairs = tl.zeros([BLOCK_E], dtype=tl.int32)
    rows = tl.zeros([BLOCK_P, BLOCK_P], dtype=tl.int32)                                  # [source, destination]
    bad = tl.zeros([BLOCK_P], dtype=tl.int32)
    for item in range(pid, world_size * blocks_per_rank, num_programs):
        source, block_pairs, block_rows, block_bad = _count_block(
            messages_ptr, item, blocks_per_rank, words, max_tokens, num_experts, num_local_experts, world_size, K, KP,
            BLOCK_T, BLOCK_E, BLOCK_P)
        pairs += block_pairs
        rows += tl.where(pp[:, None] == source, block_rows[None, :], 0)
        bad += tl.where(pp == source, block_bad, 0)
    pairs_ok = ee < num_experts
    rows_ok = live[:, None] & live[None, :]
    rows_index = pp[:, None] * world_size + pp[None, :]
    ticket_ptr = scratch_ptr + headers_offset
    ticket = tl.zeros([], dtype=tl.int32)   # a grid of one program: its own sums are the totals, no scratch
    if num_programs > 1:
        tl.atomic_add(scratch_ptr + expert_pairs_offset + ee, pairs, mask=pairs_ok & (pairs != 0), sem="relaxed",
                      scope="gpu")
        tl.atomic_add(scratch_ptr + send_rows_offset + rows_index, rows, mask=rows_ok & (rows != 0), sem="relaxed",
                      scope="gpu")
        tl.atomic_add(scratch_ptr + bad_ids_offset + pp, bad, mask=live & (bad != 0), sem="relaxed", scope="gpu")
        ticket = sync.arrive(ticket_ptr, False)
    if ticket == num_programs - 1:
        if num_programs > 1:
            # the last program: every other program's sums are in the scratch (acquired by its ticket)
            pairs = tl.atomic_xchg(scratch_ptr + expert_pairs_offset + ee, 0, mask=pairs_ok, sem="relaxed",
                                   scope="gpu")
            rows = tl.atomic_xchg(scratch_ptr + send_rows_offset + rows_index, 0, mask=rows_ok, sem="relaxed",
                                  scope="gpu")
            bad = tl.atomic_xchg(scratch_ptr + bad_ids_offset + pp, 0, mask=live, sem="relaxed", scope="gpu")
            bad = tl.where(live, bad, 0)
            tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
        tl.store(counts_ptr + tokens_offset + pp, tokens, mask=live)
        tl.store(counts_ptr + send_rows_offset + rows_index, rows, mask=rows_ok)
        tl.store(counts_ptr + expert_pairs_offset + ee, pairs, mask=pairs_ok)
        tl.store(counts_ptr + bad_ids_offset + pp, bad, mask=live)
        tl.store(counts_ptr + headers_offset + pp[:, None] * HEADER_WORDS + hh[None, :], headers, mask=headers_ok)
        tl.store(counts_ptr + status_offset + ww, status, mask=ww < status_words)
        if VERDICT:
            _verdict(status_ptr, headers, status, bad, rank, world_size, HEADER_WORDS, BLOCK_P, BLOCK_H,
                     BLOCK_STATUS)
        if PLAN or TILE_KINDS > 0:
            tl.debug_barrier()   # the counts vector this program's threads stored, visible to all of them
        if PLAN:
            for d in range(0, world_size):
                plan_rank(counts_ptr, model_ptr, per_iteration_ptr, plans_ptr, d, tokens_offset, send_rows_offset,
                          expert_pairs_offset, world_size, num_local_experts, num_sms, comm_sms_limit, n0_per_mtile,
                          n1_per_mtile, static_c, static_k, POLICY, BLOCK_P, BLOCK_LOCAL_E, BLOCK_C, MAX_CHUNKS,
                          BLOCK_M)
        if TILE_KINDS > 0:   # this rank's experts' pairs
            local_pairs = counts_ptr + expert_pairs_offset + rank * num_local_experts
            tile_table_from_counts(local_pairs, table0_ptr, num_tiles0_ptr, num_local_experts, max_tiles0, TILE_M0,
                                   TILE_TAIL0, TILE_E, TILE_BLOCK)
            if TILE_KINDS == 2:
                tile_table_from_counts(local_pairs, table1_ptr, num_tiles1_ptr, num_local_experts, max_tiles1,
                                       TILE_M1, TILE_TAIL1, TILE_E, TILE_BLOCK)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


class DeviceCounts:
    """The counts kernel of one layer (counts format, routing message) on one device: its scratch, its output
    vector, its launch parameters.

    Args:
        counts_format: `exchange.CountsFormat` (EP, E, status words; every offset).
        message: `exchange.RoutingMessage` (T_max, k; its word positions).
        device: where the scratch and the counts vector live.
        max_programs: programs of the grid at most (MAX_PROGRAMS).
        planner: `DevicePlanner` of the same EP and E: every launch also writes every rank's plan into `build`'s
            `plans` (module docstring, "Planning in the same launch"); None: counts only.

    One instance per layer: its scratch must not be shared by launches that may run at the same time.
    """

    def __init__(self, counts_format, message, device, max_programs: int = MAX_PROGRAMS,
                 planner: DevicePlanner | None = None):
        if counts_format.num_experts % counts_format.world_size:
            raise ValueError(f"num_experts={counts_format.num_experts} is not divisible by EP="
                             f"{counts_format.world_size}")
        if counts_format.world_size > 31:
            raise ValueError(f"EP={counts_format.world_size}: a token's destinations are one int32 bit mask (EP <= 31)")
        if counts_format.status_words < _REJECTION_WORDS.value:
            raise ValueError(f"the status word needs >= {_REJECTION_WORDS.value} words for a rejection")
        if planner is not None and (planner.world_size, planner.spec.num_experts) != (
                counts_format.world_size, counts_format.num_experts):
            raise ValueError(f"the planner plans EP={planner.world_size}, E={planner.spec.num_experts}; the counts "
                             f"are for EP={counts_format.world_size}, E={counts_format.num_experts}")
        self.counts_format, self.message, self.planner = counts_format, message, planner
        i32 = dict(dtype=torch.int32, device=device)
        self.scratch = torch.zeros(counts_format.headers_offset + 1, **i32)   # zero between launches
        self.counts = torch.empty(counts_format.size, **i32)
        kp = _pow2(message.top_k)
        block_t = min(max(BLOCK_IDS // kp, 1), _pow2(message.max_tokens))
        blocks_per_rank = triton.cdiv(message.max_tokens, block_t)
        self.grid = (max(1, min(counts_format.world_size * blocks_per_rank, max_programs)),)
        self.scalar_args = dict(
            world_size=counts_format.world_size, words=message.words, max_tokens=message.max_tokens,
            num_experts=counts_format.num_experts,
            num_local_experts=counts_format.num_experts // counts_format.world_size,
            blocks_per_rank=blocks_per_rank, tokens_word=message.tokens_word, header_word=message.header_word,
            tokens_offset=counts_format.tokens_offset, send_rows_offset=counts_format.send_rows_offset,
            expert_pairs_offset=counts_format.expert_pairs_offset, bad_ids_offset=counts_format.bad_ids_offset,
            headers_offset=counts_format.headers_offset, status_offset=counts_format.status_offset,
            status_words=counts_format.status_words)
        self.constants = dict(K=message.top_k, KP=kp, BLOCK_T=block_t, BLOCK_E=_pow2(counts_format.num_experts),
                              BLOCK_P=_pow2(counts_format.world_size), HEADER_WORDS=HEADER_WORDS,
                              BLOCK_H=_pow2(HEADER_WORDS), BLOCK_STATUS=_pow2(counts_format.status_words))
        # the planner's arguments (placeholders that the kernel does not read without PLAN); its BLOCK_P is the
        # counts' (both cover EP ranks)
        if planner is not None:
            self.plan_tables = planner.tables(device)
            self.scalar_args.update(planner.policy_args())
            self.constants.update(planner.constants(), PLAN=True)
        else:
            self.plan_tables = (torch.zeros(1, dtype=torch.float32, device=device),
                                torch.zeros(1, dtype=torch.int32, device=device))
            self.scalar_args.update(dict.fromkeys(POLICY_ARGS, 0))
            self.constants.update(PLAN=False, POLICY=0, BLOCK_LOCAL_E=1, BLOCK_C=1, MAX_CHUNKS=1, BLOCK_M=1)
        # with the planner, no fused multiply-adds: its fp32 arithmetic is the mirror's (kernels/planner.py)
        self.options = dict(enable_fp_fusion=False) if planner is not None and not sync.INTERPRETER.value else {}

    def build(self, messages: torch.Tensor, status: torch.Tensor, rank: int, verdict: bool,
              plans: torch.Tensor | None = None, tiles: list | None = None) -> torch.Tensor:
        """Enqueue the kernel; returns the counts vector (int32 [CountsFormat.size], this object's buffer, rewritten
        by every launch).

        Args:
            messages: int32 [EP, words] contiguous, the gathered routing messages; ids outside [-1, E) become -1.
            status: int32 [status_words], the status word: copied into the counts; with `verdict`, the rejection is
                written into it (`CountsFormat.verdict`).
            rank: this rank.
            verdict: write the rejection (the device-resident call); False: `CountsFormat.build` only (the
                host-driven call, which checks the counts on the host).
            plans: int32 [EP, 4] contiguous, every rank's plan (`DevicePlanner.launch`'s output), given exactly
                when this object was built with a planner.
            tiles: one or two `grouped_tiles.TileTable` buffers (distinct kinds): also written, with the tiles of
                rank `rank`'s experts from their pairs (module docstring, "Tile tables in the same launch").
        """
        fmt, message = self.counts_format, self.message
        shape = (fmt.world_size, message.words)
        if messages.dtype != torch.int32 or tuple(messages.shape) != shape or not messages.is_contiguous():
            raise ValueError(f"messages must be a contiguous int32 {list(shape)} tensor, got {messages.dtype} "
                             f"{tuple(messages.shape)}")
        if status.dtype != torch.int32 or tuple(status.shape) != (fmt.status_words,):
            raise ValueError(f"status must be int32 [{fmt.status_words}], got {status.dtype} {tuple(status.shape)}")
        if (plans is None) != (self.planner is None):
            raise ValueError("plans must be given exactly when the counts kernel plans (DeviceCounts(planner=))")
        if plans is not None and (plans.dtype != torch.int32 or tuple(plans.shape) != (fmt.world_size, 4)
                                  or not plans.is_contiguous()):
            raise ValueError(f"plans must be a contiguous int32 [{fmt.world_size}, 4] tensor, got {plans.dtype} "
                             f"{tuple(plans.shape)}")
        args, options = self._launch(messages, status, rank, verdict, plans, tiles)
        counts_kernel[self.grid](*args, **options, **sync.LAUNCH)
        return self.counts

    def warmup(self, messages: torch.Tensor, status: torch.Tensor, rank: int, verdict: bool,
               plans: torch.Tensor | None = None, tiles: list | None = None) -> None:
        """Compile `build`'s launch for these arguments without launching (a layer's first call, before it enqueues
        anything: a variant first used inside a caller's CUDA-graph capture must not compile there)."""
        args, options = self._launch(messages, status, rank, verdict, plans, tiles)
        counts_kernel.warmup(*args, grid=self.grid, **options, **sync.LAUNCH)

    def _launch(self, messages, status, rank, verdict, plans, tiles) -> tuple[tuple, dict]:
        """(arguments, options but the launch's PDL) of the kernel's launch by `build` (and its compile by
        `warmup`)."""
        args = (messages, status, self.scratch, self.counts, self.counts if plans is None else plans,
                *self.plan_tables, rank)
        return args, dict(**self.scalar_args, **self.tile_arguments(tiles), **self.constants,
                          **self.tile_constants(tiles), VERDICT=verdict, num_warps=NUM_WARPS, **self.options)

    def tile_arguments(self, tiles: list | None) -> dict:
        """The kernel's table0_ptr .. max_tiles1 for `build(tiles=)` (placeholders without tiles)."""
        if not tiles:
            return dict(table0_ptr=self.counts, num_tiles0_ptr=self.counts, max_tiles0=1, table1_ptr=self.counts,
                        num_tiles1_ptr=self.counts, max_tiles1=1)
        if len(tiles) > 2 or len({(t.block_m, t.split_tail) for t in tiles}) != len(tiles):
            raise ValueError(f"tiles: one or two tables of distinct (block_m, split_tail), got "
                             f"{[(t.block_m, t.split_tail) for t in tiles]}")
        first, second = tiles[0], tiles[-1]
        return dict(table0_ptr=first.table, num_tiles0_ptr=first.num_tiles, max_tiles0=first.max_tiles,
                    table1_ptr=second.table, num_tiles1_ptr=second.num_tiles, max_tiles1=second.max_tiles)

    def tile_constants(self, tiles: list | None) -> dict:
        """The kernel's TILE_* constants for `build(tiles=)`."""
        if not tiles:
            return dict(TILE_KINDS=0, TILE_M0=1, TILE_TAIL0=False, TILE_M1=1, TILE_TAIL1=False, TILE_E=1)
        local = self.counts_format.num_experts // self.counts_format.world_size
        return dict(TILE_KINDS=len(tiles), TILE_M0=tiles[0].block_m, TILE_TAIL0=tiles[0].split_tail,
                    TILE_M1=tiles[-1].block_m, TILE_TAIL1=tiles[-1].split_tail, TILE_E=_pow2(local))


def compile_counts_ptx(device_counts: DeviceCounts, verdict: bool = True, capability: int = 90,
                       tiles: list | None = None) -> str:
    """The counts kernel's PTX for `sm_<capability>` with `device_counts`' launch parameters (and `build`'s `tiles`),
    compiled without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"messages_ptr": "*i32", "status_ptr": "*i32", "scratch_ptr": "*i32", "counts_ptr": "*i32",
                 "plans_ptr": "*i32", "model_ptr": "*fp32", "per_iteration_ptr": "*i32", "rank": "i32"}
    signature.update({name: "i32" for name in device_counts.scalar_args})
    signature.update({name: "i32" if name.startswith("max_tiles") else "*i32"
                      for name in device_counts.tile_arguments(None)})
    constants = dict(device_counts.constants, VERDICT=verdict, **device_counts.tile_constants(tiles))
    signature.update({name: "constexpr" for name in constants})
    source = ASTSource(fn=counts_kernel, signature=signature, constexprs=constants)
    options = {"num_warps": NUM_WARPS}
    if device_counts.planner is not None:
        options["enable_fp_fusion"] = False
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    return compiled.asm["ptx"]

