"""The all-to-all baseline: dedup dispatch with all_to_all_v, grouped GEMM over local experts, all-to-all combine.

This is the standard way serving engines run expert parallelism without a fused kernel, built as strong as torch
allows: two collectives for the data (one dispatch, one combine) plus one tiny count exchange, the two GEMMs as
`torch._grouped_mm` over all local experts at once, the glue around them as three small Triton kernels on CUDA
(backends/expert_stage.py: bf16 permute by one gather, SiLU-mul without an fp32 round trip, the weighted
un-permute as a gather-sum without an fp32 [P, H] temporary or atomics), and every buffer allocated once for
`max_tokens_per_rank`.

Per call, on rank r of EP ranks (E_local = E / EP experts each; shape legend in weave_moe.models):
  1. layout: which ranks each token visits. A token goes ONCE to each rank hosting any of its experts (dedup), rows
     ordered by destination rank then token index. Counts per destination: rows and (token, expert) pairs. All of
     it is elementwise ops, two sums, a cumsum and a scatter (no bincount, nonzero or boolean indexing).
  2. count exchange: all_to_all_single of the [EP, 3] counts and the call header (weave_moe.backends.coordination:
     a rank that cannot make the call sends T = 0 and its error code, and every rank raises after this exchange),
     then one `.tolist()`: the host needs the split sizes for all-to-all-v, so this sync is inherent to the baseline
     (the weave and symm backends avoid it). It is the only one, and its wait is bounded by the layer's timeout_s.
  3. dispatch: one all_to_all_single of packed rows [topk ids local to the destination (-1 elsewhere) | topk
     weights | x | pad to 16 bytes]; packing ids and weights with x saves two collectives per call.
  4. experts (`GroupedExperts.run`): sort the received (row, slot) pairs by local expert, gather rows, GEMM0,
     SiLU-mul, GEMM1, then each received row's weighted sum over its slots -> bf16, straight into the combine's
     send buffer.
  5. combine: all_to_all_single of the bf16 partial rows back to their sources; each token gathers its partial from
     every rank it visited and sums them in fp32 (the same gather-sum kernel, weight 1) -> out bf16.
EP=1 (no process group) skips 1-3 and 5 and makes no host sync at all: the expert stage reads its pair count on
the device. The forward's comment block lists the per-call op (kernel launch) and sync budget.

Memory, allocated once: the receive side is sized for the worst case (every rank sends every token here), EP * T
rows of H + 8k bf16-equivalents, and EP * T * min(k, E_local) gathered pairs of H + I bf16. Per call, the two
GEMM outputs (`torch._grouped_mm` has no `out=`), the returned [T, H] and the layout's small [EP, T, k] temporaries
come from PyTorch's caching allocator (no device allocation once warm, no kernel launch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from weave_moe.backends import raise_on_bad_ids
from weave_moe.backends.coordination import HEADER_WORDS, CallCoordinator
from weave_moe.backends.expert_stage import GroupedExperts, StageTimer, gather_weighted_sum
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
        num_pairs: number of slots with a local expert (>= 0), summed over R.
        send_token_idx: [S] int64 token index of each row this rank sent, in send order (destination-major).
        send_rows: rows sent to each rank (list of EP ints); recv_rows: rows received from each rank.
        send_slot: [EP * T] int64, destination-major: 1 + the send row of (rank, token), 0 where the token does not
            visit that rank (the combine gathers with it from a receive buffer whose row 0 is zero).
    """

    __slots__ = ("x", "topk_ids", "topk_weights", "num_pairs", "send_token_idx", "send_rows", "recv_rows",
                 "send_slot")

    def __init__(self, x, topk_ids, topk_weights, num_pairs, send_token_idx, send_rows, recv_rows, send_slot):
        self.x, self.topk_ids, self.topk_weights = x, topk_ids, topk_weights
        self.num_pairs, self.send_token_idx = num_pairs, send_token_idx
        self.send_rows, self.recv_rows, self.send_slot = send_rows, recv_rows, send_slot


