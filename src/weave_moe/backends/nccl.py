"""The all-to-all baseline: dedup dispatch with all_to_all_v, grouped GEMM per local expert, all-to-all combine.

This is the standard way serving engines run expert parallelism without a fused kernel, and the baseline every
speed-up of the weave backend is measured against, so on the GPU it is kept strong: two collectives for the data
(one dispatch, one combine) plus one tiny count exchange, no per-expert Python loop, the two GEMMs as
`torch._grouped_mm` over all local experts at once, and dispatch/combine buffers reused across calls.

Per call, on rank r of EP ranks (E_local = E / EP experts each; shape legend in weave_moe.models):
  1. layout: which ranks each token visits. A token goes ONCE to each rank hosting any of its experts (dedup), rows
     ordered by destination rank then token index. Counts per destination: rows and (token, expert) pairs.
  2. count exchange: all_to_all_single of the [EP, 2] counts, then one `.tolist()`: the host needs the split sizes
     for all-to-all-v, so this sync is inherent to the baseline (the weave backend avoids it).
  3. dispatch: one all_to_all_single of packed rows [topk ids local to the destination (-1 elsewhere) | topk
     weights | x | pad to 16 bytes]; packing ids and weights with x saves two collectives per call.
  4. experts: sort received (row, slot) pairs by local expert, gather rows, GEMM0 (gate/up) -> silu(gate) * up in
     fp32 rounded to bf16 -> GEMM1 (down), weighted sum per received row over this rank's experts (fp32).
  5. combine: all_to_all_single of the bf16 partial rows back to their sources; each token sums its partials from
     the ranks it visited (fp32) -> out bf16.
EP=1 (no process group) skips 1-3 and 5.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

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
    """

    __slots__ = ("x", "topk_ids", "topk_weights", "num_pairs", "send_token_idx", "send_rows", "recv_rows")

    def __init__(self, x, topk_ids, topk_weights, num_pairs, send_token_idx, send_rows, recv_rows):
        self.x, self.topk_ids, self.topk_weights = x, topk_ids, topk_weights
        self.num_pairs, self.send_token_idx = num_pairs, send_token_idx
        self.send_rows, self.recv_rows = send_rows, recv_rows


