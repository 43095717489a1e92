"""The dispatch beside the task tables: a call's rows sent by a launch on a side stream, not after the tables
(KernelConfig.early_dispatch for decode calls, KernelConfig.dispatch_beside_emit for longer ones).

Why. A call is a chain of dependent launches: counts, scan, bases, emit, then the dispatch launch, which reads the
emit's task rows, then the GEMMs. But a dispatched row needs none of the emit's rows:
- its receive slot at destination d is the number of this rank's earlier tokens that go to d (the slot
  `layout.build_layout` gives it: the receive region holds source s's rows at [s * T_max, (s + 1) * T_max), in
  token order);
- its arrival flag at d is (this rank, the token's chunk of d's plan), chunk(t) = t * K_d // max(T, 1);
- the rows a rank waits for follow from every rank's routing, which the exchange has delivered before the counts.
So the dispatch can run on a side stream beside the tables, and the call's GEMMs wait for both: the backend joins it
before its first launch that reads the receive buffer, which then skips its own dispatch phase (or is left out).
At decode sizes a launch is ~3 us of dependent loads (docs/perf-notes.md, entries 21 and 32); at 2048 tokens the
dispatch launch works for ~20 us after the emit, and its CTAs (one per SM, every register), resident from the emit's
start, keep the grouped GEMMs' tile tables forked beside the emit off the SMs until they leave (DeepSeek-V2, one
rank's work of EP=2, bench/results/h200-ee75b53; docs/perf-notes.md entry 35).

Two launches, for two sizes of call:
- `early_dispatch_kernel` (decode calls, right after the counts and the plan, beside the scan, bases and emit):
  each row's slot and flag from the ids alone (a cumsum over <= BLOCK_T tokens), the rows owed here counted from
  every rank's ids.
- `tables_dispatch_kernel` (longer calls, right after the bases, beside the emit): each row's slot is the scan's
  rank within its token block plus the bases' block base (`send_local`, `send_block_base`, as the emit computes it),
  its destinations the scan's bit mask; the rows owed here are the bases' `arrival_expected`.
And a third (KernelConfig.pair_dispatch, EP = 1; docs/perf-notes.md entries 36-39): `pair_dispatch_kernel` sends a
decode call's rows once per (token, expert) pair, each to its row in the destination's expert order, and writes each
pair's row into a [T, k] table, so that GEMM0 reads the rows contiguous (its tile tables built from the counts) and
the combine reads y by that table (kernels/pair_combine.py), without the task tables.

Work of `early_dispatch_kernel`. The (token, destination) pairs t * BLOCK_P + d are dealt round-robin to the
programs (no more programs than pairs); a program with none, unless it is the last, exits after its first loads.
Every other one computes this rank's destinations per token and the slots; each of its pairs that is sent is one
row copied in 16-byte vectors (x from `io`, as the megakernel reads it) and one release-add of 1 onto its arrival
flag at d (sync.py's protocol: the CTA's stores, a barrier, one release atomic at system scope).

Work of `tables_dispatch_kernel`. Steps of ROWS tokens are dealt round-robin to the programs; a step reads its
tokens' rows as [ROWS, BLOCK_H] tiles (16-byte vectors), writes each tile to every destination of its tokens, then
releases, per (destination, chunk) the step touches, the number of its rows there onto that flag: a few atomics per
step, not one per row.

In both, the LAST program then waits, bounded, until every (source, chunk) flag of this rank holds the rows it is
owed, so that the launch ends only once every row has arrived (the kernels after the join read the receive buffer
unguarded, as after the dispatch launch it replaces). The last, not the first: under the interpreter programs run in
order, and the last one's wait then follows every send of this process. A call refused before it (the status word
set by the counts' verdict, on every rank alike) sends nothing and waits for nothing. The host sends only decode
calls to the first (T <= BLOCK_T: one block of tokens); a longer call is walked in blocks of BLOCK_T, the slots
carried across them (right, not fast), and so is any peer's T on the receive side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weave_moe.backends.weave.kernels import sync
from weave_moe.backends.weave.kernels.peers import call_io_ptr, peer_ptr
from weave_moe.backends.weave.kernels.tables_scan import token_destinations
from weave_moe.plan.workload import MAX_CHUNKS

__all__ = ["EarlyDispatch", "TablesDispatch", "PairDispatch", "early_dispatch_kernel", "tables_dispatch_kernel",
           "pair_dispatch_kernel", "ids_block"]

NUM_WARPS = 4
#: pairs per step of `pair_dispatch_kernel`'s walk at EP = 1 when each program has at least that many pairs of the
#: longest call (a paired call longer than a decode call: KernelConfig.pair_tokens); 1 (the plain walk) otherwise
PIPE_PAIRS = 4


def _check_hidden(hidden_size: int) -> None:
    if hidden_size % 8:
        raise ValueError(f"hidden_size must be a multiple of 8 (rows copied in 16-byte vectors), got {hidden_size}")


def _check_ids(all_ids: torch.Tensor, world_size: int, max_tokens: int, top_k: int) -> None:
    """The gathered ids as `RoutingMessage.unpack` views them: int32 [EP, T_max, k] with contiguous rows."""
    if tuple(all_ids.shape) != (world_size, max_tokens, top_k) or all_ids.dtype != torch.int32 \
            or all_ids.stride()[1:] != (top_k, 1):
        raise ValueError(f"all_ids: expected int32 [{world_size}, {max_tokens}, {top_k}] with contiguous rows, got "
                         f"{all_ids.dtype} {tuple(all_ids.shape)}")


def _check_plan_columns(tokens: torch.Tensor, chunks: torch.Tensor | None, world_size: int) -> None:
    """T of every rank, and the K column of the [EP, 4] plans (None: not read)."""
    if chunks is not None and (chunks.dtype != torch.int32 or chunks.numel() != world_size or chunks.stride(0) != 4):
        raise ValueError("chunks must be the K column of the [EP, 4] int32 plans (stride 4)")
    if tokens.dtype != torch.int32 or tokens.numel() != world_size:
        raise ValueError("tokens must be int32 [EP]")


@triton.jit
def ids_block(ids_ptr, ids_stride, source, n_tok, first, max_tokens, K: tl.constexpr, KP: tl.constexpr,
               BLOCK_T: tl.constexpr):
    """[BLOCK_T, KP] the expert ids of `source`'s tokens first + i, -1 past its n_tok and past k. The ids are read up
    to T_max and cut at n_tok afterwards: the load does not wait for n_tok's."""
    t = first + tl.arange(0, BLOCK_T)
    jj = tl.arange(0, KP)
    ids = tl.load(ids_ptr + tl.cast(source, tl.int64) * ids_stride + t[:, None] * K + jj[None, :],
                  mask=(t < max_tokens)[:, None] & (jj < K)[None, :], other=-1)
    return tl.where((t < n_tok)[:, None], ids, -1)


