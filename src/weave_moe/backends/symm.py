"""The symm baseline: PyTorch symmetric memory's NVSHMEM all-to-all for MoE + grouped GEMM, with no host sync.

`torch.ops.symm_mem.all_to_all_vdev_2d` (dispatch) and `all_to_all_vdev_2d_offset` (combine) take their split sizes
on the device, so a call never waits for the host: what a serving engine would write with PyTorch alone.

The op's limits shape the layout. Its dispatch groups rows by (destination rank, expert) but allows at most 16
"experts" per rank (one 32-thread tile each in a 512-thread block), so this backend hands it B = min(E_local, 16)
buckets of consecutive local experts per rank. Each (token, expert) pair is one row (no dedup: a token whose k experts
live on one rank is sent k times, where the nccl and deepep backends send it once); rows are
[local expert id int32 | pad | x bf16 x H at byte 16 | pad to 16 bytes]. The combine op allows at most 16 ranks.

Per call (EP > 1), on a rank with T tokens:
  1. source: one stable sort of the T*k global expert ids (-1 last); searchsorted at the bucket boundaries gives the
     [EP*B] input splits; the rows are packed in that order (a gather of x, fused with the pair -> token division);
  2. `all_to_all_vdev_2d`: every rank pulls its buckets; received rows are bucket-major, then source rank, and the
     received splits / offsets land in a symmetric [2, EP*B] tensor. The op gives an empty bucket one row anyway
     (its output stays grouped-GEMM friendly); such a row keeps stale bytes, is computed like any row (at most
     EP*B of them) and is never sent back;
  3. experts (`GroupedExperts`, one slot per row, no weights): sort the received rows by local expert id (rows past
     the received count, read on the device, get -1), gather, GEMM0, SiLU-mul, GEMM1, and write each row's result
     back in place of its input row (rows past the count untouched);
  4. `all_to_all_vdev_2d_offset` with the dispatch's received splits / offsets as its input: every row returns to
     the slot it was sent from, so the source's buffer again holds its rows in send order;
  5. each token's weighted sum over its k pair rows (by their sorted positions, fp32, bf16 out).
Buffers are allocated once as symmetric memory: send [T*k rows] (also the combine's output) and receive
[EP*T*min(k, E_local) + B rows] (also the combine's input). Every rank must use the same `max_tokens_per_rank`.

Requirements and limits:
  * CUDA with NVSHMEM (`symm_mem.is_nvshmem_available()`); elsewhere constructing the backend raises RuntimeError.
  * PyTorch picks ONE symmetric-memory backend per process and cannot switch once a tensor is allocated: the weave
    backend uses CUDA IPC symmetric memory, so symm and weave cannot run in the same process (a clear RuntimeError
    here); benchmarks run them in separate processes.
  * NVSHMEM's symmetric heap must hold both buffers: if NVSHMEM_SYMMETRIC_SIZE is unset when the first symm layer
    of a process is built, it is set to this layer's need plus 512 MiB (later layers must fit in it; set the
    variable yourself for several layers).
  * With no process group (EP=1) nothing is exchanged and the expert stage runs alone (NVSHMEM still required, so
    that the backend is what it says).
"""

from __future__ import annotations

import os

import torch

from weave_moe.backends.coordination import CallCoordinator
from weave_moe.backends.expert_stage import GroupedExperts, StageTimer, gather_rows, gather_weighted_sum
from weave_moe.models import MoESpec

__all__ = ["SymmBackend", "MAX_BUCKETS"]

