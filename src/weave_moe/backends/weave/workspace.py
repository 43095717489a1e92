"""Symmetric-memory workspace of the weave backend: the one place that knows how peers' memory is reached.

One symmetric buffer per rank (PyTorch symmetric memory, CUDA IPC; no NVLink multicast), carved into regions:

    flags  [2 parities][EP * MAX_CHUNKS arrival counters | EP combine counters]  int32
    recv   [EP * T_max, H] bf16   rows dispatched to this rank (source s at rows [s*T_max, (s+1)*T_max))
    comb   [2 parities][EP * T_max, H] bf16   combine rows written back to this rank (destination d at [d*T_max...))

Peers are addressed as base address (from the rendezvous) + byte offset, so the kernel needs one int64 table.
Calls alternate parity: call n uses parity n % 2 and zeroes the other parity's flags for call n + 1. That is safe
without a barrier: a peer can only start call n + 1 after it has received this rank's combine rows of call n, which
this rank writes after the zeroing (stream order). Combine rows are double-buffered for the same reason; the receive
buffer needs no second copy because a peer's next dispatch follows this rank's last read of it: the peer waits for
this rank's combine rows of call n, which this rank writes after its GEMMs have read the received rows.
With no process group (EP = 1) the buffer is an ordinary allocation.
"""

from __future__ import annotations

import torch

from weave_moe.models import BYTES_PER_ELEMENT
from weave_moe.plan.workload import MAX_CHUNKS

__all__ = ["SymmetricWorkspace"]

_ALIGN = 256


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class SymmetricWorkspace:
    """Receive, combine and flag buffers of one layer on one rank, allocated once for `max_tokens`."""

    def __init__(self, group, rank: int, world_size: int, max_tokens: int, hidden_size: int, device: torch.device):
        self.rank, self.world_size, self.max_tokens, self.hidden_size = rank, world_size, max_tokens, hidden_size
        self.flag_words = world_size * MAX_CHUNKS + world_size
        flag_bytes = _align(self.flag_words * 4)
        rows_bytes = world_size * max_tokens * hidden_size * BYTES_PER_ELEMENT
        self.flags_offsets = (0, flag_bytes)
        self.recv_offset = 2 * flag_bytes
        self.comb_offsets = (_align(self.recv_offset + rows_bytes), _align(self.recv_offset + rows_bytes) +
                             _align(rows_bytes))
        total = self.comb_offsets[1] + _align(rows_bytes)
        if group is None or world_size == 1:
            self.buffer = torch.zeros(total, dtype=torch.uint8, device=device)
            bases = [self.buffer.data_ptr()]
            self.handle = None
        else:
            import torch.distributed._symmetric_memory as symm_mem

            self.buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
            self.buffer[: 2 * flag_bytes].zero_()
            torch.cuda.synchronize(device)
            self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
            bases = [int(p) for p in self.handle.buffer_ptrs]
            self.handle.barrier()
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=device)
        self.total_bytes = total
        # Views are made once: each slicing op costs host time on every call otherwise.
        rows = world_size * max_tokens
        self._flags = tuple(self._view(self.flags_offsets[p], self.flag_words, torch.int32) for p in (0, 1))
        self._recv = self._view(self.recv_offset, rows * hidden_size, torch.bfloat16).view(rows, hidden_size)
        self._comb = tuple(self._view(self.comb_offsets[p], rows * hidden_size, torch.bfloat16).view(rows, hidden_size)
                           for p in (0, 1))

    def _view(self, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.tensor([], dtype=dtype).element_size()
        return self.buffer[offset: offset + count * size].view(dtype)

    def flags(self, parity: int) -> torch.Tensor:
        """[EP * MAX_CHUNKS + EP] int32 flags of this rank for `parity`."""
        return self._flags[parity]

    def recv(self) -> torch.Tensor:
        """[EP * T_max, H] bf16 receive rows of this rank."""
        return self._recv

    def comb(self, parity: int) -> torch.Tensor:
        """[EP * T_max, H] bf16 combine rows written to this rank for `parity`."""
        return self._comb[parity]

    def barrier(self) -> None:
        if self.handle is not None:
            self.handle.barrier()