@triton.jit
def _destinations(ids_ptr, ids_stride, source, n_tok, first, world_size, max_tokens,
                  L: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    """[BLOCK_T, BLOCK_P] int32: 1 where token first + i of `source` (< n_tok) has an expert on rank d. Ids outside
    [0, E) go nowhere (the counts kernel before this launch has replaced them by -1, or refused the call)."""
    ids = ids_block(ids_ptr, ids_stride, source, n_tok, first, max_tokens, K, KP, BLOCK_T)
    return token_destinations(ids, world_size, L, BLOCK_P).to(tl.int32)


@triton.jit
def _pick(values, picked):
    """The entry of [BLOCK_T, BLOCK_P] `values` where `picked` (one entry) is set."""
    return tl.sum(tl.sum(tl.where(picked, values, 0), axis=1), axis=0)


@triton.jit
def _owed(ids_ptr, ids_stride, tokens_ptr, tokens_stride, chunks_ptr, rank, world_size, max_tokens,
          L: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr, BLOCK_T: tl.constexpr,
          BLOCK_P: tl.constexpr):
    """[BLOCK_P * MC] int32: the rows this rank is owed from each (source, chunk), at source * MC + chunk (the order
    of its arrival flags): source s's tokens with an expert here, by their chunk of this rank's plan."""
    owed = tl.zeros([BLOCK_P * MC], dtype=tl.int32)
    K_me = tl.load(chunks_ptr + rank * 4)
    pp = tl.arange(0, BLOCK_P)
    for source in range(0, world_size):
        n_tok = tl.load(tokens_ptr + source * tokens_stride)
        for first in range(0, n_tok, BLOCK_T):
            goes = _destinations(ids_ptr, ids_stride, source, n_tok, first, world_size, max_tokens, L, K, KP,
                                 BLOCK_T, BLOCK_P)
            here = tl.sum(tl.where(pp[None, :] == rank, goes, 0), axis=1)
            t = first + tl.arange(0, BLOCK_T)
            chunk = tl.minimum((t * K_me) // tl.maximum(n_tok, 1), MC - 1)
            owed += tl.histogram(source * MC + chunk, BLOCK_P * MC, mask=here != 0)
    return owed


@triton.jit(do_not_specialize=["rank", "world_size", "recv_offset", "flags_offset", "timeout_ns"])
def early_dispatch_kernel(ids_ptr, ids_stride, tokens_ptr, tokens_stride, chunks_ptr, io_ptr, peer_base_ptr,
                          recv_offset, flags_offset, arrival_ptr, status_ptr, rank, world_size, max_tokens, H,
                          timeout_ns, L: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """ids_ptr: the gathered ids [EP, T_max, k] (`ids_stride` between ranks); tokens_ptr: T of every rank;
    chunks_ptr: the K column of the [EP, 4] plans; io_ptr: the call's x address at word 0; peer_base_ptr,
    recv_offset, flags_offset: the workspace's peer bases and the byte offsets of the receive rows and of the call's
    arrival counters; arrival_ptr: this rank's arrival counters [EP, MC]; status_ptr: the live status word."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    # every load the sends need first, at once: T, the destinations' chunk counts, the first block's ids, x's address
    n_tok = tl.load(tokens_ptr + rank * tokens_stride)
    K_dest = tl.load(chunks_ptr + tl.arange(0, BLOCK_P) * 4, mask=tl.arange(0, BLOCK_P) < world_size, other=1)
    goes = _destinations(ids_ptr, ids_stride, rank, n_tok, 0, world_size, max_tokens, L, K, KP, BLOCK_T, BLOCK_P)
    x = call_io_ptr(io_ptr, 0, True)
    # programs with no pair and not the last exit here, without the status word's atomic (at one token, all but
    # BLOCK_P + 1 of them: 132 atomics on one word would queue the senders' behind them)
    busy = (pid < n_tok * BLOCK_P) | (pid == grid - 1)
    if busy:
        if sync.status_set(status_ptr) == 0:
            pp = tl.arange(0, BLOCK_P)
            offs_h = tl.arange(0, BLOCK_H)
            sent = tl.zeros([BLOCK_P], dtype=tl.int32)   # rows to each destination in the blocks before
            # blocks of BLOCK_T tokens (one at the decode sizes the host sends here; more only if a call is longer)
            for first in range(0, n_tok, BLOCK_T):
                if first > 0:
                    goes = _destinations(ids_ptr, ids_stride, rank, n_tok, first, world_size, max_tokens, L, K, KP,
                                         BLOCK_T, BLOCK_P)
                t = first + tl.arange(0, BLOCK_T)
                slot = sent[None, :] + tl.cumsum(goes, axis=0) - goes                # rank among the tokens to d
                chunk = tl.minimum((t[:, None] * K_dest[None, :]) // tl.maximum(n_tok, 1), MC - 1)
                for pair in range(pid, BLOCK_T * BLOCK_P, grid):
                    token = first + pair // BLOCK_P
                    dest = pair % BLOCK_P
                    picked = (t[:, None] == token) & (pp[None, :] == dest)
                    if _pick(goes, picked) != 0:
                        row = _pick(slot, picked)
                        dst = (peer_ptr(peer_base_ptr, dest, recv_offset, tl.bfloat16, True)
                               + (tl.cast(rank, tl.int64) * max_tokens + row) * H)
                        src = x + tl.cast(token, tl.int64) * H
                        for h0 in range(0, H, BLOCK_H):
                            cols = h0 + offs_h
                            tl.store(dst + cols, tl.load(src + cols, mask=cols < H), mask=cols < H)
                        flag = (peer_ptr(peer_base_ptr, dest, flags_offset, tl.int32) + rank * MC
                                + _pick(chunk, picked))
                        sync.signal_add(flag, 1, True)
                sent += tl.sum(goes, axis=0)
            if pid == grid - 1:
                owed = _owed(ids_ptr, ids_stride, tokens_ptr, tokens_stride, chunks_ptr, rank, world_size, max_tokens,
                             L, K, KP, MC, BLOCK_T, BLOCK_P)
                # a timeout names flag source * 16 + chunk, as the dispatch launch's wait does
                sync.wait_all_values(arrival_ptr, owed, world_size * MC, status_ptr, sync.ERROR_ARRIVAL_TIMEOUT, 0,
                                     timeout_ns, BLOCK_P * MC, True, GROUP=MC)


class EarlyDispatch:
    """`early_dispatch_kernel`'s launch for one layer: `launch(...)` after the counts (and the plan) of a call of at
    most `max_call_tokens` tokens on this rank."""

    def __init__(self, world_size: int, num_experts: int, top_k: int, hidden_size: int, max_tokens: int,
                 max_call_tokens: int, num_programs: int):
        if not 1 <= max_call_tokens <= max_tokens:
            raise ValueError(f"max_call_tokens must be in [1, max_tokens = {max_tokens}], got {max_call_tokens}")
        _check_hidden(hidden_size)
        self.world_size, self.max_tokens, self.hidden_size = world_size, max_tokens, hidden_size
        self.max_call_tokens = max_call_tokens
        # no more programs than (token, destination) pairs
        self.num_programs = min(num_programs, triton.next_power_of_2(max_call_tokens) * triton.next_power_of_2(
            world_size))
        self.constants = dict(L=num_experts // world_size, K=top_k, KP=triton.next_power_of_2(top_k), MC=MAX_CHUNKS,
                              BLOCK_T=triton.next_power_of_2(max_call_tokens),
                              BLOCK_P=triton.next_power_of_2(world_size),
                              BLOCK_H=min(4096, triton.next_power_of_2(hidden_size)))

    def _arguments(self, all_ids, tokens, chunks, io, workspace, status, rank, timeout_ns) -> tuple:
        P, T = self.world_size, self.max_tokens
        _check_ids(all_ids, P, T, self.constants["K"])
        _check_plan_columns(tokens, chunks, P)
        return (all_ids, all_ids.stride(0), tokens, tokens.stride(0), chunks, io, workspace.peer_bases,
                workspace.recv_offset, workspace.flags_offsets[0], workspace.flags(0), status, rank, P, T,
                self.hidden_size, timeout_ns)

    def launch(self, all_ids: torch.Tensor, tokens: torch.Tensor, chunks: torch.Tensor, io: torch.Tensor,
               workspace, status: torch.Tensor, rank: int, timeout_ns: int) -> None:
        """Enqueue the dispatch of this rank's rows (x at `io[0]`; at most `max_call_tokens` of them, which the
        caller knows from x) into the call's parity-0 receive rows and arrival counters of `workspace` (a
        WorkspaceView: the resident call's), and the bounded wait for every row owed to this rank."""
        early_dispatch_kernel[(self.num_programs,)](
            *self._arguments(all_ids, tokens, chunks, io, workspace, status, rank, timeout_ns), **self.constants,
            num_warps=NUM_WARPS)

    def warmup(self, all_ids, tokens, chunks, io, workspace, status, rank, timeout_ns) -> None:
        """Compile for these arguments' specialisation without launching (the layer's first call, before it
        enqueues anything)."""
        early_dispatch_kernel.warmup(
            *self._arguments(all_ids, tokens, chunks, io, workspace, status, rank, timeout_ns), **self.constants,
            grid=(self.num_programs,), num_warps=NUM_WARPS)


@triton.jit(do_not_specialize=["rank", "world_size", "recv_offset", "flags_offset", "timeout_ns"])
def tables_dispatch_kernel(mask_ptr, send_local_ptr, send_block_base_ptr, expected_ptr, tokens_ptr, tokens_stride,
                           chunks_ptr, io_ptr, peer_base_ptr, recv_offset, flags_offset, arrival_ptr, status_ptr,
                           rank, world_size, max_tokens, NB, H, timeout_ns, MC: tl.constexpr, BT: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """mask_ptr: the scan's destination bit mask per token [T_max]; send_local_ptr: [EP, T_max] a token's rank among
    its scan block's tokens to d; send_block_base_ptr: [EP, NB] the tokens to d in earlier blocks (the bases');
    expected_ptr: the bases' arrival_expected [EP, MC]; the others as in `early_dispatch_kernel`."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    n_tok = tl.load(tokens_ptr + rank * tokens_stride)
    x = call_io_ptr(io_ptr, 0, True)
    if sync.status_set(status_ptr) == 0:
        offs_r = tl.arange(0, ROWS)
        offs_h = tl.arange(0, BLOCK_H)
        cc = tl.arange(0, MC)
        for first in range(pid * ROWS, n_tok, grid * ROWS):
            t = first + offs_r
            valid = t < n_tok
            bits = tl.load(mask_ptr + t, mask=valid, other=0)
            src = x + t.to(tl.int64)[:, None] * H
            sent = valid & (bits != 0)
            # a tile of x read once, then written to each of its destinations (their slots reloaded per tile: a few
            # words from L1, where a loop over destinations outside would read x once per destination)
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + offs_h
                tile = tl.load(src + cols[None, :], mask=sent[:, None] & (cols < H)[None, :])
                for d in range(0, world_size):
                    goes = valid & (((bits >> d) & 1) != 0)
                    slot = (tl.load(send_local_ptr + d * max_tokens + t, mask=goes, other=0)
                            + tl.load(send_block_base_ptr + d * NB + t // BT, mask=goes, other=0))
                    dst = (peer_ptr(peer_base_ptr, d, recv_offset, tl.bfloat16, True)
                           + (tl.cast(rank, tl.int64) * max_tokens + slot.to(tl.int64))[:, None] * H)
                    tl.store(dst + cols[None, :], tile, mask=goes[:, None] & (cols < H)[None, :])
            for d in range(0, world_size):
                goes = valid & (((bits >> d) & 1) != 0)
                K_d = tl.load(chunks_ptr + d * 4)
                rows = tl.histogram(tl.minimum((t * K_d) // tl.maximum(n_tok, 1), MC - 1), MC, mask=goes)
                flag = peer_ptr(peer_base_ptr, d, flags_offset, tl.int32) + rank * MC
                for c in range(0, MC):
                    count = tl.sum(tl.where(cc == c, rows, 0), axis=0)
                    if count > 0:
                        sync.signal_add(flag + c, count, True)
        if pid == grid - 1:
            # a timeout names flag source * 16 + chunk, as the dispatch launch's wait does
            sync.wait_all_at_least(arrival_ptr, expected_ptr, world_size * MC, status_ptr,
                                   sync.ERROR_ARRIVAL_TIMEOUT, 0, timeout_ns, BLOCK_P * MC, True, GROUP=MC)


class TablesDispatch:
    """`tables_dispatch_kernel`'s launch for one layer: `launch(...)` after the bases kernel of a call's task tables
    (`tables.build_layout_triton(beside_emit=)`), on a side stream beside the emit."""

    def __init__(self, world_size: int, hidden_size: int, max_tokens: int, num_programs: int, rows: int = 16):
        """`rows`: tokens per step (a power of two), each step a [rows, BLOCK_H] tile of x per destination."""
        if rows < 1 or rows & (rows - 1):
            raise ValueError(f"rows must be a power of two, got {rows}")
        _check_hidden(hidden_size)
        self.world_size, self.max_tokens, self.hidden_size = world_size, max_tokens, hidden_size
        # no more programs than steps of the longest call
        self.num_programs = max(1, min(num_programs, triton.cdiv(max_tokens, rows)))
        self.constants = dict(MC=MAX_CHUNKS, ROWS=rows, BLOCK_P=triton.next_power_of_2(world_size),
                              BLOCK_H=min(512, triton.next_power_of_2(hidden_size)))

    def _arguments(self, tables, tokens, chunks, io, workspace, status, rank, timeout_ns) -> tuple:
        t = tables.tensors
        P, T = t["send_local"].shape
        if (P, T) != (self.world_size, self.max_tokens):
            raise ValueError(f"tables: for EP {P} and T_max {T}, this launch for EP {self.world_size} and T_max "
                             f"{self.max_tokens}")
        _check_plan_columns(tokens, chunks, P)
        return (t["token_dest_mask"], t["send_local"], t["send_block_base"], t["arrival_expected"], tokens,
                tokens.stride(0), chunks, io, workspace.peer_bases, workspace.recv_offset, workspace.flags_offsets[0],
                workspace.flags(0), status, rank, P, T, tables.shapes.NB, self.hidden_size, timeout_ns)

    def launch(self, tables, tokens: torch.Tensor, chunks: torch.Tensor, io: torch.Tensor, workspace,
               status: torch.Tensor, rank: int, timeout_ns: int) -> None:
        """Enqueue the dispatch of this rank's rows (x at `io[0]`) into the call's parity-0 receive rows and arrival
        counters of `workspace` (a WorkspaceView: the resident call's), reading `tables` (the call's
        `tables.TableBuffers`, once its scan and bases kernels are enqueued), and the bounded wait for every row owed
        to this rank."""
        tables_dispatch_kernel[(self.num_programs,)](
            *self._arguments(tables, tokens, chunks, io, workspace, status, rank, timeout_ns),
            BT=tables.shapes.BT, **self.constants, num_warps=NUM_WARPS)

    def warmup(self, tables, tokens, chunks, io, workspace, status, rank, timeout_ns) -> None:
        """Compile for these arguments' specialisation without launching (the layer's first call, before it
        enqueues anything)."""
        tables_dispatch_kernel.warmup(
            *self._arguments(tables, tokens, chunks, io, workspace, status, rank, timeout_ns),
            BT=tables.shapes.BT, **self.constants, grid=(self.num_programs,), num_warps=NUM_WARPS)


@triton.jit
def _pairs_of(ids_ptr, ids_stride, tokens_ptr, tokens_stride, source, max_tokens, K: tl.constexpr,
              KP: tl.constexpr, BLOCK_T: tl.constexpr):
    """[BLOCK_T, KP] the expert ids of `source`'s first BLOCK_T tokens (`ids_block` with its T)."""
    n_tok = tl.load(tokens_ptr + source * tokens_stride)
    return ids_block(ids_ptr, ids_stride, source, n_tok, 0, max_tokens, K, KP, BLOCK_T)


@triton.jit
def _local_pair(pair, end, ids_ptr, cursor, ee, rows_ptr, K: tl.constexpr, KP: tl.constexpr):
    """`_local_pairs`' and `_peer_pairs`' step for `pair` (token * KP + slot): (its row in expert order, its token,
    its expert (-1: none, also for a pair outside this program's range or a slot past K), the cursors after it), its
    entry of the rows table written (-1 for a named slot without an expert). `cursor` [BLOCK_E]: each expert's next
    row, advanced past this pair's. A pair at or past `end` has none and writes nothing. Its expert is loaded from
    this rank's ids (`ids_ptr`; the counts launch has replaced bad ids by -1 there, or refused the call)."""
    named = (pair < end) & ((pair % KP) < K)   # a (token, slot) of this program's range of the call's pairs
    expert = tl.load(ids_ptr + (pair // KP) * K + pair % KP, mask=named, other=-1)
    row = tl.sum(tl.where(ee == expert, cursor, 0), axis=0)
    tl.store(rows_ptr + (pair // KP) * K + pair % KP, tl.where(expert < 0, -1, row), mask=named)
    return row, pair // KP, expert, tl.where(ee == expert, cursor + 1, cursor)


@triton.jit
def _pair_range(pid, grid, tokens_ptr, tokens_stride, rank, mine, flat, KP: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_E: tl.constexpr):
    """This program's contiguous range [begin, end) of this rank's call's pairs (token * KP + slot order, an equal
    share per program) and [BLOCK_E] each expert's pairs of this rank before it (a histogram of the ids tile
    `mine`): what `_local_pairs` and `_peer_pairs` start their cursors from."""
    n_pairs = tl.minimum(tl.load(tokens_ptr + rank * tokens_stride), BLOCK_T) * KP
    per = tl.cdiv(n_pairs, grid)
    begin = pid * per
    end = tl.minimum(begin + per, n_pairs)
    ids = tl.reshape(mine, [BLOCK_T * KP])
    before = tl.histogram(ids, BLOCK_E, mask=(tl.reshape(flat, [BLOCK_T * KP]) < begin) & (ids >= 0))
    return begin, end, before


@triton.jit
def _local_pairs(pid, grid, ids_ptr, ids_stride, mine, flat, pairs, ee, x, rows_ptr, local_ptr, tokens_ptr,
                 tokens_stride, rank, H, K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, PIPE: tl.constexpr):
    """`pair_dispatch_kernel`'s walk at EP = 1 (LOCAL) with PIPE (2 or 4) pairs per step. A program takes one
    contiguous range of the call's pairs (token * KP + slot order), so the rows are counted once, not per pair:
    each expert's cursor starts at its first row (the pairs of the experts before it) plus its pairs before the
    range (one histogram of the ids tile `mine`), and advances by one per pair of it walked in order. Each step's
    rows are loaded before any of them is stored (one load latency per step, where the plain walk waits one per
    pair); a pair past the range is neither read nor written (`_local_pair`)."""
    offs_h = tl.arange(0, BLOCK_H)
    begin, end, before = _pair_range(pid, grid, tokens_ptr, tokens_stride, rank, mine, flat, KP, BLOCK_T, BLOCK_E)
    cursor = tl.cumsum(pairs, axis=0) - pairs + before   # [BLOCK_E] each expert's next row
    ids_ptr = ids_ptr + rank * ids_stride
    for first in range(begin, end, PIPE):
        row0, token0, e0, cursor = _local_pair(first, end, ids_ptr, cursor, ee, rows_ptr, K, KP)
        row1, token1, e1, cursor = _local_pair(first + 1, end, ids_ptr, cursor, ee, rows_ptr, K, KP)
        ok0, ok1 = e0 >= 0, e1 >= 0
        if PIPE > 2:
            row2, token2, e2, cursor = _local_pair(first + 2, end, ids_ptr, cursor, ee, rows_ptr, K, KP)
            row3, token3, e3, cursor = _local_pair(first + 3, end, ids_ptr, cursor, ee, rows_ptr, K, KP)
            ok2, ok3 = e2 >= 0, e3 >= 0
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + offs_h
            inside = cols < H
            v0 = tl.load(x + tl.cast(token0, tl.int64) * H + cols, mask=inside & ok0)
            v1 = tl.load(x + tl.cast(token1, tl.int64) * H + cols, mask=inside & ok1)
            if PIPE > 2:
                v2 = tl.load(x + tl.cast(token2, tl.int64) * H + cols, mask=inside & ok2)
                v3 = tl.load(x + tl.cast(token3, tl.int64) * H + cols, mask=inside & ok3)
            tl.store(local_ptr + tl.cast(row0, tl.int64) * H + cols, v0, mask=inside & ok0)
            tl.store(local_ptr + tl.cast(row1, tl.int64) * H + cols, v1, mask=inside & ok1)
            if PIPE > 2:
                tl.store(local_ptr + tl.cast(row2, tl.int64) * H + cols, v2, mask=inside & ok2)
                tl.store(local_ptr + tl.cast(row3, tl.int64) * H + cols, v3, mask=inside & ok3)


@triton.jit
def _peer_row_ptr(row, expert, peer_base_ptr, recv_offset, H, L: tl.constexpr):
    """The start of receive row `row` at `expert`'s destination (`expert` < 0: rank 0's, never stored to)."""
    return (peer_ptr(peer_base_ptr, tl.maximum(expert, 0) // L, recv_offset, tl.bfloat16, True)
            + tl.cast(row, tl.int64) * H)


@triton.jit
def _peer_pairs(pid, grid, ids_ptr, ids_stride, mine, flat, pairs, ee, x, rows_ptr, tokens_ptr, tokens_stride,
                peer_base_ptr, recv_offset, pair_rows_offset, flags_offset, rank, world_size, max_tokens, H,
                L: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, PIPE: tl.constexpr):
    """`pair_dispatch_kernel`'s walk into the destinations' receive regions (not LOCAL) with PIPE (2 or 4) pairs
    per step, as `_local_pairs` walks into local rows: one contiguous range of the call's pairs per program, each
    expert's cursor starting at its row in its destination's expert order, (pairs of the destination's experts
    before it) + (its pairs from earlier sources: one histogram of each earlier source's ids) + (its pairs of this
    source before the range: one histogram), advanced by one per pair walked. Each pair's row index goes into its
    destination's pair rows region with the first column block; the program counts its pairs per destination and
    releases each count once, after all its stores (one system-scope atomic per destination, not per pair)."""
    offs_h = tl.arange(0, BLOCK_H)
    begin, end, cursor = _pair_range(pid, grid, tokens_ptr, tokens_stride, rank, mine, flat, KP, BLOCK_T, BLOCK_E)
    for source in range(0, rank):
        theirs = tl.reshape(_pairs_of(ids_ptr, ids_stride, tokens_ptr, tokens_stride, source, max_tokens, K, KP,
                                      BLOCK_T), [BLOCK_T * KP])
        cursor += tl.histogram(theirs, BLOCK_E, mask=theirs >= 0)
    dd = tl.arange(0, BLOCK_P)
    # the pairs of the experts of destinations before d, [BLOCK_P]; then each expert's destination's, [BLOCK_E]
    dest_start = tl.sum(tl.where(ee[None, :] < dd[:, None] * L, pairs[None, :], 0), axis=1)
    expert_dest_start = tl.sum(tl.where(ee[:, None] // L == dd[None, :], dest_start[None, :], 0), axis=1)
    cursor += tl.cumsum(pairs, axis=0) - pairs - expert_dest_start
    sent = tl.zeros([BLOCK_P], dtype=tl.int32)
    ids_ptr = ids_ptr + rank * ids_stride
    for first in range(begin, end, PIPE):
        row0, token0, e0, cursor = _local_pair(first, end, ids_ptr, cursor, ee, rows_ptr, K, KP)
        row1, token1, e1, cursor = _local_pair(first + 1, end, ids_ptr, cursor, ee, rows_ptr, K, KP)
        if PIPE > 2:
            row2, token2, e2, cursor = _local_pair(first + 2, end, ids_ptr, cursor, ee, rows_ptr, K, KP)
            row3, token3, e3, cursor = _local_pair(first + 3, end, ids_ptr, cursor, ee, rows_ptr, K, KP)
        dst0 = _peer_row_ptr(row0, e0, peer_base_ptr, recv_offset, H, L)
        dst1 = _peer_row_ptr(row1, e1, peer_base_ptr, recv_offset, H, L)
        if PIPE > 2:
            dst2 = _peer_row_ptr(row2, e2, peer_base_ptr, recv_offset, H, L)
            dst3 = _peer_row_ptr(row3, e3, peer_base_ptr, recv_offset, H, L)
        for h0 in range(0, H, BLOCK_H):   # the step's loads, then its stores (as `_local_pairs`)
            cols = h0 + offs_h
            inside = cols < H
            v0 = tl.load(x + tl.cast(token0, tl.int64) * H + cols, mask=inside & (e0 >= 0))
            v1 = tl.load(x + tl.cast(token1, tl.int64) * H + cols, mask=inside & (e1 >= 0))
            if PIPE > 2:
                v2 = tl.load(x + tl.cast(token2, tl.int64) * H + cols, mask=inside & (e2 >= 0))
                v3 = tl.load(x + tl.cast(token3, tl.int64) * H + cols, mask=inside & (e3 >= 0))
            tl.store(dst0 + cols, v0, mask=inside & (e0 >= 0))
            tl.store(dst1 + cols, v1, mask=inside & (e1 >= 0))
            if PIPE > 2:
                tl.store(dst2 + cols, v2, mask=inside & (e2 >= 0))
                tl.store(dst3 + cols, v3, mask=inside & (e3 >= 0))
        sent += _peer_pair_index(row0, token0, first % KP, e0, peer_base_ptr, pair_rows_offset, rank, max_tokens,
                                 dd, L, K)
        sent += _peer_pair_index(row1, token1, (first + 1) % KP, e1, peer_base_ptr, pair_rows_offset, rank,
                                 max_tokens, dd, L, K)
        if PIPE > 2:
            sent += _peer_pair_index(row2, token2, (first + 2) % KP, e2, peer_base_ptr, pair_rows_offset, rank,
                                     max_tokens, dd, L, K)
            sent += _peer_pair_index(row3, token3, (first + 3) % KP, e3, peer_base_ptr, pair_rows_offset, rank,
                                     max_tokens, dd, L, K)
    for d in range(0, world_size):
        count = tl.sum(tl.where(dd == d, sent, 0), axis=0)
        if count > 0:
            sync.signal_add(peer_ptr(peer_base_ptr, d, flags_offset, tl.int32) + rank * MC, count, True)


@triton.jit
def _peer_pair_index(row, token, slot, expert, peer_base_ptr, pair_rows_offset, rank, max_tokens, dd,
                     L: tl.constexpr, K: tl.constexpr):
    """`_peer_pairs`' index of one pair (`expert` < 0: none): `row` into its destination's pair rows region at
    (this rank, token, slot); returns [BLOCK_P] one at its destination (what the program releases there)."""
    ok = expert >= 0
    dest = tl.maximum(expert, 0) // L
    tl.store(peer_ptr(peer_base_ptr, dest, pair_rows_offset, tl.int32) + (rank * max_tokens + token) * K + slot, row,
             mask=ok)
    return ((dd == dest) & ok).to(tl.int32)


@triton.jit(do_not_specialize=["rank", "world_size", "recv_offset", "pair_rows_offset", "flags_offset",
                               "timeout_ns"])
def pair_dispatch_kernel(ids_ptr, ids_stride, tokens_ptr, tokens_stride, pairs_ptr, io_ptr, peer_base_ptr,
                         recv_offset, pair_rows_offset, flags_offset, arrival_ptr, status_ptr, offsets_ptr, rows_ptr,
                         local_ptr, rank, world_size, max_tokens, H, timeout_ns, L: tl.constexpr,
                         K: tl.constexpr, KP: tl.constexpr, MC: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
                         LOCAL: tl.constexpr, OFFSETS: tl.constexpr, PDL: tl.constexpr = False,
                         PIPE: tl.constexpr = 1):
    """A decode call's rows sent once per (token, expert) pair, to the pair's row in its destination's expert order
    (KernelConfig.pair_dispatch; docs/perf-notes.md entries 36-37). Under one chunk the task tables order a rank's pairs
    by (local expert, source, token, top-k slot) (`layout.build_layout`'s `gather_rows`), so pair (s, t, j) with
    expert e on rank d goes to receive row
        sum(pairs of d's experts before e) + (pairs of e from sources < s) + (pairs of e in s's (t', j') < (t, j)).
    pairs_ptr: the counts vector's pairs per expert [E] (every rank's); the others as in `early_dispatch_kernel`.
    Each pair sent releases 1 onto flag (this rank, chunk 0) at d, after its row and its entry (s * T_max + t) * k
    + j of d's pair rows region (`pair_rows_offset`: the row, which d's combine reads, kernels/pair_combine.py); the
    last program waits until each source's flag holds the pairs it owes this rank. One block of tokens: every
    rank's T <= BLOCK_T. The last program also writes
    this rank's expert offsets [L + 1] into `offsets_ptr` (the exclusive prefix sum of its experts' pairs, what the
    bases kernel writes into the tables' `expert_offsets` under one chunk; zeros when the call is refused), from
    which the grouped GEMMs' tile tables can be built (`grouped_tiles.fill_tile_tables`) without the task tables.
    rows_ptr: int32 [BLOCK_T, K], row (t, j) written with pair (t, j)'s row at its destination (-1: no expert), for
    t < this rank's T (unless the call is refused): at EP = 1 what `pair_combine.PairCombine` reads y by.
    LOCAL (EP = 1 only): the rows go to `local_ptr` ([rows, H] bf16 of this rank, e.g. the GEMMs' y, which holds
    every pair of a call) instead of the receive region, which holds only T_max rows; then no flag is released and
    no program waits: every reader of the rows is a later launch, which starts (or, launched programmatically, passes
    its `griddepcontrol.wait`) only once this whole grid has ended with its stores visible, so the flags' system-scope
    releases and the last program's wait for them only lengthened a decode call's chain. OFFSETS: write the expert
    offsets. PDL (launched with programmatic dependent launch, KernelConfig.chain_pairs): wait for the counts
    kernel before the first load, then let the next kernel's CTAs start (`sync.pdl_enter`): a preloading GEMM0's
    (kernels/ws_decode.py, PRELOAD), which reads only what launches before this one wrote until it waits for it.
    PIPE (1, 2 or 4): a program walks one contiguous range of the pairs PIPE at a time, their rows' loads issued
    together before their stores, the rows counted once per program (`_local_pairs` into local rows, `_peer_pairs`
    into the destinations' regions, which also releases one count per destination per program instead of one per
    pair), so a long call's program waits one load latency per PIPE pairs, not per pair, and reduces over the
    call's ids once, not per pair."""
    if PDL:
        sync.pdl_enter()
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    ee = tl.arange(0, BLOCK_E)
    t = tl.arange(0, BLOCK_T)
    jj = tl.arange(0, KP)
    flat = t[:, None] * KP + jj[None, :]
    mine = _pairs_of(ids_ptr, ids_stride, tokens_ptr, tokens_stride, rank, max_tokens, K, KP, BLOCK_T)
    pairs = tl.load(pairs_ptr + ee, mask=ee < world_size * L, other=0)
    x = call_io_ptr(io_ptr, 0, True)
    idle = sync.status_set(status_ptr)   # a refused call
    if OFFSETS and pid == grid - 1:   # an idle launch's offsets hold no row: the tile tables built from them none
        ll = tl.arange(0, BLOCK_L)
        offsets = tl.sum(tl.where((ee[None, :] >= rank * L) & (ee[None, :] < rank * L + ll[:, None]) & (idle == 0),
                                  pairs[None, :], 0), axis=1)
        tl.store(offsets_ptr + ll, offsets, mask=ll <= L)
    if idle == 0 and LOCAL and PIPE > 1:   # EP = 1, PIPE pairs' rows in flight at once (`_local_pairs`)
        _local_pairs(pid, grid, ids_ptr, ids_stride, mine, flat, pairs, ee, x, rows_ptr, local_ptr, tokens_ptr,
                     tokens_stride, rank, H, K, KP, BLOCK_T, BLOCK_E, BLOCK_H, PIPE)
    elif idle == 0 and PIPE > 1:   # the same into the destinations' receive regions (`_peer_pairs`)
        _peer_pairs(pid, grid, ids_ptr, ids_stride, mine, flat, pairs, ee, x, rows_ptr, tokens_ptr, tokens_stride,
                    peer_base_ptr, recv_offset, pair_rows_offset, flags_offset, rank, world_size, max_tokens, H, L, K,
                    KP, MC, BLOCK_T, BLOCK_E, BLOCK_P, BLOCK_H, PIPE)
    elif idle == 0:   # every program has pairs to walk: no more programs than pairs
        offs_h = tl.arange(0, BLOCK_H)
        n_tok = tl.load(tokens_ptr + rank * tokens_stride)
        for pair in range(pid, tl.minimum(n_tok, BLOCK_T) * KP, grid):   # this call's tokens' slots only
            expert = tl.sum(tl.sum(tl.where(flat == pair, mine, 0), axis=1), axis=0)
            named = ((pair % KP) < K) & ((pair // KP) < n_tok)   # a (token, slot) of this call
            pair_row = rows_ptr + (pair // KP) * K + pair % KP
            if expert < 0:
                tl.store(pair_row, expert * 0 - 1, mask=named)
            else:
                dest = expert // L
                row = tl.sum(tl.where((ee >= dest * L) & (ee < expert), pairs, 0), axis=0)
                for source in range(0, rank):
                    theirs = _pairs_of(ids_ptr, ids_stride, tokens_ptr, tokens_stride, source, max_tokens, K,
                                       KP, BLOCK_T)
                    row += tl.sum(tl.sum((theirs == expert).to(tl.int32), axis=1), axis=0)
                row += tl.sum(tl.sum(((mine == expert) & (flat < pair)).to(tl.int32), axis=1), axis=0)
                token = pair // KP
                tl.store(pair_row, row, mask=named)
                if LOCAL:
                    dst = local_ptr + tl.cast(row, tl.int64) * H
                else:
                    dst = peer_ptr(peer_base_ptr, dest, recv_offset, tl.bfloat16, True) + tl.cast(row, tl.int64) * H
                    tl.store(peer_ptr(peer_base_ptr, dest, pair_rows_offset, tl.int32)
                             + (rank * max_tokens + token) * K + pair % KP, row)
                src = x + tl.cast(token, tl.int64) * H
                for h0 in range(0, H, BLOCK_H):
                    cols = h0 + offs_h
                    tl.store(dst + cols, tl.load(src + cols, mask=cols < H), mask=cols < H)
                if not LOCAL:
                    sync.signal_add(peer_ptr(peer_base_ptr, dest, flags_offset, tl.int32) + rank * MC, 1, True)
    if idle == 0 and pid == grid - 1 and not LOCAL:
        pp = tl.arange(0, BLOCK_P * MC)
        owed = tl.zeros([BLOCK_P * MC], dtype=tl.int32)
        for source in range(0, world_size):
            theirs = _pairs_of(ids_ptr, ids_stride, tokens_ptr, tokens_stride, source, max_tokens, K, KP, BLOCK_T)
            here = tl.sum(tl.sum(((theirs >= rank * L) & (theirs < (rank + 1) * L)).to(tl.int32), axis=1), axis=0)
            owed = tl.where(pp == source * MC, here, owed)
        sync.wait_all_values(arrival_ptr, owed, world_size * MC, status_ptr, sync.ERROR_ARRIVAL_TIMEOUT, 0,
                             timeout_ns, BLOCK_P * MC, True, GROUP=MC)


class PairDispatch:
    """`pair_dispatch_kernel`'s launch for one layer (KernelConfig.pair_dispatch): `launch(...)` after the counts of
    a decode call of at most `max_call_tokens` tokens on every rank, under a serial plan (one chunk), with
    top_k <= E_local (the tables drop no pair)."""

    def __init__(self, world_size: int, num_experts: int, top_k: int, hidden_size: int, max_tokens: int,
                 max_call_tokens: int, num_programs: int, spread: int = 1, recv_rows: int = 0):
        """`num_programs`: the SMs (at most one program per SM; fewer where the call has fewer pairs); `spread`
        (KernelConfig.pair_programs; the backend gives it to the long size class only): where the walk takes
        PIPE_PAIRS pairs per step into local rows (EP = 1), `spread` times the programs (no more than the longest
        call's steps of pairs). `recv_rows`: rows of every rank's receive region (the workspace view's
        `recv_rows`; 0: EP * max_tokens), which must hold every pair a destination can receive at EP > 1,
        EP * max_call_tokens * top_k."""
        local = num_experts // world_size
        if top_k > local:
            raise ValueError(f"top_k = {top_k} > {local} local experts: the task tables drop pairs there")
        if max_call_tokens > max_tokens or max_call_tokens < 1:
            raise ValueError(f"max_call_tokens must be in [1, max_tokens = {max_tokens}], got {max_call_tokens}")
        self.recv_rows = max(recv_rows, world_size * max_tokens)
        if world_size > 1 and world_size * max_call_tokens * top_k > self.recv_rows:
            raise ValueError(f"the pairs of {max_call_tokens} tokens from each of {world_size} ranks "
                             f"({world_size * max_call_tokens * top_k} rows) do not fit the receive region "
                             f"({self.recv_rows} rows): size it with the workspace's recv_rows")
        _check_hidden(hidden_size)
        self.world_size, self.max_tokens, self.hidden_size = world_size, max_tokens, hidden_size
        self.max_call_tokens = max_call_tokens
        self.rows_shape = (triton.next_power_of_2(max_call_tokens), top_k)   # `launch(rows=)`
        KP = triton.next_power_of_2(top_k)
        BLOCK_T = triton.next_power_of_2(max_call_tokens)
        self.num_programs = min(num_programs, BLOCK_T * KP)
        # at EP = 1 (local rows), PIPE_PAIRS pairs per step where the longest call gives each program that many
        self.pipe = PIPE_PAIRS if max_call_tokens * top_k >= PIPE_PAIRS * self.num_programs else 1
        if spread < 1:
            raise ValueError(f"spread must be >= 1, got {spread}")
        if self.pipe > 1 and world_size == 1:   # spread: EP = 1's (local rows) only
            self.num_programs = min(self.num_programs * spread, triton.cdiv(max_call_tokens * top_k, self.pipe))
        self.constants = dict(L=local, K=top_k, KP=KP, MC=MAX_CHUNKS, BLOCK_T=BLOCK_T,
                              BLOCK_E=triton.next_power_of_2(num_experts),
                              BLOCK_P=triton.next_power_of_2(world_size), BLOCK_L=triton.next_power_of_2(local + 1),
                              BLOCK_H=min(4096, triton.next_power_of_2(hidden_size)))

    def _arguments(self, all_ids, tokens, pairs, io, workspace, status, rank, timeout_ns, offsets, rows,
                   local) -> tuple:
        P, T, L = self.world_size, self.max_tokens, self.constants["L"]
        need = self.max_call_tokens * self.rows_shape[1]   # rows of the longest call's pairs
        if local is None:
            if P * need > workspace.recv_rows:
                raise ValueError(f"the pairs of {self.max_call_tokens} tokens from each of {P} ranks ({P * need} "
                                 f"rows) do not fit the receive region ({workspace.recv_rows} rows): give local "
                                 f"rows (EP = 1) or size the region (the workspace's recv_rows)")
            if workspace.pair_slots < P * T * self.constants["K"]:
                raise ValueError(f"the workspace's pair rows region has {workspace.pair_slots} entries, the pair "
                                 f"dispatch writes up to {P * T * self.constants['K']} (EP * T_max * k): attach "
                                 f"the layer with recv_rows")
        if local is not None:
            if P != 1 or local.dtype != torch.bfloat16 or local.dim() != 2 or local.shape[1] != self.hidden_size \
                    or local.shape[0] < need or not local.is_contiguous():
                raise ValueError(f"local rows: EP = 1 and contiguous bf16 [>= {need}, {self.hidden_size}], got EP = "
                                 f"{P}, {local.dtype} {tuple(local.shape)}")
        _check_ids(all_ids, P, T, self.constants["K"])
        _check_plan_columns(tokens, None, P)
        if pairs is None or pairs.dtype != torch.int32 or pairs.numel() != P * L:
            raise ValueError(f"pairs must be the counts vector's int32 pairs per expert [{P * L}]")
        if offsets is not None and (offsets.dtype != torch.int32 or offsets.numel() != L + 1):
            raise ValueError(f"offsets must be int32 [{L + 1}]")
        if rows.dtype != torch.int32 or rows.numel() != self.rows_shape[0] * self.rows_shape[1] \
                or not rows.is_contiguous():
            raise ValueError(f"rows must be contiguous int32 {list(self.rows_shape)}")
        return (all_ids, all_ids.stride(0), tokens, tokens.stride(0), pairs, io, workspace.peer_bases,
                workspace.recv_offset, workspace.pair_rows_offset, workspace.flags_offsets[0], workspace.flags(0),
                status,
                rows if offsets is None else offsets, rows, rows if local is None else local, rank, P, T,
                self.hidden_size, timeout_ns)

    def _variant(self, local, offsets, pdl: bool = False) -> dict:
        """The launch's compile-time switches for these arguments (and its launch option); PIPE only where it is not 1
        (the plain walk's compile keeps its key)."""
        pipe = dict(PIPE=self.pipe) if self.pipe > 1 else {}
        return dict(self.constants, LOCAL=local is not None, OFFSETS=offsets is not None, **pipe,
                    **sync.optional_pdl(pdl))

    def launch(self, all_ids, tokens, pairs, io, workspace, status, rank: int, timeout_ns: int,
               offsets: torch.Tensor | None, rows: torch.Tensor, local: torch.Tensor | None = None,
               pdl: bool = False) -> None:
        """`pairs`: the counts vector's pairs per expert (E int32); `offsets`: int32 [E_local + 1], written with this
        rank's expert offsets (zeros if the call is refused); `rows`: int32 `rows_shape`, row (t, j) written with
        pair (t, j)'s row at its destination, -1 for no expert (t < T; unless the call is refused). `local`: at EP =
        1, bf16 [>= max_call_tokens * top_k, H] rows of this rank to write the pairs' rows into instead of the receive
        region. `offsets` None: not written. `pdl`: launched with programmatic dependent launch (the kernel's PDL)."""
        pair_dispatch_kernel[(self.num_programs,)](
            *self._arguments(all_ids, tokens, pairs, io, workspace, status, rank, timeout_ns, offsets, rows, local),
            **self._variant(local, offsets, pdl), num_warps=NUM_WARPS)

    def warmup(self, all_ids, tokens, pairs, io, workspace, status, rank, timeout_ns, offsets, rows,
               local=None, pdl: bool = False) -> None:
        """Compile for these arguments' specialisation without launching (the layer's first call, before it
        enqueues anything)."""
        pair_dispatch_kernel.warmup(
            *self._arguments(all_ids, tokens, pairs, io, workspace, status, rank, timeout_ns, offsets, rows, local),
            **self._variant(local, offsets, pdl), grid=(self.num_programs,), num_warps=NUM_WARPS)