class NcclBackend:
    """all_to_all_v + grouped GEMM MoE (see the module docstring). Runs on NCCL (GPU) and gloo (CPU).

    Buffers: the send side (packed dispatch rows, combine receive, fp32 output accumulator) is allocated once for
    `max_tokens_per_rank`. The receive side depends on what every other rank routes here, up to EP * T rows and
    EP * T * min(k, E_local) pairs; it grows on demand to the largest call seen so far and is then reused, so a
    warmed-up layer allocates nothing but the GEMM outputs (from PyTorch's caching allocator).
    """

    name = "nccl"

    def __init__(self, spec: MoESpec, group, rank: int, world_size: int, max_tokens_per_rank: int,
                 device: torch.device, policy: str = "weave", **options) -> None:
        if options:
            raise TypeError(f"nccl backend: unknown options {sorted(options)}")
        self.spec, self.group, self.rank, self.world_size = spec, group, rank, world_size
        self.device = torch.device(device)
        self.max_tokens_per_rank = max_tokens_per_rank
        self.num_local_experts = spec.num_experts // world_size
        hidden, intermediate, top_k = spec.hidden_size, spec.intermediate_size, spec.top_k
        # torch._grouped_mm (CUDA, sm90+) needs 16-byte aligned strides; other GPUs and shapes (and the CPU) take
        # the per-expert loop fallback, which is correct but slow.
        self.use_grouped_mm = (self.device.type == "cuda" and hasattr(torch, "_grouped_mm")
                               and torch.cuda.get_device_capability(self.device) >= (9, 0)
                               and hidden % 8 == 0 and intermediate % 8 == 0)
        self.w13 = self.w2 = None

        # Packed dispatch row, in bytes: [ids int32 x k | weights fp32 x k | x bf16 x H | pad].
        self._ids_bytes = 4 * top_k
        self._meta_bytes = 8 * top_k
        self.row_bytes = _round_up(self._meta_bytes + 2 * hidden, _ROW_ALIGN_BYTES)
        self._recv_buffers: dict[str, torch.Tensor] = {}
        if world_size > 1:
            max_send_rows = max_tokens_per_rank * min(top_k, world_size)
            self._send = torch.empty(max_send_rows, self.row_bytes, dtype=torch.uint8, device=self.device)
            # One spare slot at the end catches the scatters of (token, rank) pairs that are not sent.
            self._send_token_idx = torch.empty(max_send_rows + 1, dtype=torch.int64, device=self.device)
            self._send_rank = torch.empty(max_send_rows + 1, dtype=torch.int64, device=self.device)
            self._combine_recv = torch.empty(max_send_rows, hidden, dtype=torch.bfloat16, device=self.device)
            self._out32 = torch.empty(max_tokens_per_rank, hidden, dtype=torch.float32, device=self.device)
            self._counts = torch.empty(2, world_size, 2, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ weights
    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """w13 [E_local, 2I, H], w2 [E_local, H, I] bf16 on this backend's device (checked by the layer)."""
        self.w13, self.w2 = w13, w2
        # grouped_mm computes A [M, K] @ B[e] [K, N]: the transposed views need no copy (column-major B is allowed).
        self._w13_t = w13.transpose(1, 2)  # [E_local, H, 2I]
        self._w2_t = w2.transpose(1, 2)  # [E_local, I, H]
        if not self.use_grouped_mm:
            # Fallback (CPU): fp32 copies made once, so each call runs plain fp32 matmuls.
            self._w13_t = self._w13_t.float()
            self._w2_t = self._w2_t.float()

    # ------------------------------------------------------------------ forward
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

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        """Only the dispatch (for tests that check data movement bitwise). The views stay valid until the next call."""
        return self._dispatch(x, topk_ids, topk_weights)

    def poison_workspace(self) -> None:
        """Fill every reusable buffer with NaN / 0xFF bytes, so tests can check that a call writes all it reads."""
        buffers = list(self._recv_buffers.values())
        if self.world_size > 1:
            buffers += [self._send, self._combine_recv, self._out32]
        for buffer in buffers:
            if buffer.dtype == torch.uint8:
                buffer.fill_(0xFF)  # bf16 NaN, int32 -1, fp32 NaN
            else:
                buffer.fill_(float("nan"))

    # ------------------------------------------------------------------ stages
    def _dispatch(self, x, topk_ids, topk_weights) -> Dispatched:
        num_tokens = topk_ids.shape[0]
        if self.world_size == 1:
            num_pairs = int((topk_ids >= 0).sum().item())
            return Dispatched(x, topk_ids, topk_weights, num_pairs, None, [num_tokens], [num_tokens])

        world_size, device = self.world_size, self.device
        # Destination rank of every slot; -1 slots go to a dummy rank `world_size` that is never sent.
        dest_rank = torch.where(topk_ids >= 0, topk_ids // self.num_local_experts, world_size).long()  # [T, k]
        visits = torch.zeros(num_tokens, world_size + 1, dtype=torch.bool, device=device)
        visits.scatter_(1, dest_rank, True)
        visits_by_rank = visits[:, :world_size].t().reshape(-1)  # [EP * T], destination-major: the send order
        send_counts = self._counts[0]
        send_counts[:, 0] = visits_by_rank.view(world_size, num_tokens).sum(1)
        send_counts[:, 1] = _bin_counts(dest_rank.flatten(), world_size + 1)[:world_size]
        recv_counts = self._counts[1]
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)

        # Send slot of each (rank, token) pair, queued behind the count exchange; unsent pairs land in the spare slot.
        spare = self._send_token_idx.shape[0] - 1
        position = torch.where(visits_by_rank, torch.cumsum(visits_by_rank, 0) - 1, spare)
        pair_index = torch.arange(world_size * num_tokens, device=device)
        self._send_token_idx.scatter_(0, position, pair_index % max(num_tokens, 1))
        self._send_rank.scatter_(0, position, pair_index // max(num_tokens, 1))

        counts = self._counts.tolist()  # the one host sync: all-to-all-v needs split sizes on the host
        send_rows = [c[0] for c in counts[0]]
        recv_rows = [c[0] for c in counts[1]]
        num_pairs = sum(c[1] for c in counts[1])
        num_send, num_recv = sum(send_rows), sum(recv_rows)

        token_idx = self._send_token_idx[:num_send]
        send = self._send[:num_send]
        send_ids, send_weights, send_x = self._row_fields(send)
        torch.index_select(x, 0, token_idx, out=send_x)
        row_rank = self._send_rank[:num_send, None]
        row_ids = topk_ids.index_select(0, token_idx)
        local_ids = torch.where(dest_rank.index_select(0, token_idx) == row_rank,
                                row_ids - row_rank * self.num_local_experts, -1)
        send_ids.copy_(local_ids)
        torch.index_select(topk_weights, 0, token_idx, out=send_weights)

        recv = self._recv_buffer("recv", num_recv, (self.row_bytes,), torch.uint8)
        dist.all_to_all_single(recv, send, output_split_sizes=recv_rows, input_split_sizes=send_rows,
                               group=self.group)
        recv_ids, recv_weights, recv_x = self._row_fields(recv)
        return Dispatched(recv_x, recv_ids, recv_weights, num_pairs, token_idx, send_rows, recv_rows)

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
        if num_pairs == 0:
            return partial
        # Group (row, slot) pairs by local expert; foreign / empty slots sort into the bucket after the last expert.
        sort_keys = torch.where(recv_ids >= 0, recv_ids, num_experts).reshape(-1)
        pair_order = torch.argsort(sort_keys, stable=True)[:num_pairs]
        expert_counts = _bin_counts(sort_keys, num_experts + 1)[:num_experts]
        pair_rows = pair_order // top_k
        gathered = self._recv_buffer("gathered", num_pairs, (self.spec.hidden_size,), torch.bfloat16)
        torch.index_select(recv_x, 0, pair_rows, out=gathered)

        if self.use_grouped_mm:
            offsets = torch.cumsum(expert_counts, 0, dtype=torch.int32)
            gate_up = torch._grouped_mm(gathered, self._w13_t, offs=offsets)  # [P, 2I] bf16, fp32 accumulate
        else:
            counts = expert_counts.tolist()
            gate_up = _grouped_mm_fallback(gathered, self._w13_t, counts)
        intermediate = self.spec.intermediate_size
        h = self._recv_buffer("h", num_pairs, (intermediate,), torch.bfloat16)
        torch.mul(F.silu(gate_up[:, :intermediate].float()), gate_up[:, intermediate:], out=h)  # fp32 math, bf16 out
        if self.use_grouped_mm:
            y = torch._grouped_mm(h, self._w2_t, offs=offsets)  # [P, H] bf16
        else:
            y = _grouped_mm_fallback(h, self._w2_t, counts)
        pair_weights = dispatched.topk_weights.reshape(-1)[pair_order]
        partial.index_add_(0, pair_rows, y * pair_weights[:, None])  # bf16 * fp32 -> fp32
        return partial

    def _combine(self, partial: torch.Tensor, dispatched: Dispatched, num_tokens: int) -> torch.Tensor:
        """Send each received row's partial sum back to its source and sum per token -> [T, H] bf16."""
        if self.world_size == 1:
            return partial.to(torch.bfloat16)
        num_send = len(dispatched.send_token_idx)
        combine_send = self._recv_buffer("combine_send", partial.shape[0], (self.spec.hidden_size,),
                                         torch.bfloat16)
        combine_send.copy_(partial)
        combine_recv = self._combine_recv[:num_send]
        dist.all_to_all_single(combine_recv, combine_send, output_split_sizes=dispatched.send_rows,
                               input_split_sizes=dispatched.recv_rows, group=self.group)
        out32 = self._out32[:num_tokens]
        out32.zero_()
        out32.index_add_(0, dispatched.send_token_idx, combine_recv.float())
        return out32.to(torch.bfloat16)

    def _recv_buffer(self, name: str, rows: int, row_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, *row_shape] view of a reusable buffer that grows (x1.5) when a call needs more rows."""
        buffer = self._recv_buffers.get(name)
        if buffer is None or buffer.shape[0] < rows:
            capacity = max(rows, int(1.5 * (buffer.shape[0] if buffer is not None else 0)))
            buffer = torch.empty((capacity, *row_shape), dtype=dtype, device=self.device)
            self._recv_buffers[name] = buffer
        return buffer[:rows]


def _bin_counts(keys: torch.Tensor, num_bins: int) -> torch.Tensor:
    """[num_bins] int64 occurrences of each value of `keys` (in [0, num_bins)). Unlike torch.bincount on CUDA, which
    reads keys.max() back to the host, this never synchronizes."""
    counts = torch.zeros(num_bins, dtype=torch.int64, device=keys.device)
    return counts.scatter_add_(0, keys.long(), torch.ones_like(keys, dtype=torch.int64))


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
