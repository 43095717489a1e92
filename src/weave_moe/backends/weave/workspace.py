"""The weave backend's workspace: ONE per (process group, device), shared by every layer, like DeepEP's `Buffer`.

Symmetric part (PyTorch symmetric memory, CUDA IPC; no NVLink multicast), one buffer per rank, carved into regions:

    flags    [2 parities][EP * MAX_CHUNKS arrival counters | EP combine counters]  int32
    rflags   [EP] int32   routing flags: rflags[s] = the sequence number of source s's last complete routing message
                          (monotonic, never zeroed; kernels/routing_exchange.py)
    routing  [2 parities][EP sources][M] int32   routing messages written to this rank (M = slot words, the largest
                          RoutingMessage.words attached; the parity is chosen on the device by the exchange)
    pair rows [R_pairs] int32   where a paired call at EP > 1 put each pair sent here: entry (s * T_max + t) * k + j
                          = the receive row of source s's pair (token t, slot j) (`attach(recv_rows=)`: R_pairs =
                          recv_rows = EP * T_max * k; 0 otherwise), written by the source's pair dispatch with the
                          row, read by this rank's combine (kernels/pair_combine.py)
    recv     [R_recv, H] bf16   rows dispatched to this rank: R_recv = EP * T_max (source s at rows [s*T_max,
                          (s+1)*T_max)), or more where a layer's paired calls at EP > 1 need a row per (token,
                          expert) pair (`attach(recv_rows=)`: EP * T_max * k, every pair of every source in expert
                          order, kernels/early_dispatch.py `pair_dispatch_kernel`)
    comb     [2 parities][EP * T_max, H] bf16   combine rows written back to this rank (destination d at [d*T_max...))

Local part (ordinary memory, shared the same way; only this rank's kernels touch it, in stream order): h [max_pairs,
I] and y [max_pairs, H] bf16, the GEMM scratch, and `exchange_ctrl` [EXCHANGE_CTRL_FIXED + EP] int32, the routing
exchange's control block (sequence counter, launch completion counter, per-destination send counters). The flags and
rflags start at zero and `exchange_ctrl` is zeroed whenever the symmetric buffer is (re-)allocated, on every rank at
the same layer, so the exchange's sequence numbers restart together with the flags they are compared with.

Peers are addressed as base address (from the rendezvous) + byte offset, so the kernel needs one int64 table. With no
process group (EP = 1) the buffer is an ordinary allocation. With `WEAVE_MOE_TRANSPORT=ipc` (a test transport: every
rank on ONE GPU, e.g. `validate --shared-gpu`) the buffer is an ordinary allocation too, opened by the peers through
CUDA IPC handles passed in the process group's store: PyTorch's symmetric memory refuses ranks that share a device,
and this is how the cross-rank protocol (flags, waits, peer stores) runs with one GPU, the ranks' kernels
time-sharing it.

Sharing. Every layer's call runs on one stream and the layers of a model run one after another, so all of them can
use the same buffers: `SymmetricWorkspace.shared(group, rank, EP, device)` returns the one workspace of that group and
device, and `attach(T_max, H, I, max_pairs)` hands a layer its `WorkspaceView`, views of the first EP * T_max * H
elements of each region shaped for that layer. The regions are sized by the largest layer attached so far; a layer
that needs more grows the workspace at construction (a collective allocation and rendezvous: every rank constructs
its layers in the same order and shapes, so every rank grows at the same layer) and every view is re-pointed to the
new buffers (`generation` counts the re-pointings; a layer keys its captured CUDA graphs by it). The regions' byte
offsets depend only on the capacity, so they are the same on every rank.

Flag protocol across layers. The parity belongs to the workspace, not to a layer: call n of the group (whichever
layer makes it) uses parity n % 2 and, before its kernel, zeroes the OTHER parity's flags for call n + 1; the call
counter advances only when a kernel was launched (`finish_call`), so a call that raises before its launch (bad expert
ids, on every rank at once) leaves the parity as it was, and the other parity, zeroed again, stays zero. Why the
zeroing needs no barrier: call n + 1 of every rank starts with the routing all-gather of call n + 1, which on each rank
is stream-ordered after that rank's call-n zeroing and call-n kernel; so no peer writes call n + 1's flags, receive
rows or combine rows before this rank has zeroed them and finished reading call n's (a routing exchange that
replaces the all-gather must keep this ordering; kernels/routing_exchange.py does: its launch for call n + 1 ends
only once every peer's call n + 1 message arrived, which each peer sends after its own call-n work in stream
order). The exchange's routing parity is its own (a device sequence counter in `exchange_ctrl`, advanced by every
exchange launch, also of a call that raises after the exchange), not this call parity. The flags of parity n % 2 are
complete when call n's kernel ends (it waits for every count it was promised) and are zeroed by call n + 1 for call
n + 2. So a layer's counters never leak into another layer's call, as long as every rank calls the layers in the
same order (one sequence per group) on one stream. A kernel that timed out leaves its parity's flags dirty (the next
call zeroes them) and a stalled peer may still write late, and the ranks' call counters part when some ranks raise
and others launch: after a WeaveTimeoutError, retire the group's workspace on every rank (`retire_shared(group)`)
and rebuild every layer of the group. The workspace outlives its layers (it is freed by `retire` once no layer holds
a view), so that allocating stays a function of the construction sequence alone.

Memory per rank (bytes), with R = EP * T_max * H * 2 of the largest layer (T_max = max_tokens_per_rank),
R_recv = the largest of R and a paired layer's EP * T_max * k * H * 2 (`attach(recv_rows=)`), M = the largest routing
message (RoutingMessage.words = 2 * T_max * k + 1 + HEADER_WORDS) and P = EP * T_max * min(k, E_local) (max_pairs):

    symmetric = 2 * align256(4 * (EP * MAX_CHUNKS + EP)) + align256(4 * EP) + align256(2 * EP * M * 4)
                + align256(4 * R_pairs) + align256(R_recv) + 2 * align256(R)
    local     = max(P * I) * 2 + max(P * H) * 2       (each over the layers attached)

plus the exchange's control block, 4 * (EXCHANGE_CTRL_FIXED + EP) bytes (not counted in `WorkspaceBytes`).
DeepSeek-V3 (H 7168, I 2048, k 8, E_local 128) at T_max 8192, EP 2: R = 224 MiB, M = 131077 (routing: 2 MiB + 256 B),
symmetric = 674 MiB + 1024 B, P = 131072, local = 512 MiB (h) + 1792 MiB (y): 2978 MiB per rank for the whole model,
where one workspace per layer cost 58 x 2978 MiB (169 GiB, more than an H200 holds) for its 58 MoE layers.
Per layer, outside the workspace: its experts, small device buffers (control block, status), the device-resident
call's task tables (kernels/tables.py `TableBuffers`, O(P) int32: one set, two with decode calls, shared by every row
count the layer captures a CUDA graph for; 3.2 MiB per set for Qwen3-30B-A3B, 5.4 MiB for DeepSeek-V3 at EP 2,
T_max 8192), the grouped GEMMs' tile tables (O(P / BM) int32 per tile kinds) and Triton scratch, and 64 KiB of
pinned host memory (exchange.CallSlots: 1024 slots of 64 bytes).
"""

