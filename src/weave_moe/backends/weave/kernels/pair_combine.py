"""The combine of a paired call: at EP = 1 (KernelConfig.pair_dispatch) out[t] = sum_j w[t, j] * y[row(t, j)]; at
EP > 1 (`PeerPairCombine`, below; KernelConfig.pair_peers) the same in two levels, through the peers.

Why. After the pair dispatch (kernels/early_dispatch.py, `pair_dispatch_kernel`) each (token, expert) pair has its
own row in expert order, and that kernel wrote the row of pair (t, j) into a [T, k] table. At EP = 1 every pair is
this rank's, so the combine needs nothing else: no task tables (scan, bases, emit), no combine region, no reduce
phase. The megakernel's combine + reduce at EP = 1 computes the same value: its combine sums weight * y over a
token's top-k slots in slot order in fp32 and rounds once to bf16 (`tiles.combine_rows`); its reduce then adds that
one bf16 row into an fp32 zero and rounds again, which changes nothing (`tiles.reduce_rows`). So the two agree bit
for bit wherever the compiler forms the products and sums the same way.

Work. Items (token, BLOCK_H columns) of the call's T tokens are dealt round-robin to the programs; an item loads the
token's k rows and weights, sums in slot order and stores one bf16 row into out (its address from `io`, as the
megakernel reads it). A slot with no expert (row -1) adds nothing; a token with none gets a zero row. A refused call
(the status word set by the counts' verdict) writes NaN rows instead (`tiles.poison_rows`' rule: a caller who ignores
the deferred error cannot mistake them for an answer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weave_moe.backends.weave.kernels import sync
from weave_moe.backends.weave.kernels.early_dispatch import ids_block
from weave_moe.backends.weave.kernels.peers import call_io_ptr, peer_ptr
from weave_moe.plan.workload import MAX_CHUNKS

__all__ = ["PairCombine", "pair_combine_kernel", "PeerPairCombine", "pair_combine_send_kernel",
           "pair_reduce_kernel"]

NUM_WARPS = 2   # 64 threads x 8 bf16 = one BLOCK_H of 512 columns: 16-byte accesses
#: programs per SM at most (`PairCombine.grid`): an item's loads wait one round trip for the rows, then one for y, so
#: a program of two warps keeps ~K x 512 B per warp in flight; one program per SM left a 512-token call's combine
#: (Qwen3-30B-A3B: 2048 items, ~16 per program) at 38.7 us on an H100 for 18 MB (docs/perf-notes.md entry 64)
PROGRAMS_PER_SM = 8


@triton.jit(do_not_specialize=["rank"])
def pair_combine_kernel(y_ptr, rows_ptr, weights_ptr, weights_stride, tokens_ptr, tokens_stride, io_ptr, status_ptr,
                        report_ptr, host_ptr, rank, H, K: tl.constexpr, BLOCK_H: tl.constexpr,
                        REPORT: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, cols] for the items (t, column block) dealt to this program; y: [pairs, H] bf16; rows: int32 [*, K]
    (`pair_dispatch_kernel`'s); weights: fp32, this rank's [T_max, K] at `weights_ptr + rank * weights_stride`.
    PDL (launched with programmatic dependent launch, KernelConfig.chain_pairs): wait for GEMM1 first
    (`sync.pdl_enter`). REPORT: program 0 also copies the call's REPORT status words (`report_ptr`) to the
    host's pinned copy (`host_ptr`), `exchange.copy_status`'s work, so that the call needs no last kernel for it:
    every kernel of a paired call that writes them has ended before this one's first load (launched without PDL it
    starts after them; with PDL it waits for them first): the counts' verdict, a stream-K GEMM's bounded wait (the
    pair dispatch at EP = 1 waits for nothing), and this kernel writes none."""
    if PDL:
        sync.pdl_enter()
    pid = tl.program_id(0)
    if pid == 0:
        words = tl.arange(0, REPORT)
        tl.store(host_ptr + words, tl.load(report_ptr + words))
    grid = tl.num_programs(0)
    n_tok = tl.load(tokens_ptr + rank * tokens_stride)
    blocks = tl.cdiv(H, BLOCK_H)
    out = call_io_ptr(io_ptr, 1, True)
    refused = sync.status_set(status_ptr)
    weights = weights_ptr + rank * weights_stride
    offs_h = tl.arange(0, BLOCK_H)
    for item in range(pid, n_tok * blocks, grid):
        token = item // blocks
        cols = (item % blocks) * BLOCK_H + offs_h
        mask_h = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        if refused == 0:
            for j in tl.static_range(K):
                row = tl.load(rows_ptr + token * K + j)
                weight = tl.load(weights + token * K + j)
                values = tl.load(y_ptr + tl.maximum(row, 0).to(tl.int64) * H + cols, mask=mask_h & (row >= 0),
                                 other=0.0).to(tl.float32)
                acc += weight * values
        else:
            acc += float("nan")
        # the conversion `tiles.combine_rows` makes (round to nearest even on the GPU; the interpreter truncates)
        tl.store(out + tl.cast(token, tl.int64) * H + cols, acc.to(tl.bfloat16), mask=mask_h)