#: The dispatch op's limit on "experts" per rank: THREADS_PER_BLOCK (512) / the 32-thread tile of each.
MAX_BUCKETS = 16
_MAX_RANKS = 16  # the combine op's limit (one 32-thread tile per rank in a 512-thread block)
_ROW_ALIGN_BYTES = 16
_HEAP_MARGIN_BYTES = 512 * 2**20


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _symmetric_memory(device: torch.device):
    """torch.distributed._symmetric_memory with the NVSHMEM backend selected, or a RuntimeError saying why not."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"symm backend needs a CUDA device with NVSHMEM (PyTorch symmetric memory's NVSHMEM "
                           f"backend); got device {device}")
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        raise RuntimeError("symm backend needs NVSHMEM: torch.distributed._symmetric_memory.is_nvshmem_available() "
                           "is False in this torch build / environment")
    current = symm_mem.get_backend(device)
    if current != "NVSHMEM":
        try:
            symm_mem.set_backend("NVSHMEM")
        except RuntimeError as error:
            raise RuntimeError(f"symm backend needs PyTorch's NVSHMEM symmetric-memory backend, but this process "
                               f"already uses the {current!r} backend (the weave backend allocates CUDA IPC symmetric "
                               f"memory) and PyTorch cannot switch once a tensor is allocated: run symm in a separate "
                               f"process") from error
    return symm_mem


class SymmBackend:
    """NVSHMEM all_to_all_vdev_2d dispatch / combine + grouped GEMM (see the module docstring). CUDA only.

    Failures across ranks (weave_moe.backends.coordination): the NVSHMEM ops take no header, so a call is not
    checked for its layer and call number (construction is). A rank whose input the layer rejects still makes the
    call with T = 0 (the layer hands it empty inputs), so no peer waits for it: that rank alone raises, the others
    get their correct outputs. The ops' device-side waits are NVSHMEM's own (not bounded by the layer's timeout_s).
    """

    name = "symm"
    last_plan = None  # no weave plan
    checks_expert_ids = False  # the layer checks ids (one host sync) when asked to
    narrows_int64_ids = False
    capturable = False   # its exchange sizes the receive on the host

    def __init__(self, spec: MoESpec, group, rank: int, world_size: int, max_tokens_per_rank: int,
                 device: torch.device, policy: str = "weave", *, coordinator: CallCoordinator | None = None,
                 **options) -> None:
        if options:
            raise TypeError(f"symm backend: unknown options {sorted(options)}")
        self.coordinator = coordinator  # held, not used: see the class docstring
        device = torch.device(device)
        symm_mem = self._symmetric_memory(device)
        self.spec, self.group, self.rank, self.world_size = spec, group, rank, world_size
        self.device = device
        self.max_tokens_per_rank = max_tokens_per_rank
        num_local_experts = self.num_local_experts = spec.num_experts // world_size
        hidden, top_k = spec.hidden_size, spec.top_k
        self.use_exchange = group is not None
        if self.use_exchange and world_size > _MAX_RANKS:
            raise ValueError(f"symm backend: all_to_all_vdev_2d_offset allows at most {_MAX_RANKS} ranks, got "
                             f"EP={world_size}")
        if not self.use_exchange:
            max_slots = max_tokens_per_rank * top_k
            self.experts = GroupedExperts(num_local_experts, hidden, spec.intermediate_size, max_slots=max_slots,
                                          max_pairs=max_slots, device=device)
            self.use_grouped_mm = self.experts.use_grouped_mm
            return

        self.num_buckets = min(num_local_experts, MAX_BUCKETS)
        send_rows = max_tokens_per_rank * top_k
        # + one row per bucket: the op gives an empty bucket a row, which shifts the buckets after it.
        recv_rows = world_size * max_tokens_per_rank * min(top_k, num_local_experts) + self.num_buckets
        self.row_bytes = _round_up(_ROW_ALIGN_BYTES + 2 * hidden, _ROW_ALIGN_BYTES)
        heap_bytes = (send_rows + recv_rows) * self.row_bytes + _HEAP_MARGIN_BYTES
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap_bytes))
        self.group_name = group.group_name
        symm_mem.enable_symm_mem_for_group(self.group_name)
        num_splits = world_size * self.num_buckets
        self._send = symm_mem.empty(send_rows, self.row_bytes, dtype=torch.uint8, device=device)
        self._recv = symm_mem.empty(recv_rows, self.row_bytes, dtype=torch.uint8, device=device)
        self._in_splits = symm_mem.empty(num_splits, dtype=torch.int64, device=device)
        self._dispatch_splits_offsets = symm_mem.empty(2, num_splits, dtype=torch.int64, device=device)
        self._combine_splits_offsets = symm_mem.empty(2, num_splits, dtype=torch.int64, device=device)
        for tensor in (self._send, self._recv, self._in_splits, self._dispatch_splits_offsets,
                       self._combine_splits_offsets):
            symm_mem.rendezvous(tensor, self.group_name)

        # Bucket b of rank r holds local experts [b * E_local // B, (b + 1) * E_local // B): boundaries as global ids.
        first_experts = [r * num_local_experts + b * num_local_experts // self.num_buckets
                         for r in range(world_size) for b in range(self.num_buckets)]
        self._bucket_bounds = torch.tensor(first_experts + [spec.num_experts], dtype=torch.int32, device=device)
        self._bound_positions = torch.empty(num_splits + 1, dtype=torch.int64, device=device)
        self._send_keys = torch.empty(send_rows, dtype=torch.int32, device=device)
        self._send_order = torch.empty(send_rows, dtype=torch.int64, device=device)
        self._send_position = torch.empty(send_rows, dtype=torch.int32, device=device)
        self._slot_index = torch.arange(send_rows, dtype=torch.int32, device=device)
        self._recv_row_index = torch.arange(recv_rows, dtype=torch.int32, device=device).view(-1, 1)
        self._recv_ids = torch.empty(recv_rows, 1, dtype=torch.int32, device=device)
        self._no_expert = torch.full((1, 1), -1, dtype=torch.int32, device=device)
        self._recv_count = torch.empty(1, dtype=torch.int64, device=device)
        self.experts = GroupedExperts(num_local_experts, hidden, spec.intermediate_size, max_slots=recv_rows,
                                      max_pairs=recv_rows, device=device)
        self.use_grouped_mm = self.experts.use_grouped_mm

    # The three touch points with NVSHMEM, methods so that the CPU tests can stand in for them with gloo.
    def _symmetric_memory(self, device: torch.device):
        return _symmetric_memory(device)

    def _all_to_all_2d(self, send, recv, in_splits, out_splits_offsets) -> None:
        """Dispatch: send's rows, grouped by (destination rank, bucket), to recv grouped by (bucket, source rank)."""
        torch.ops.symm_mem.all_to_all_vdev_2d(send, recv, in_splits, out_splits_offsets, self.group_name,
                                              major_align=1)

    def _all_to_all_2d_offset(self, send, recv, in_splits_offsets, out_splits_offsets) -> None:
        """Combine: the reverse shuffle, (bucket, source rank) chunks at the given offsets back to their ranks."""
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(send, recv, in_splits_offsets, out_splits_offsets,
                                                     self.group_name)

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """w13 [E_local, 2I, H], w2 [E_local, H, I] bf16 on this backend's device (checked by the layer)."""
        self.w13, self.w2 = w13, w2
        self.experts.load(w13, w2)

    def synchronize(self) -> None:
        """Wait for this rank's last call (the NVSHMEM ops report errors as device asserts)."""
        torch.cuda.synchronize(self.device)

    def _row_fields(self, rows: torch.Tensor):
        """(x [N, H] bf16, local expert id [N, 1] int32) views of packed rows [N, row_bytes] uint8."""
        x_end = _ROW_ALIGN_BYTES + 2 * self.spec.hidden_size
        return rows[:, _ROW_ALIGN_BYTES:x_end].view(torch.bfloat16), rows[:, :4].view(torch.int32)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                timings: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k] int32 in [-1, E), topk_weights [T, k] fp32 -> [T, H] bf16. No host sync.

        timings: per-stage ms as in the nccl backend ("dispatch", "permute", "gemms", "unpermute", "combine",
        "total"); the call then synchronizes.
        """
        timer = StageTimer(self.device, timings is not None)
        if not self.use_exchange:
            return self.experts.forward_local(x, topk_ids, topk_weights, timer, timings)
        num_tokens, top_k = topk_ids.shape
        num_slots = num_tokens * top_k
        # 1. source: pairs sorted by global expert (-1 -> E, last), splits per (rank, bucket), packed rows.
        keys = torch.where(topk_ids >= 0, topk_ids, self.spec.num_experts).view(-1)
        sorted_keys, order = torch.sort(keys, stable=True, out=(self._send_keys[:num_slots],
                                                                self._send_order[:num_slots]))
        bounds = torch.searchsorted(sorted_keys, self._bucket_bounds, out=self._bound_positions)
        torch.sub(bounds[1:], bounds[:-1], out=self._in_splits)
        num_sent = bounds[-1:]  # [1] int64 on the device: pairs with an expert
        position = self._send_position[:num_slots].scatter_(0, order, self._slot_index[:num_slots])
        send_x, send_ids = self._row_fields(self._send)
        gather_rows(x, order, send_x[:num_slots], num_sent, index_divisor=top_k)
        torch.remainder(sorted_keys.view(-1, 1), self.num_local_experts, out=send_ids[:num_slots])
        # 2. dispatch: received rows bucket-major, then source rank; splits / offsets in [2, EP*B] on the device.
        self._all_to_all_2d(self._send, self._recv, self._in_splits, self._dispatch_splits_offsets)
        timer.mark("dispatch")
        # 3. experts, in place: rows past the received count get id -1 and are neither computed nor written.
        splits, offsets = self._dispatch_splits_offsets
        torch.add(offsets[-1:], splits[-1:], out=self._recv_count)
        recv_x, recv_ids = self._row_fields(self._recv)
        ids = torch.where(self._recv_row_index < self._recv_count, recv_ids, self._no_expert, out=self._recv_ids)
        self.experts.run(recv_x, ids, None, recv_x, row_limit=self._recv_count, timer=timer)
        # 4. combine: every row back to the slot it was sent from (the send buffer, in send order).
        self._all_to_all_2d_offset(self._recv, self._send, self._dispatch_splits_offsets,
                                   self._combine_splits_offsets)
        # 5. each token's weighted sum over its k pair rows.
        out = torch.empty(num_tokens, self.spec.hidden_size, dtype=torch.bfloat16, device=self.device)
        gather_weighted_sum(send_x, position.view(num_tokens, top_k), topk_weights, out, num_sent)
        timer.mark("combine")
        timer.finish(timings)
        return out