from __future__ import annotations

import os
import pickle
import weakref
from dataclasses import dataclass

import torch

from weave_moe.backends.weave.kernels.peers import ROW_ALIGNMENT
from weave_moe.models import BYTES_PER_ELEMENT
from weave_moe.plan.workload import MAX_CHUNKS

__all__ = ["SymmetricWorkspace", "WorkspaceView", "WorkspaceBytes", "EXCHANGE_CTRL_FIXED"]

#: byte alignment of every region's offset in the buffer
_ALIGN = 256

#: int32 words of `exchange_ctrl` before its per-destination send counters (kernels/routing_exchange.py: CTRL_*)
EXCHANGE_CTRL_FIXED = 2

#: how ranks reach each other's buffers at EP > 1: "symm" (PyTorch symmetric memory, production) or "ipc" (CUDA IPC
#: handles through the store, every rank on one GPU: tests of the protocol without a second GPU; module docstring)
TRANSPORTS = ("symm", "ipc")


def transport_from_env() -> str:
    transport = os.environ.get("WEAVE_MOE_TRANSPORT", "symm")
    if transport not in TRANSPORTS:
        raise ValueError(f"WEAVE_MOE_TRANSPORT must be one of {TRANSPORTS}, got {transport!r}")
    return transport


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class WorkspaceBytes:
    """Bytes of each part of a workspace (module docstring's formula).

    Attributes:
        flags: both parities' flags, aligned.
        rows: one parity of the comb region: EP * T_max * H * 2, aligned.
        recv: the recv region: the larger of `rows` and recv_rows * H * 2, aligned.
        pair_rows: the pair rows region: recv_rows * 4 (0 without recv_rows), aligned.
        h, y: local GEMM scratch (max_pairs * I * 2 and max_pairs * H * 2).
        routing_flags: the routing flags, [EP] int32, aligned.
        routing: the routing slots, [2][EP][M] int32 (M = routing words), aligned.
    """

    flags: int
    rows: int
    h: int
    y: int
    routing_flags: int = 0
    routing: int = 0
    recv: int = 0
    pair_rows: int = 0

    @classmethod
    def of(cls, world_size: int, max_tokens: int, hidden_size: int, intermediate_size: int = 0,
           max_pairs: int = 0, routing_words: int = 0, recv_rows: int = 0) -> "WorkspaceBytes":
        flag_words = world_size * MAX_CHUNKS + world_size
        rows = world_size * max_tokens
        return cls(flags=2 * _align(flag_words * 4),
                   rows=_align(rows * hidden_size * BYTES_PER_ELEMENT),
                   recv=_align(max(rows, recv_rows) * hidden_size * BYTES_PER_ELEMENT),
                   pair_rows=_align(recv_rows * 4),
                   h=max_pairs * intermediate_size * BYTES_PER_ELEMENT,
                   y=max_pairs * hidden_size * BYTES_PER_ELEMENT,
                   routing_flags=_align(world_size * 4),
                   routing=_align(2 * world_size * routing_words * 4))

    def routing_slot_words(self, world_size: int) -> int:
        """M: int32 words of one routing slot (the stride between sources), >= every attached message's words."""
        return self.routing // (2 * world_size * 4)

    @property
    def symmetric(self) -> int:
        return self.flags + self.routing_flags + self.routing + self.pair_rows + self.recv + 2 * self.rows

    @property
    def local(self) -> int:
        """The GEMM scratch (the exchange's control block, 4 * (EXCHANGE_CTRL_FIXED + EP) bytes, not counted)."""
        return self.h + self.y

    @property
    def total(self) -> int:
        return self.symmetric + self.local