class PairCombine:
    """`pair_combine_kernel`'s launch for one layer at EP = 1: `launch(...)` after GEMM1 of a paired call."""

    def __init__(self, hidden_size: int, top_k: int, max_call_tokens: int, num_sms: int):
        self.hidden_size, self.top_k = hidden_size, top_k
        block_h = min(512, triton.next_power_of_2(hidden_size))
        self.blocks = triton.cdiv(hidden_size, block_h)
        self.max_programs = num_sms * PROGRAMS_PER_SM
        self.num_programs = self.grid(max_call_tokens)   # the longest call's (the warm-up's compile)
        self.constants = dict(K=top_k, BLOCK_H=block_h)

    def grid(self, call_tokens: int) -> int:
        """Programs for a call of `call_tokens` tokens: one per item (token, column block) of a call of
        `call_tokens` rounded up to a power of two, at most PROGRAMS_PER_SM per SM. So a 1-token call launches one
        program per column block, not a grid sized for the layer's longest call; the rounding lets the calls of one
        power-of-two range share a graph (the backend's graph names hold the grid): at most twice their items."""
        return max(1, min(self.max_programs, triton.next_power_of_2(max(call_tokens, 1)) * self.blocks))

    def _arguments(self, y, rows, all_weights, tokens, io, status, rank, report) -> tuple:
        H, K = self.hidden_size, self.top_k
        if y.dtype != torch.bfloat16 or y.dim() != 2 or y.shape[1] != H or not y.is_contiguous():
            raise ValueError(f"y must be contiguous bf16 [pairs, {H}], got {y.dtype} {tuple(y.shape)}")
        if rows.dtype != torch.int32 or rows.dim() != 2 or rows.shape[1] != K or not rows.is_contiguous():
            raise ValueError(f"rows must be contiguous int32 [tokens, {K}], got {rows.dtype} {tuple(rows.shape)}")
        if all_weights.dtype != torch.float32 or all_weights.dim() != 3 or all_weights.shape[2] != K \
                or all_weights.stride(2) != 1 or all_weights.stride(1) != K:
            raise ValueError(f"all_weights must be fp32 [EP, T_max, {K}] with contiguous rows, got "
                             f"{all_weights.dtype} {tuple(all_weights.shape)}")
        words, host = report
        if words.dtype != torch.int32 or host.dtype != torch.int32 or words.shape != host.shape \
                or words.dim() != 1 or words.numel() & (words.numel() - 1):
            raise ValueError(f"report: two int32 [n] tensors, n a power of two (the status words and their host "
                             f"copy), got {words.dtype} {tuple(words.shape)} and {host.dtype} {tuple(host.shape)}")
        return (y, rows, all_weights, all_weights.stride(0), tokens, tokens.stride(0), io, status, words, host, rank,
                H)

    def launch(self, y: torch.Tensor, rows: torch.Tensor, all_weights: torch.Tensor, tokens: torch.Tensor,
               io: torch.Tensor, status: torch.Tensor, rank: int, pdl: bool = False, *, report: tuple,
               call_tokens: int) -> None:
        """Enqueue out = the call's combine (out at `io[1]`, this rank's T tokens from `tokens`); `pdl`: launched
        with programmatic dependent launch (the kernel's PDL); `report`: (the call's status words, their pinned host
        copy), copied as `exchange.copy_status` would (the kernel's REPORT: the call's last kernel, after which the
        caller launches nothing that writes them); `call_tokens`: the call's T as the host knows it (the grid,
        `grid`). Any grid is correct: the items are dealt round-robin over the programs and the kernel reads T from
        `tokens` (a graph replays its grid for every call of its name)."""
        pair_combine_kernel[(self.grid(call_tokens),)](
            *self._arguments(y, rows, all_weights, tokens, io, status, rank, report), **self._variant(pdl, report),
            num_warps=NUM_WARPS)

    def warmup(self, y, rows, all_weights, tokens, io, status, rank, pdl: bool = False, *, report: tuple) -> None:
        """Compile for these arguments' specialisation without launching."""
        pair_combine_kernel.warmup(*self._arguments(y, rows, all_weights, tokens, io, status, rank, report),
                                   **self._variant(pdl, report), grid=(self.num_programs,), num_warps=NUM_WARPS)

    def _variant(self, pdl: bool, report: tuple) -> dict:
        """The launch's constants and launch option."""
        return dict(self.constants, REPORT=report[0].numel(), **sync.optional_pdl(pdl))