class NcclBackend:
    """all_to_all_v + grouped GEMM MoE (see the module docstring). Runs on NCCL (GPU) and gloo (CPU).

    With a process group (even of one rank) it exchanges; with group=None (the layer's EP=1) it computes locally.
    """

    name = "nccl"
    narrows_int64_ids = False
    last_plan = None  # no weave plan

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
        hidden, top_k = spec.hidden_size, spec.top_k
        self.use_exchange = group is not None
        max_rows = world_size * max_tokens_per_rank if self.use_exchange else max_tokens_per_rank
        max_pairs = max_rows * min(top_k, self.num_local_experts)
        self.experts = GroupedExperts(self.num_local_experts, hidden, spec.intermediate_size,
                                      max_slots=max_rows * top_k, max_pairs=max_pairs, device=self.device)
        self.use_grouped_mm = self.experts.use_grouped_mm
        self._no_limit = torch.full((1,), 2**31 - 1, dtype=torch.int32, device=self.device)

        # Packed dispatch row, in bytes: [ids int32 x k | weights fp32 x k | x bf16 x H | pad].
        self._ids_bytes = 4 * top_k
        self._meta_bytes = 8 * top_k
        self.row_bytes = _round_up(self._meta_bytes + 2 * hidden, _ROW_ALIGN_BYTES)
        if self.use_exchange:
            max_send_rows = max_tokens_per_rank * min(top_k, world_size)
            self._ranks = torch.arange(world_size, dtype=torch.int32, device=self.device).view(-1, 1, 1)
            self._pair_index = torch.arange(world_size * max_tokens_per_rank, dtype=torch.int64, device=self.device)
            self._send = torch.empty(max_send_rows, self.row_bytes, dtype=torch.uint8, device=self.device)
            self._recv = torch.empty(max_rows, self.row_bytes, dtype=torch.uint8, device=self.device)
            # Slot 0 is the spare that catches the scatters of (rank, token) pairs that are not sent; rows 1.. hold
            # the (rank * T + token) of each send row.
            self._send_pair = torch.empty(max_send_rows + 1, dtype=torch.int64, device=self.device)
            self._send_token_idx = torch.empty(max_send_rows, dtype=torch.int64, device=self.device)
            self._combine_send = torch.empty(max_rows, hidden, dtype=torch.bfloat16, device=self.device)
            # Row 0 stays zero for good (the combine gathers it for ranks a token does not visit); the combine's
            # all-to-all writes rows 1..S.
            self._combine_recv = torch.zeros(max_send_rows + 1, hidden, dtype=torch.bfloat16, device=self.device)
            # [sent, received] x destination x (rows, (token, expert) pairs, ids out of [-1, E) on the sender,
            # the sender's call header: HEADER_WORDS words)
            self._counts = torch.zeros(2, world_size, 3 + HEADER_WORDS, dtype=torch.int64, device=self.device)
            # the call header for every destination, written on the host (through a numpy view: no torch op) and
            # copied into the send counts with one copy
            self._header = torch.zeros(world_size, HEADER_WORDS, dtype=torch.int64,
                                       pin_memory=self.device.type == "cuda")
            self._header_numpy = self._header.numpy()
        #: With an exchange the id check rides on the count exchange (every rank sees every rank's bad-id count and
        #: raises in the same call; no extra sync).
        self.checks_expert_ids = self.use_exchange
        #: EP = 1 runs the expert stage alone, which reads its pair count on the device; an exchange's all-to-all-v
        #: needs the split sizes on the host.
        self.capturable = not self.use_exchange

    def synchronize(self) -> None:
        """Wait (within the coordinator's timeout_s) until this rank's last call has finished on its device; nothing
        is deferred: errors raise in forward."""
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.coordinator.poll(done.query, "synchronize")

    # ------------------------------------------------------------------ weights
    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """w13 [E_local, 2I, H], w2 [E_local, H, I] bf16 on this backend's device (checked by the layer)."""
        self.w13, self.w2 = w13, w2
        self.experts.load(w13, w2)

    # ------------------------------------------------------------------ forward
    # Budget per call with grouped_mm, counted by tests/test_nccl_backend.py::test_op_and_sync_budget on the CPU as
    # aten ops that reach a kernel (views and allocations excluded). CUDA runs the same host code with the three
    # helpers of expert_stage.py as one Triton kernel each, where the CPU runs a few torch ops for each.
    #   host syncs: exactly 1 with an exchange, the `.tolist()` of the exchanged [2, EP, 3] counts (all-to-all-v
    #     needs split sizes on the host); 0 at EP=1. No bincount, nonzero, boolean-mask indexing, .item(), unique.
    #   dispatch before the sync (12): floor_divide, eq, any, 2 sums into the count buffer, copy_ (the call header,
    #     from the host), count all-to-all, cumsum, mul_ (unsent -> spare slot 0), scatter_ (pair of each send row),
    #     remainder + where (local ids)
    #   dispatch after the sync (5): remainder (token of each row), 3 index_selects into the packed send rows,
    #     payload all-to-all
    #   experts (CUDA 9 launches-equivalent): uint8 keys, sort, searchsorted (group ends), scatter_ (sorted
    #     position of each slot), gather [Triton], grouped_mm, silu_mul [Triton], grouped_mm, gather_weighted_sum
    #     [Triton] -> bf16 rows in the combine's send buffer
    #   combine (CUDA 2): all-to-all, gather_weighted_sum [Triton] (each token's partial from every rank it visited)
    #   = 28 launches-equivalent on CUDA, 3 of them NCCL collectives (the torch-glue version took 34, and ~40 kernel
    #   launches); on the CPU the Triton helpers are 2 + 3 + ~9 torch ops each (see _OP_BUDGET in the test).
    #   EP=1: the experts stage alone (9 on CUDA), no sync.
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                timings: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k] int32 in [-1, E), topk_weights [T, k] fp32 (checked) -> [T, H] bf16.

        timings: when a dict is given on CUDA, CUDA events bracket the stages and, after the call (which then
        synchronizes), it holds their milliseconds: "dispatch" (layout, count exchange, all-to-all; with an
        exchange only), "permute" (sort, gather), "gemms" (GEMM0, SiLU-mul, GEMM1: compare with torch._grouped_mm
        alone), "unpermute" (weighted sum per received row), "combine" (with an exchange only) and "total".
        Ignored off CUDA.
        """
        timer = StageTimer(self.device, timings is not None)
        if not self.use_exchange:
            return self.experts.forward_local(x, topk_ids, topk_weights, timer, timings)
        dispatched = self._dispatch(x, topk_ids, topk_weights)
        timer.mark("dispatch")
        partial = self._combine_send[: dispatched.x.shape[0]]
        self.experts.run(dispatched.x, dispatched.topk_ids, dispatched.topk_weights, partial,
                         num_pairs=dispatched.num_pairs, timer=timer)
        out = self._combine(partial, dispatched, x.shape[0])
        timer.mark("combine")
        timer.finish(timings)
        return out

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        """Only the dispatch (for tests that check data movement bitwise). The views stay valid until the next call."""
        if not self.use_exchange:
            num_tokens = x.shape[0]
            return Dispatched(x, topk_ids, topk_weights, None, None, [num_tokens], [num_tokens], None)
        return self._dispatch(x, topk_ids, topk_weights)

    def poison_workspace(self) -> None:
        """Fill every reusable buffer with NaN / 0xFF bytes / -1, so tests can check that a call writes all it reads.

        Row 0 of the combine receive buffer is a constant zero row (written once, at construction) and stays."""
        buffers = self.experts.buffers()
        if self.use_exchange:
            buffers += [self._send, self._recv, self._combine_send, self._combine_recv[1:], self._send_pair,
                        self._send_token_idx, self._counts]
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
        world_size, num_local_experts = self.world_size, self.num_local_experts
        num_pairs_all = world_size * num_tokens  # (destination rank, token) pairs, destination-major
        send_counts = self._counts[0]  # [EP, 3 + HEADER_WORDS]: rows, (token, expert) pairs, bad ids, header
        coordinator = self.coordinator
        coordinator.check_usable()
        try:
            # Which ranks each slot / token visits: floor division keeps -1 (no expert) at -1, which matches no rank.
            on_rank = torch.floor_divide(topk_ids, num_local_experts)[None] == self._ranks  # [EP, T, k] bool
            visits = on_rank.any(2)  # [EP, T]: one row per (token, destination rank) it visits (dedup)
            torch.sum(visits, 1, out=send_counts[:, 0])
            torch.sum(on_rank.view(world_size, -1), 1, out=send_counts[:, 1])
            # ids that floor-divide onto no rank are dropped above, so nothing fails before this check
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
            local_ids = torch.where(on_rank, torch.remainder(topk_ids, num_local_experts), -1)  # [EP, T, k] int32

        coordinator.wait(count_work, "the count exchange")  # bounded: polls on CUDA, work.wait(timeout) on gloo
        counts = self._counts.tolist()  # the one host sync: all-to-all-v needs split sizes on the host
        # Raises on every rank alike: this rank's failure above, a peer's (PeerError), mismatched calls (CallOrderError).
        coordinator.finish([c[3:] for c in counts[1]])
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

        recv = self._recv[:num_recv]
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

    def _combine(self, partial: torch.Tensor, dispatched: Dispatched, num_tokens: int) -> torch.Tensor:
        """Send each received row's partial sum back to its source and sum per token -> [T, H] bf16."""
        num_send = len(dispatched.send_token_idx)
        work = dist.all_to_all_single(self._combine_recv[1 : num_send + 1], partial,
                                      output_split_sizes=dispatched.send_rows, input_split_sizes=dispatched.recv_rows,
                                      group=self.group, async_op=True)
        self.coordinator.wait(work, "the combine all-to-all", host=False)
        # Each token's partial from every rank (the zero row 0 where it did not visit), summed in fp32 in rank order.
        out = torch.empty(num_tokens, self.spec.hidden_size, dtype=torch.bfloat16, device=self.device)
        rank_slots = dispatched.send_slot.view(self.world_size, num_tokens).t()  # [T, EP]
        return gather_weighted_sum(self._combine_recv, rank_slots, None, out, self._no_limit)