# (group name or None, device, rank, EP) -> the workspace. Strong references: whether a construction allocates (a
# collective) must depend only on the sequence of constructions, the same on every rank, never on when the garbage
# collector of each rank happens to free a dropped layer. A workspace lives until `retire` (on every rank).
_SHARED: dict[tuple, "SymmetricWorkspace"] = {}
_IPC_ROUNDS: dict[str, int] = {}   # group name -> rendezvous rounds of the ipc transport in this process


def retire_shared(group) -> int:
    """Retire every shared workspace of `group` in this process (`SymmetricWorkspace.retire`): what every rank does
    after a WeaveTimeoutError of any of the group's layers, at the same point, before it builds new layers (their
    construction then allocates a fresh workspace, collectively). Returns how many were retired."""
    retired = [workspace for workspace in _SHARED.values() if workspace.group is group]
    for workspace in retired:
        workspace.retire()
    return len(retired)


class SymmetricWorkspace:
    """Receive, combine, flag and scratch buffers of one process group on one device, shared by its layers."""

    @classmethod
    def shared(cls, group, rank: int, world_size: int, device: torch.device) -> "SymmetricWorkspace":
        """The workspace of (group, device), created empty on first use (module docstring)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (None if group is None or world_size == 1 else group.group_name, str(device), rank, world_size)
        workspace = _SHARED.get(key)
        if workspace is None:
            workspace = cls(group, rank, world_size, device)
            _SHARED[key] = workspace
        return workspace

    def __init__(self, group, rank: int, world_size: int, device: torch.device):
        """An empty workspace of its own (not registered: `shared` is how layers get one)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, {world_size})")
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, torch.device(device)
        self.flag_words = world_size * MAX_CHUNKS + world_size
        self.capacity = WorkspaceBytes.of(world_size, 0, 0)
        self.routing_slot_words = 0
        self.buffer: torch.Tensor | None = None
        # the routing exchange's control block (local; zeroed with every symmetric allocation)
        self.exchange_ctrl = torch.zeros(EXCHANGE_CTRL_FIXED + world_size, dtype=torch.int32, device=self.device)
        self.handle = None
        self.transport = transport_from_env()
        self.peer_buffers: list[torch.Tensor] = []   # transport "ipc": the peers' buffers, opened here
        self.h_buffer = self.y_buffer = None
        self.generation = 0
        self.calls = 0
        self.call_mode: str | None = None   # "host" or "resident" (claim_call_mode)
        self._views: "weakref.WeakSet[WorkspaceView]" = weakref.WeakSet()
        self._key = None

    # ---- layers -----------------------------------------------------------------------------------------------------
    def attach(self, max_tokens: int, hidden_size: int, intermediate_size: int = 0,
               max_pairs: int = 0, *, routing_words: int = 0, recv_rows: int = 0) -> "WorkspaceView":
        """A layer's view (grows the workspace first when this layer needs more; collective then, see module doc).

        Args:
            max_tokens: T_max of the layer (max_tokens_per_rank).
            hidden_size: H.
            intermediate_size: I (0: the layer needs no h scratch).
            max_pairs: rows of h and y (0: no scratch).
            routing_words: the layer's RoutingMessage.words (0: the layer does not use the routing exchange).
            recv_rows: rows of the receive region the layer needs beyond EP * T_max (0: none; a paired layer at
                EP > 1: one per (token, expert) pair, module docstring).
        """
        for name, value in (("max_tokens", max_tokens), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size), ("max_pairs", max_pairs),
                            ("routing_words", routing_words), ("recv_rows", recv_rows)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.reserve(WorkspaceBytes.of(self.world_size, max_tokens, hidden_size, intermediate_size, max_pairs,
                                       routing_words, recv_rows))
        view = WorkspaceView(self, max_tokens, hidden_size, intermediate_size, max_pairs, routing_words, recv_rows)
        self._views.add(view)
        return view

    def reserve(self, need: WorkspaceBytes) -> None:
        """Grow the symmetric part (collectively) and the local part (locally) to at least `need`."""
        grow_symmetric = (need.rows > self.capacity.rows or need.routing > self.capacity.routing
                          or need.recv > self.capacity.recv or need.pair_rows > self.capacity.pair_rows
                          or self.buffer is None)
        grow_h, grow_y = need.h > self.capacity.h, need.y > self.capacity.y
        if not (grow_symmetric or grow_h or grow_y):
            return
        if self.buffer is not None:
            # every rank is here at the same layer; no kernel of this group may still use the old buffers
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.barrier()
        first = self.buffer is None
        capacity = WorkspaceBytes(flags=need.flags if first else self.capacity.flags,
                                  rows=max(need.rows, self.capacity.rows), h=max(need.h, self.capacity.h),
                                  y=max(need.y, self.capacity.y),
                                  routing_flags=need.routing_flags if first else self.capacity.routing_flags,
                                  routing=max(need.routing, self.capacity.routing),
                                  recv=max(need.recv, self.capacity.recv),
                                  pair_rows=max(need.pair_rows, self.capacity.pair_rows))
        if grow_symmetric:
            self._allocate_symmetric(capacity)
        if grow_h:
            self.h_buffer = torch.empty(capacity.h // BYTES_PER_ELEMENT, dtype=torch.bfloat16, device=self.device)
        if grow_y:
            self.y_buffer = torch.empty(capacity.y // BYTES_PER_ELEMENT, dtype=torch.bfloat16, device=self.device)
        self.capacity = capacity
        self.generation += 1
        for view in list(self._views):
            view._point()

    def _allocate_symmetric(self, capacity: WorkspaceBytes) -> None:
        # offsets are a function of the capacity (and EP) alone: the same on every rank
        flag_bytes = capacity.flags // 2
        self.flags_offsets = (0, flag_bytes)
        self.routing_flags_offset = capacity.flags
        self.routing_offset = self.routing_flags_offset + capacity.routing_flags
        self.routing_slot_words = capacity.routing_slot_words(self.world_size)
        self.pair_rows_offset = self.routing_offset + capacity.routing
        self.recv_offset = self.pair_rows_offset + capacity.pair_rows
        self.comb_offsets = (self.recv_offset + capacity.recv, self.recv_offset + capacity.recv + capacity.rows)
        total = capacity.symmetric
        # the exchange's sequence numbers restart with the routing flags they are compared with (module docstring)
        self.exchange_ctrl.zero_()
        if self.group is None or self.world_size == 1:
            self.buffer = torch.zeros(total, dtype=torch.uint8, device=self.device)
            bases = [self.buffer.data_ptr()]
            self.handle = None
        elif self.transport == "ipc":
            self.buffer = torch.zeros(total, dtype=torch.uint8, device=self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            bases = self._ipc_rendezvous()
        else:
            import torch.distributed._symmetric_memory as symm_mem

            self.buffer = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
            self.buffer[:self.routing_offset].zero_()  # flags and routing flags (adjacent)
            torch.cuda.synchronize(self.device)
            self.handle = symm_mem.rendezvous(self.buffer, self.group.group_name)
            bases = [int(p) for p in self.handle.buffer_ptrs]
            self.handle.barrier()
        # the megakernel addresses every region's start as ROW_ALIGNMENT-aligned (its offsets are multiples of _ALIGN)
        misaligned = [rank for rank, base in enumerate(bases) if base % ROW_ALIGNMENT.value]
        if misaligned:
            raise RuntimeError(f"weave workspace: the symmetric buffers of ranks {misaligned} are not "
                               f"{ROW_ALIGNMENT.value}-byte "
                               f"aligned (bases {[hex(bases[r]) for r in misaligned]})")
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=self.device)

    def _ipc_rendezvous(self) -> list[int]:
        """Transport "ipc": publish this rank's buffer as a CUDA IPC handle in the store, open every peer's; returns
        the base addresses, rank order. Collective (every rank allocates at the same layer). CPU buffers go the same
        way through shared memory (the tests; torch's "file_system" sharing strategy, whose handles pickle)."""
        import datetime

        import torch.distributed as dist
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers torch's tensor reducers (CUDA IPC, shm) with it

        # numbered per group and process, not per workspace: a workspace built after `retire_shared` must not find
        # the retired one's handles under its keys (seen on one GPU: a rank opened its peer's freed buffer)
        name = self.group.group_name
        _IPC_ROUNDS[name] = _IPC_ROUNDS.get(name, 0) + 1
        store = dist.distributed_c10d._get_default_store()
        prefix = f"weave_moe/ipc/{name}/{_IPC_ROUNDS[name]}"
        store.set(f"{prefix}/{self.rank}", bytes(ForkingPickler.dumps(self.buffer)))
        keys = [f"{prefix}/{r}" for r in range(self.world_size)]
        store.wait(keys, datetime.timedelta(seconds=120))
        self.peer_buffers = []
        for peer, key in enumerate(keys):
            if peer == self.rank:
                self.peer_buffers.append(self.buffer)
                continue
            self.peer_buffers.append(pickle.loads(store.get(key)))
        dist.barrier(group=self.group)
        return [buffer.data_ptr() for buffer in self.peer_buffers]

    def _view(self, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.tensor([], dtype=dtype).element_size()
        return self.buffer[offset: offset + count * size].view(dtype)

    # ---- the call sequence (module docstring: flag protocol across layers) ------------------------------------------
    @property
    def parity(self) -> int:
        """Parity of the group's next call: its flags are zero; the call zeroes the other parity's."""
        return self.calls % 2

    def claim_call_mode(self, resident: bool) -> None:
        """Every layer of one workspace makes its calls the same way: host-driven calls alternate the parity (above),
        device-resident ones (KernelConfig.resident) always use parity 0 and zero its flags before their routing
        exchange. Mixing them would hand a call flags the other kind left dirty, so the second kind raises."""
        mode = "resident" if resident else "host"
        if self.call_mode is None:
            self.call_mode = mode
        elif self.call_mode != mode:
            raise ValueError(f"this process group's workspace serves {self.call_mode} weave layers; a {mode} layer "
                             "cannot share it: build every weave layer of a group with the same KernelConfig.resident")

    def finish_call(self) -> None:
        """Count a call whose kernel was enqueued (any layer): the next call uses the other parity."""
        self.calls += 1

    def retire(self) -> None:
        """Take this workspace out of the registry, so that layers built later get a new one (and this one is freed
        with the last view). Call it on every rank at the same point of the construction sequence: the next
        construction allocates, collectively."""
        for key, value in list(_SHARED.items()):
            if value is self:
                del _SHARED[key]

    def barrier(self) -> None:
        if self.handle is not None:
            self.handle.barrier()
        elif self.peer_buffers:
            import torch.distributed as dist

            dist.barrier(group=self.group)


class WorkspaceView:
    """One layer's views of the shared workspace, re-pointed when it grows (`SymmetricWorkspace.attach`).

    Attributes:
        workspace: the shared SymmetricWorkspace.
        peer_bases: [EP] int64 base address of every rank's symmetric buffer.
        recv_offset, comb_offsets, flags_offsets, pair_rows_offset: byte offsets of the regions in every rank's
            buffer.
        recv_rows: rows of this layer's receive region (`recv`): EP * T_max, or the layer's `attach(recv_rows=)`.
        routing_offset, routing_flags_offset: byte offsets of the routing slots and the routing flags.
        routing_slot_words: M, int32 words of one routing slot (>= routing_words).
        routing_words: this layer's RoutingMessage.words (0: none attached).
        exchange_ctrl: [EXCHANGE_CTRL_FIXED + EP] int32, the routing exchange's local control block.
    """

    def __init__(self, workspace: SymmetricWorkspace, max_tokens: int, hidden_size: int, intermediate_size: int,
                 max_pairs: int, routing_words: int = 0, recv_rows: int = 0):
        self.workspace = workspace
        self.max_tokens, self.hidden_size = max_tokens, hidden_size
        self.recv_rows = max(workspace.world_size * max_tokens, recv_rows)
        self.pair_slots = recv_rows   # entries of `pair_rows` (0: the layer has none)
        self.intermediate_size, self.max_pairs = intermediate_size, max_pairs
        self.routing_words = routing_words
        self.exchange_ctrl = workspace.exchange_ctrl
        self._point()

    def _point(self) -> None:
        # Views are made once per generation: each slicing op costs host time on every call otherwise.
        ws = self.workspace
        ep, H, I, pairs = ws.world_size, self.hidden_size, self.intermediate_size, self.max_pairs
        rows = ep * self.max_tokens
        self.generation = ws.generation
        self.peer_bases = ws.peer_bases
        self.recv_offset, self.comb_offsets, self.flags_offsets = ws.recv_offset, ws.comb_offsets, ws.flags_offsets
        self.pair_rows_offset = ws.pair_rows_offset
        self._pair_rows = ws._view(ws.pair_rows_offset, self.pair_slots, torch.int32)
        self.routing_offset, self.routing_flags_offset = ws.routing_offset, ws.routing_flags_offset
        self.routing_slot_words = ws.routing_slot_words
        self._routing_flags = ws._view(ws.routing_flags_offset, ep, torch.int32)
        self._routing = ws._view(ws.routing_offset, 2 * ep * ws.routing_slot_words,
                                 torch.int32).view(2, ep, ws.routing_slot_words)
        self._flags = tuple(ws._view(ws.flags_offsets[p], ws.flag_words, torch.int32) for p in (0, 1))
        self._comb_flags = tuple(flags[ep * MAX_CHUNKS:] for flags in self._flags)
        self._recv = ws._view(ws.recv_offset, self.recv_rows * H, torch.bfloat16).view(self.recv_rows, H)
        self._comb = tuple(ws._view(ws.comb_offsets[p], rows * H, torch.bfloat16).view(rows, H) for p in (0, 1))
        self._h = ws.h_buffer[:pairs * I].view(pairs, I) if pairs and I else None
        self._y = ws.y_buffer[:pairs * H].view(pairs, H) if pairs else None

    @property
    def rank(self) -> int:
        return self.workspace.rank

    @property
    def world_size(self) -> int:
        return self.workspace.world_size

    @property
    def parity(self) -> int:
        return self.workspace.parity

    def finish_call(self) -> None:
        self.workspace.finish_call()

    def flags(self, parity: int) -> torch.Tensor:
        """[EP * MAX_CHUNKS + EP] int32 flags of this rank for `parity` (arrival counters, then combine counters)."""
        return self._flags[parity]

    def comb_flags(self, parity: int) -> torch.Tensor:
        """[EP] int32 combine counters of this rank for `parity` (the tail of `flags(parity)`)."""
        return self._comb_flags[parity]

    def routing_flags(self) -> torch.Tensor:
        """[EP] int32 routing flags of this rank: entry s is the sequence number of source s's last complete message."""
        return self._routing_flags

    def routing(self, parity: int) -> torch.Tensor:
        """[EP, M] int32 routing slots of this rank for `parity` (row s: source s's message, first words used)."""
        return self._routing[parity]

    def recv(self) -> torch.Tensor:
        """[recv_rows, H] bf16 receive rows of this rank."""
        return self._recv

    def pair_rows(self) -> torch.Tensor:
        """[pair_slots] int32 (empty without `attach(recv_rows=)`): where the pairs sent here at EP > 1 lie
        (module docstring)."""
        return self._pair_rows

    def comb(self, parity: int) -> torch.Tensor:
        """[EP * T_max, H] bf16 combine rows written to this rank for `parity`."""
        return self._comb[parity]

    def h(self) -> torch.Tensor:
        """[max_pairs, I] bf16 GEMM0 output (SiLU-mul applied)."""
        return self._h

    def y(self) -> torch.Tensor:
        """[max_pairs, H] bf16 GEMM1 output."""
        return self._y

    def retire(self) -> None:
        self.workspace.retire()

    def barrier(self) -> None:
        self.workspace.barrier()