# ---- at EP > 1 (docs/perf-notes.md entry 41; the backend's paired calls at EP > 1, KernelConfig.pair_peers) ---------
# After `PairDispatch` (without local rows) each destination d holds every pair of its experts in expert order in its
# receive region and, after the grouped GEMMs, y in that order. The combine is then the megakernel's, with positions
# read from the pair rows region instead of the emit's tables:
# - at d (`pair_combine_send_kernel`): for each (source s, token t) with an expert on d, the sum over t's slots j on
#   d, in slot order, of w[s, t, j] * y[row(s, t, j)] in fp32, rounded once (row(s, t, j): entry (s * T_max + t) * k
#   + j of d's pair rows region, which s's pair dispatch wrote with the row before releasing it), written to s's
#   combine region at row d * T_max + t, and one count released onto s's combine flag d (`tiles.combine_rows` and
#   the megakernel's combine phase do the same with the tables' positions);
# - at s (`pair_reduce_kernel`): once every flag d holds the rows d owes (s's tokens with an expert on d: its own
#   ids), out[t] = the sum over those d, ascending, of the rows (fp32, rounded once), as `tiles.reduce_rows`.


@triton.jit(do_not_specialize=["rank", "world_size", "comb_offset", "flags_offset"])
def pair_combine_send_kernel(ids_ptr, ids_stride, weights_ptr, weights_stride, tokens_ptr, tokens_stride,
                             pair_rows_ptr, y_ptr, peer_base_ptr, comb_offset, flags_offset, status_ptr, rank,
                             world_size, max_tokens, H, L: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                             MC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """The destination side: items (source, token) dealt round-robin to the programs; see the block comment above.
    A refused call sends nothing (the sources' reduce writes NaN rows)."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    offs_h = tl.arange(0, BLOCK_H)
    if sync.status_set(status_ptr) == 0:
        for item in range(pid, world_size * BLOCK_T, grid):
            source = item // BLOCK_T
            token = item % BLOCK_T
            n_tok = tl.load(tokens_ptr + source * tokens_stride)
            if token < n_tok:
                slots = tl.arange(0, KP)
                ids = tl.load(ids_ptr + tl.cast(source, tl.int64) * ids_stride + token * K + slots, mask=slots < K,
                              other=-1)
                here = (ids >= rank * L) & (ids < (rank + 1) * L)
                if tl.sum(here.to(tl.int32), axis=0) > 0:
                    dst = (peer_ptr(peer_base_ptr, source, comb_offset, tl.bfloat16, True)
                           + (tl.cast(rank, tl.int64) * max_tokens + token) * H)
                    for h0 in range(0, H, BLOCK_H):
                        cols = h0 + offs_h
                        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
                        for j in tl.static_range(K):
                            expert = tl.load(ids_ptr + tl.cast(source, tl.int64) * ids_stride + token * K + j)
                            if (expert >= rank * L) & (expert < (rank + 1) * L):
                                row = tl.load(pair_rows_ptr + (tl.cast(source, tl.int64) * max_tokens + token) * K
                                              + j)
                                weight = tl.load(weights_ptr + tl.cast(source, tl.int64) * weights_stride
                                                 + token * K + j)
                                values = tl.load(y_ptr + tl.cast(row, tl.int64) * H + cols, mask=cols < H, other=0.0)
                                acc += weight * values.to(tl.float32)
                        tl.store(dst + cols, acc.to(tl.bfloat16), mask=cols < H)
                    sync.signal_add(peer_ptr(peer_base_ptr, source, flags_offset, tl.int32) + world_size * MC + rank,
                                    1, True)


@triton.jit(do_not_specialize=["rank", "world_size", "timeout_ns"])
def pair_reduce_kernel(ids_ptr, ids_stride, tokens_ptr, tokens_stride, comb_ptr, comb_flag_ptr, io_ptr, status_ptr,
                       rank, world_size, max_tokens, H, timeout_ns, L: tl.constexpr, K: tl.constexpr,
                       KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """The source side: every program waits (bounded) until each destination's combine flag holds the rows it owes
    here, then reduces its items (token, column block) of out (at `io[1]`). A refused call, or a wait that failed,
    writes NaN rows."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    n_tok = tl.load(tokens_ptr + rank * tokens_stride)
    mine = ids_block(ids_ptr, ids_stride, rank, n_tok, 0, max_tokens, K, KP, BLOCK_T)
    dests = tl.arange(0, BLOCK_P)
    # rows owed by destination d: this rank's tokens with an expert on d
    owed = tl.zeros([BLOCK_P], dtype=tl.int32)
    for d in range(0, world_size):
        on_d = tl.sum(((mine >= d * L) & (mine < (d + 1) * L)).to(tl.int32), axis=1) > 0
        owed = tl.where(dests == d, tl.sum(on_d.to(tl.int32), axis=0), owed)
    if sync.status_set(status_ptr) == 0:
        sync.wait_all_values(comb_flag_ptr, owed, world_size, status_ptr, sync.ERROR_COMBINE_TIMEOUT, 0, timeout_ns,
                             BLOCK_P, True)
    failed = sync.status_set(status_ptr)
    out = call_io_ptr(io_ptr, 1, True)
    blocks = tl.cdiv(H, BLOCK_H)
    offs_h = tl.arange(0, BLOCK_H)
    for item in range(pid, n_tok * blocks, grid):
        token = item // blocks
        cols = (item % blocks) * BLOCK_H + offs_h
        slots = tl.arange(0, KP)
        ids = tl.load(ids_ptr + tl.cast(rank, tl.int64) * ids_stride + token * K + slots, mask=slots < K, other=-1)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for d in range(0, world_size):
            if tl.sum(((ids >= d * L) & (ids < (d + 1) * L)).to(tl.int32), axis=0) > 0:
                values = tl.load(comb_ptr + (tl.cast(d, tl.int64) * max_tokens + token) * H + cols, mask=cols < H,
                                 other=0.0)
                acc += values.to(tl.float32)
        if failed != 0:
            acc += float("nan")
        tl.store(out + tl.cast(token, tl.int64) * H + cols, acc.to(tl.bfloat16), mask=cols < H)


class PeerPairCombine:
    """The combine after a pair dispatch at EP > 1 (`send` at every destination after its GEMMs, then `reduce` at
    every source; docs/perf-notes.md entry 41): the paired call's at EP > 1 (KernelConfig.pair_peers). Decode calls
    of at most `max_call_tokens` tokens on every rank."""

    def __init__(self, world_size: int, num_experts: int, top_k: int, hidden_size: int, max_tokens: int,
                 max_call_tokens: int, num_programs: int):
        if not 1 <= max_call_tokens <= max_tokens:
            raise ValueError(f"max_call_tokens must be in [1, max_tokens = {max_tokens}], got {max_call_tokens}")
        self.world_size, self.max_tokens, self.hidden_size, self.top_k = world_size, max_tokens, hidden_size, top_k
        BLOCK_T = triton.next_power_of_2(max_call_tokens)
        block_h = min(512, triton.next_power_of_2(hidden_size))
        self.send_programs = max(1, min(num_programs, world_size * BLOCK_T))
        self.reduce_programs = max(1, min(num_programs, max_call_tokens * triton.cdiv(hidden_size, block_h)))
        self.constants = dict(L=num_experts // world_size, K=top_k, KP=triton.next_power_of_2(top_k), BLOCK_T=BLOCK_T,
                              BLOCK_H=block_h)

    def send_arguments(self, all_ids, all_weights, tokens, y, workspace, status, rank: int) -> tuple:
        """(arguments, compile-time switches) of `send`'s launch."""
        slots = self.world_size * self.max_tokens * self.top_k
        if workspace.pair_slots < slots:
            raise ValueError(f"the workspace's pair rows region has {workspace.pair_slots} entries, the "
                             f"combine reads up to {slots} (EP * T_max * k): attach the layer with recv_rows")
        return ((all_ids, all_ids.stride(0), all_weights, all_weights.stride(0), tokens, tokens.stride(0),
                 workspace.pair_rows(), y, workspace.peer_bases, workspace.comb_offsets[0], workspace.flags_offsets[0],
                 status, rank, self.world_size, self.max_tokens, self.hidden_size),
                dict(self.constants, MC=MAX_CHUNKS, num_warps=NUM_WARPS))

    def reduce_arguments(self, all_ids, tokens, io, workspace, status, rank: int, timeout_ns: int) -> tuple:
        """(arguments, compile-time switches) of `reduce`'s launch."""
        return ((all_ids, all_ids.stride(0), tokens, tokens.stride(0), workspace.comb(0), workspace.comb_flags(0), io,
                 status, rank, self.world_size, self.max_tokens, self.hidden_size, timeout_ns),
                dict(self.constants, BLOCK_P=triton.next_power_of_2(self.world_size), num_warps=NUM_WARPS))

    def send(self, all_ids, all_weights, tokens, y, workspace, status, rank: int) -> None:
        """At this rank (a destination): its rows of every source's tokens, from y (its pairs in expert order, as
        the GEMMs leave them after `PairDispatch`, at the rows its pair rows region names), into the sources'
        parity-0 combine regions of `workspace`."""
        args, options = self.send_arguments(all_ids, all_weights, tokens, y, workspace, status, rank)
        pair_combine_send_kernel[(self.send_programs,)](*args, **options)

    def reduce(self, all_ids, tokens, io, workspace, status, rank: int, timeout_ns: int) -> None:
        """At this rank (a source): out (at `io[1]`) from the rows its destinations sent, after a bounded wait."""
        args, options = self.reduce_arguments(all_ids, tokens, io, workspace, status, rank, timeout_ns)
        pair_reduce_kernel[(self.reduce_programs,)](*args, **options)

    def warmup(self, all_ids, all_weights, tokens, y, io, workspace, status, rank: int, timeout_ns: int) -> None:
        """Compile `send` and `reduce` for these arguments' specialisation without launching (the layer's first
        call, before it enqueues anything)."""
        args, options = self.send_arguments(all_ids, all_weights, tokens, y, workspace, status, rank)
        pair_combine_send_kernel.warmup(*args, **options, grid=(self.send_programs,))
        args, options = self.reduce_arguments(all_ids, tokens, io, workspace, status, rank, timeout_ns)
        pair_reduce_kernel.warmup(*args, **options, grid=(self.reduce_programs,))
