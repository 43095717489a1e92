"""The all-to-all baseline: dedup dispatch with all_to_all_v, grouped GEMM per local expert, all-to-all combine.

This is the standard way serving engines run expert parallelism without a fused kernel, and the baseline every
speed-up of the weave backend is measured against, so on the GPU it is kept strong: two collectives for the data
(one dispatch, one combine) plus one tiny count exchange, no per-expert Python loop, the two GEMMs as
`torch._grouped_mm` over all local experts at once, and dispatch/combine buffers reused across calls.

Per call, on rank r of EP ranks (E_local = E / EP experts each; shape legend in weave_moe.models):
  1. layout: which ranks each token visits. A token goes ONCE to each rank hosting any of its experts (dedup), rows
     ordered by destination rank then token index. Counts per destination: rows and (token, expert) pairs. All of
     it is elementwise ops, two sums, a cumsum and a scatter (no bincount, nonzero or boolean indexing).
  2. count exchange: all_to_all_single of the [EP, 2] counts, then one `.tolist()`: the host needs the split sizes
     for all-to-all-v, so this sync is inherent to the baseline (the weave backend avoids it). It is the only one.
  3. dispatch: one all_to_all_single of packed rows [topk ids local to the destination (-1 elsewhere) | topk
     weights | x | pad to 16 bytes]; packing ids and weights with x saves two collectives per call.
  4. experts: one stable sort of the received (row, slot) pairs by local expert (uint8 keys), group offsets by
     searchsorted, gather rows, GEMM0 (gate/up) -> silu(gate) * up in fp32 rounded to bf16 -> GEMM1 (down),
     weighted sum per received row over this rank's experts (fp32 index_add).
  5. combine: all_to_all_single of the bf16 partial rows back to their sources; each token gathers its partial from
     every rank (a zero row for ranks it did not visit) and sums them in fp32 -> out bf16.
The forward's comment block below lists the per-call op (kernel launch) and sync budget.
EP=1 (no process group) skips 1-3 and 5.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from weave_moe.backends import raise_on_bad_ids
from weave_moe.backends.coordination import HEADER_WORDS, CallCoordinator
from weave_moe.models import MoESpec

__all__ = ["NcclBackend", "Dispatched"]

_ROW_ALIGN_BYTES = 16  # dispatch rows start 16-byte aligned so every field can be viewed in place as its dtype


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class Dispatched:
    """What one rank received in the dispatch (views into the backend's receive buffer, valid until the next call).

    Attributes:
        x: [R, H] bf16 received rows, ordered by source rank, then by token index on the source.
        topk_ids: [R, k] int32 expert ids LOCAL to this rank (global id - rank * E_local); -1 for slots whose
            expert lives elsewhere (or was -1).
        topk_weights: [R, k] fp32 the source token's routing weights (all k slots, unmasked).
        num_pairs: number of slots with a local expert (>= 0), summed over R; None at EP=1 (read from the expert
            offsets then, so that EP=1 also syncs once).
        send_token_idx: [S] int64 token index of each row this rank sent, in send order (destination-major).
        send_rows: rows sent to each rank (list of EP ints); recv_rows: rows received from each rank.
        send_slot: [EP * T] int64, destination-major: 1 + the send row of (rank, token), 0 where the token does not
            visit that rank (the combine gathers with it from a receive buffer whose row 0 is zero).
    """

    __slots__ = ("x", "topk_ids", "topk_weights", "num_pairs", "send_token_idx", "send_rows", "recv_rows",
                 "send_slot")

    def __init__(self, x, topk_ids, topk_weights, num_pairs, send_token_idx, send_rows, recv_rows, send_slot=None):
        self.x, self.topk_ids, self.topk_weights = x, topk_ids, topk_weights
        self.num_pairs, self.send_token_idx = num_pairs, send_token_idx
        self.send_rows, self.recv_rows, self.send_slot = send_rows, recv_rows, send_slot


def _grouped_mm_usable(device: torch.device, hidden: int, intermediate: int) -> bool:
    """torch._grouped_mm needs 16-byte aligned strides; on CUDA sm90+, and on the CPU where this torch has it."""
    if not hasattr(torch, "_grouped_mm") or hidden % 8 or intermediate % 8:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (9, 0)
    if device.type != "cpu":
        return False
    try:  # CPU support arrived later than CUDA's: probe it once
        probe = torch._grouped_mm(torch.zeros(2, 8, dtype=torch.bfloat16),
                                  torch.zeros(1, 8, 8, dtype=torch.bfloat16).transpose(1, 2),
                                  offs=torch.tensor([2], dtype=torch.int32))
        return probe.shape == (2, 8)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class NcclBackend:
    """all_to_all_v + grouped GEMM MoE (see the module docstring). Runs on NCCL (GPU) and gloo (CPU).

    Buffers: the send side (packed dispatch rows, send slot tables, combine receive) is allocated once for
    `max_tokens_per_rank`. The receive side depends on what every other rank routes here, up to EP * T rows and
    EP * T * min(k, E_local) pairs; it grows on demand to the largest call seen so far and is then reused, so a
    warmed-up layer allocates nothing but small per-call temporaries and the GEMM outputs (from PyTorch's caching
    allocator, no kernel launches).
    """

    name = "nccl"
    last_plan = None

    def __init__(self, spec: MoESpec, group, rank: int, world_size: int, max_tokens_per_rank: int,
                 device: torch.device, policy: str = "weave", *, coordinator: CallCoordinator | None = None,
                 **options) -> None:
        if options:
            raise TypeError(f"nccl backend: unknown options {sorted(options)}")
        self.spec, self.group, self.rank, self.world_size = spec, group, rank, world_size
        self.device = torch.device(device)
        #: the per-call header (error code, layer identity, call number) rides on the count exchange; every wait for a
        #: peer is bounded by its timeout_s (see weave_moe.backends.coordination)
        self.coordinator = coordinator or CallCoordinator(group, rank, world_size, self.device)
        self.max_tokens_per_rank = max_tokens_per_rank
        self.num_local_experts = spec.num_experts // world_size
        hidden, intermediate, top_k = spec.hidden_size, spec.intermediate_size, spec.top_k
        # torch._grouped_mm on CUDA sm90+ (and on the CPU where this torch has it); other GPUs and odd shapes take
        # the per-expert loop fallback, which is correct but slow and syncs a second time (expert counts).
        self.use_grouped_mm = _grouped_mm_usable(self.device, hidden, intermediate)
        self.w13 = self.w2 = None

        # Sort keys of received (row, slot) pairs: the local expert id, -1 (elsewhere / none) last. As uint8 the
        # int32 -> uint8 cast alone maps -1 to 255 (one elementwise op, and a single-pass radix sort on CUDA).
        num_experts = self.num_local_experts
        self._key_dtype = torch.uint8 if num_experts < 255 else torch.int32
        self._expert_ids = torch.arange(num_experts, dtype=self._key_dtype, device=self.device)  # searchsorted

        # Packed dispatch row, in bytes: [ids int32 x k | weights fp32 x k | x bf16 x H | pad].
        self._ids_bytes = 4 * top_k
        self._meta_bytes = 8 * top_k
        self.row_bytes = _round_up(self._meta_bytes + 2 * hidden, _ROW_ALIGN_BYTES)
        self._recv_buffers: dict[str, torch.Tensor] = {}
        if world_size > 1:
            max_send_rows = max_tokens_per_rank * min(top_k, world_size)
            max_pairs = world_size * max_tokens_per_rank
            self._ranks = torch.arange(world_size, dtype=torch.int32, device=self.device).view(-1, 1, 1)
            self._pair_index = torch.arange(max_pairs, dtype=torch.int64, device=self.device)
            self._send = torch.empty(max_send_rows, self.row_bytes, dtype=torch.uint8, device=self.device)
            # Slot 0 is the spare that catches the scatters of (rank, token) pairs that are not sent; rows 1.. hold
            # the (rank * T + token) of each send row.
            self._send_pair = torch.empty(max_send_rows + 1, dtype=torch.int64, device=self.device)
            self._send_token_idx = torch.empty(max_send_rows, dtype=torch.int64, device=self.device)
            # Row 0 stays zero for good (the combine gathers it for ranks a token does not visit); the combine's
            # all-to-all writes rows 1..S.
            self._combine_recv = torch.zeros(max_send_rows + 1, hidden, dtype=torch.bfloat16, device=self.device)
            # [sent, received] x destination x (rows, (token, expert) pairs, ids out of [-1, E) on the sender,
            # the sender's call header: HEADER_WORDS words)
            self._counts = torch.zeros(2, world_size, 3 + HEADER_WORDS, dtype=torch.int64, device=self.device)
            # the header of this call for every destination, written on the host (through numpy: no torch op) and
            # copied into the send counts with one copy
            self._header = torch.zeros(world_size, HEADER_WORDS, dtype=torch.int64,
                                       pin_memory=self.device.type == "cuda")
            self._header_numpy = self._header.numpy()
        #: With EP > 1 the id check rides on the count exchange (every rank sees every rank's bad-id count and raises
        #: in the same call; no extra sync).
        self.checks_expert_ids = world_size > 1
        self.check_ids = True

    # ------------------------------------------------------------------ weights
    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """w13 [E_local, 2I, H], w2 [E_local, H, I] bf16 on this backend's device (checked by the layer)."""
        self.w13, self.w2 = w13, w2
        # grouped_mm computes A [M, K] @ B[e] [K, N]: the transposed views need no copy (column-major B is allowed).
        self._w13_t = w13.transpose(1, 2)  # [E_local, H, 2I]
        self._w2_t = w2.transpose(1, 2)  # [E_local, I, H]
        if not self.use_grouped_mm:
            # Fallback: fp32 copies made once, so each call runs plain fp32 matmuls.
            self._w13_t = self._w13_t.float()
            self._w2_t = self._w2_t.float()

    def synchronize(self) -> None:
        """Backend protocol: wait for this rank's last call (no deferred errors here)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ------------------------------------------------------------------ forward
    # Budget per call at EP > 1 with grouped_mm. CUDA and the CPU run the same code; counted on the CPU as aten ops
    # that reach a kernel (views, allocations excluded) by tests/test_nccl_backend.py::test_op_and_sync_budget:
    #   host syncs: exactly 1, the `.tolist()` of the exchanged [2, EP, 2] counts (all-to-all-v needs split sizes on
    #     the host). No bincount, nonzero, boolean-mask indexing, .item(), torch.tensor(list), unique.
    #   dispatch before the sync (12): floor_divide, eq, any, 2 sums into the count buffer, copy_ (the call header,
    #     from the host), count all-to-all, cumsum, mul_ (unsent -> spare slot 0), scatter_ (pair of each send row),
    #     remainder + where (local ids)
    #   dispatch after the sync (5): remainder (token of each row), 3 index_selects into the packed send rows,
    #     payload all-to-all
    #   experts (14): zero_ partial, uint8 keys, sort, searchsorted (group offsets), div (row of each pair),
    #     index_select (gather), grouped_mm, float + silu_ + mul (h), grouped_mm, take (pair weights), mul, index_add_
    #   combine (4): bf16 copy, all-to-all, index_select (each token's partial from every rank, zero row 0 where it
    #     did not visit), sum over ranks (fp32 accumulate, one bf16 rounding)
    #   = 35 ops, + 5 for the id check (lt, ge, or, sum, copy into the counts) = 40; 3 of them NCCL collectives (was
    #     58). On CUDA the sort (a radix sort; uint8 keys need the fewest passes) and the cumsum launch a few kernels
    #     each: roughly 45 launches per call in all.
    # EP=1: 15 ops (skips dispatch and combine but the final bf16 cast); its one sync reads the pair count from the
    # last group offset. The loop fallback (no grouped_mm) syncs a second time, for the per-expert row counts.
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                timings: dict | None = None) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k] int32 in [-1, E), topk_weights [T, k] fp32 (checked) -> [T, H] bf16.

        timings: when a dict is given on CUDA, CUDA events bracket dispatch (layout + count exchange + all-to-all),
        gemms (sort, both GEMMs, SiLU-mul, weighted sum) and combine; after the call (which then synchronizes) it
        holds their milliseconds under "dispatch", "gemms", "combine" and "total". Ignored off CUDA.
        """
        events = None
        if timings is not None and self.device.type == "cuda":
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            events[0].record()
        dispatched = self._dispatch(x, topk_ids, topk_weights)
        if events:
            events[1].record()
        partial = self._experts(dispatched)  # [R, H] fp32
        if events:
            events[2].record()
        out = self._combine(partial, dispatched, x.shape[0])
        if events:
            events[3].record()
            events[3].synchronize()
            for name, (start, end) in {"dispatch": (0, 1), "gemms": (1, 2), "combine": (2, 3), "total": (0, 3)}.items():
                timings[name] = events[start].elapsed_time(events[end])
        return out

    def synchronize(self) -> None:
        """Wait (within the coordinator's timeout_s) until this rank's last call has finished on its device; nothing
        is deferred: errors raise in forward."""
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.coordinator.poll(done.query, "synchronize")

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        """Only the dispatch (for tests that check data movement bitwise). The views stay valid until the next call."""
        return self._dispatch(x, topk_ids, topk_weights)

    def poison_workspace(self) -> None:
        """Fill every reusable buffer with NaN / 0xFF bytes / -1, so tests can check that a call writes all it reads.

        Row 0 of the combine receive buffer is a constant zero row (written once, at construction) and stays."""
        buffers = list(self._recv_buffers.values())
        if self.world_size > 1:
            buffers += [self._send, self._combine_recv[1:], self._send_pair, self._send_token_idx,
                        self._counts]
        for buffer in buffers:
            if buffer.dtype == torch.uint8:
                buffer.fill_(0xFF)  # bf16 NaN, int32 -1, fp32 NaN
            elif buffer.is_floating_point():
                buffer.fill_(float("nan"))
            else:
                buffer.fill_(-1)

    # ------------------------------------------------------------------ stages
    def _dispatch(self, x, topk_ids, topk_weights) -> Dispatched:
        num_tokens, top_k = topk_ids.shape
        if self.world_size == 1:
            return Dispatched(x, topk_ids, topk_weights, None, None, [num_tokens], [num_tokens])

        world_size, num_experts = self.world_size, self.num_local_experts
        num_pairs_all = world_size * num_tokens  # (destination rank, token) pairs, destination-major
        send_counts = self._counts[0]  # [EP, 3 + HEADER_WORDS]: rows, (token, expert) pairs, bad ids, header
        coordinator = self.coordinator
        coordinator.check_usable()
        try:
            # Which ranks each slot / token visits: floor division keeps -1 (no expert) at -1, which matches no rank.
            on_rank = torch.floor_divide(topk_ids, num_experts)[None] == self._ranks  # [EP, T, k] bool
            visits = on_rank.any(2)  # [EP, T]: one row per (token, destination rank) it visits (dedup)
            torch.sum(visits, 1, out=send_counts[:, 0])
            torch.sum(on_rank.view(world_size, -1), 1, out=send_counts[:, 1])
            if self.check_ids:  # ids that floor-divide onto no rank are dropped above: nothing fails before the check
                send_counts[:, 2] = ((topk_ids < -1) | (topk_ids >= self.spec.num_experts)).sum()
        except Exception as error:  # noqa: BLE001 - the peers are in the exchange below: tell them, raise after it
            coordinator.fail(error)
            send_counts[:, :3].zero_()
            on_rank = None
        self._header_numpy[:] = coordinator.header()
        send_counts[:, 3:].copy_(self._header, non_blocking=True)
        count_work = dist.all_to_all_single(self._counts[1], send_counts, group=self.group, async_op=True)

        if on_rank is not None:
            # Queued behind the count exchange: the 1-based send row of every visited (rank, token) pair (0 = not
            # sent), the pair index of each send row, and the local ids every destination gets.
            send_slot = torch.cumsum(visits.view(-1), 0)  # int64
            send_slot.mul_(visits.view(-1))
            self._send_pair.scatter_(0, send_slot, self._pair_index[:num_pairs_all])
            local_ids = torch.where(on_rank, torch.remainder(topk_ids, num_experts), -1)  # [EP, T, k] int32

        coordinator.wait(count_work, "the count exchange")  # bounded: polls on CUDA, work.wait(timeout) on gloo
        counts = self._counts.tolist()  # the one host sync: all-to-all-v needs split sizes on the host
        # Raises on every rank alike: this rank's failure above, a peer's (PeerError), mismatched calls (CallOrderError).
        coordinator.finish([c[3:] for c in counts[1]])
        if self.check_ids:
            raise_on_bad_ids([c[2] for c in counts[1]], self.spec.num_experts)
        send_rows = [c[0] for c in counts[0]]
        recv_rows = [c[0] for c in counts[1]]
        num_pairs = sum(c[1] for c in counts[1])
        num_send, num_recv = sum(send_rows), sum(recv_rows)

        send_pair = self._send_pair[1 : num_send + 1]
        token_idx = torch.remainder(send_pair, max(num_tokens, 1), out=self._send_token_idx[:num_send])
        send = self._send[:num_send]
        send_ids, send_weights, send_x = self._row_fields(send)
        torch.index_select(x, 0, token_idx, out=send_x)
        torch.index_select(local_ids.view(num_pairs_all, top_k), 0, send_pair, out=send_ids)
        torch.index_select(topk_weights, 0, token_idx, out=send_weights)

        recv = self._recv_buffer("recv", num_recv, (self.row_bytes,), torch.uint8)
        work = dist.all_to_all_single(recv, send, output_split_sizes=recv_rows, input_split_sizes=send_rows,
                                      group=self.group, async_op=True)
        coordinator.wait(work, "the dispatch all-to-all", host=False)  # CUDA: bounded at the next call's exchange
        recv_ids, recv_weights, recv_x = self._row_fields(recv)
        return Dispatched(recv_x, recv_ids, recv_weights, num_pairs, token_idx, send_rows, recv_rows, send_slot)

    def _row_fields(self, rows: torch.Tensor):
        """(ids [N, k] int32, weights [N, k] fp32, x [N, H] bf16) views of packed rows [N, row_bytes] uint8."""
        hidden = self.spec.hidden_size
        ids = rows[:, : self._ids_bytes].view(torch.int32)
        weights = rows[:, self._ids_bytes : self._meta_bytes].view(torch.float32)
        x = rows[:, self._meta_bytes : self._meta_bytes + 2 * hidden].view(torch.bfloat16)
        return ids, weights, x

    def _experts(self, dispatched: Dispatched) -> torch.Tensor:
        """Weighted sum over this rank's experts for every received row -> [R, H] fp32."""
        recv_x, recv_ids = dispatched.x, dispatched.topk_ids
        num_rows, top_k = recv_ids.shape
        num_pairs, num_experts = dispatched.num_pairs, self.num_local_experts
        partial = self._recv_buffer("partial", num_rows, (self.spec.hidden_size,), torch.float32)
        partial.zero_()
        if num_pairs == 0 or num_rows == 0:
            return partial
        # Group (row, slot) pairs by local expert with one stable sort; foreign / empty slots sort last.
        if self._key_dtype == torch.uint8:
            sort_keys = recv_ids.to(torch.uint8)  # -1 -> 255
        else:
            sort_keys = torch.where(recv_ids >= 0, recv_ids, num_experts)
        sorted_keys, order = torch.sort(sort_keys.reshape(-1), stable=True)
        # offsets[e] = pairs of experts <= e: the end of each expert's group, as grouped_mm wants it.
        offsets = torch.searchsorted(sorted_keys, self._expert_ids, right=True, out_int32=True)
        counts = None
        if num_pairs is None or not self.use_grouped_mm:  # EP=1's one sync, or the fallback's second one
            ends = offsets.tolist()
            num_pairs = ends[-1]
            counts = [end - start for start, end in zip([0] + ends[:-1], ends)]
            if num_pairs == 0:
                return partial
        pair_order = order[:num_pairs]
        pair_rows = torch.div(pair_order, top_k, rounding_mode="floor")
        gathered = self._recv_buffer("gathered", num_pairs, (self.spec.hidden_size,), torch.bfloat16)
        torch.index_select(recv_x, 0, pair_rows, out=gathered)

        if self.use_grouped_mm:
            gate_up = torch._grouped_mm(gathered, self._w13_t, offs=offsets)  # [P, 2I] bf16, fp32 accumulate
        else:
            gate_up = _grouped_mm_fallback(gathered, self._w13_t, counts)
        intermediate = self.spec.intermediate_size
        h = self._recv_buffer("h", num_pairs, (intermediate,), torch.bfloat16)
        gate = F.silu(gate_up[:, :intermediate].float(), inplace=True)
        torch.mul(gate, gate_up[:, intermediate:], out=h)  # fp32 math, bf16 out
        if self.use_grouped_mm:
            y = torch._grouped_mm(h, self._w2_t, offs=offsets)  # [P, H] bf16
        else:
            y = _grouped_mm_fallback(h, self._w2_t, counts)
        pair_weights = torch.take(dispatched.topk_weights, pair_order)  # reads the strided view in place
        partial.index_add_(0, pair_rows, y * pair_weights[:, None])  # bf16 * fp32 -> fp32
        return partial

    def _combine(self, partial: torch.Tensor, dispatched: Dispatched, num_tokens: int) -> torch.Tensor:
        """Send each received row's partial sum back to its source and sum per token -> [T, H] bf16."""
        if self.world_size == 1:
            return partial.to(torch.bfloat16)
        hidden = self.spec.hidden_size
        num_send = len(dispatched.send_token_idx)
        combine_send = self._recv_buffer("combine_send", partial.shape[0], (hidden,), torch.bfloat16)
        combine_send.copy_(partial)
        work = dist.all_to_all_single(self._combine_recv[1 : num_send + 1], combine_send,
                                      output_split_sizes=dispatched.send_rows, input_split_sizes=dispatched.recv_rows,
                                      group=self.group, async_op=True)
        self.coordinator.wait(work, "the combine all-to-all", host=False)
        # Each token's partial from every rank, the zero row 0 where it did not visit the rank; the sum over ranks
        # accumulates in fp32 and rounds to bf16 once (as the fp32 index_add it replaces did), in a fixed order.
        partials = self._combine_recv.index_select(0, dispatched.send_slot)
        return partials.view(self.world_size, num_tokens, hidden).sum(0)

    def _recv_buffer(self, name: str, rows: int, row_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, *row_shape] view of a reusable buffer that grows (x1.5) when a call needs more rows."""
        buffer = self._recv_buffers.get(name)
        if buffer is None or buffer.shape[0] < rows:
            capacity = max(rows, int(1.5 * (buffer.shape[0] if buffer is not None else 0)))
            buffer = torch.empty((capacity, *row_shape), dtype=dtype, device=self.device)
            self._recv_buffers[name] = buffer
        return buffer[:rows]


def _grouped_mm_fallback(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`torch._grouped_mm` semantics off CUDA: a [M, K] bf16 rows grouped by expert (`counts` rows each), b [E, K, N]
    fp32 -> [M, N] bf16 (fp32 math, one rounding at the end, as the CUDA kernel does)."""
    out = torch.empty(a.shape[0], b.shape[2], dtype=torch.bfloat16, device=a.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            out[start : start + count] = a[start : start + count].float() @ b[expert]
            start += count
    return out
