"""The routing exchange of the weave backend: the message every rank sends, and the counts read back from it.

This module is the one owner of both formats: what `pack` writes, `unpack` reads, and the counts vector's layout
(`CountsFormat`: its size, the offset of every field, `parse`). The backend builds the counts vector with one Triton
launch (kernels/counts.py), which takes every offset from these two classes; `CountsFormat.build` and `verdict` are
the same computation in torch, the definition that kernel is tested against bit for bit (tests/test_counts.py).

Routing message (one rank, int32 words, W = T_max * k):

    [ ids: T * k global expert ids, -1 up to W | weights: T * k fp32 bit patterns, 0.0 up to W | T | header ]

Every rank all-gathers every rank's message ([EP, words]), so every rank can compute the same global layout. The
header (HEADER_WORDS words: layer identity, creation index, call number, error code) is the call's coordination
header (weave_moe.backends.coordination): a rank that cannot make a call sends T = 0 and its error code, and every
rank raises after the exchange.

Counts vector (int32, built on the device from the gathered messages; the host-driven call copies it to the host
once per call, the device-resident call only feeds it to the device planner and the verdict):

    [ EP tokens | EP * EP rows sent (s -> d, dedup) | E (token, expert) pairs | EP bad ids | EP headers | status ]

Shape legend: EP ranks, T_max = max_tokens_per_rank, k = top_k, E experts, E_local = E / EP.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weave_moe.backends.coordination import HEADER_CALL_WORD, HEADER_CODE_WORD, HEADER_WORDS
from weave_moe.backends.weave.kernels import sync

__all__ = ["RoutingMessage", "CallSlots", "CountsFormat", "LayoutCounts", "hit_matrix", "count_routing",
           "copy_status"]


@dataclass(frozen=True)
class LayoutCounts:
    """Every rank's workload, as the planner reads it.

    Attributes:
        num_tokens: [EP] tokens on each rank.
        send_rows: [EP][EP] rows (dedup) that rank s sends to rank d, the diagonal included (a local copy).
        expert_pairs: [E] (token, expert) pairs routed to each global expert.
    """

    num_tokens: list[int]
    send_rows: list[list[int]]
    expert_pairs: list[int]


@dataclass(frozen=True)
class RoutingMessage:
    """The routing message of one rank: sizes, packing and unpacking (module docstring)."""

    max_tokens: int
    top_k: int

    @property
    def id_words(self) -> int:
        """W = T_max * k: words of ids (and of weights) in a message."""
        return self.max_tokens * self.top_k

    @property
    def tokens_word(self) -> int:
        """Position of T in a message: after the ids and the weights."""
        return 2 * self.id_words

    @property
    def header_word(self) -> int:
        """Position of the header's first word in a message: after T."""
        return self.tokens_word + 1

    @property
    def words(self) -> int:
        return self.header_word + HEADER_WORDS

    def check_fits(self, topk_ids: torch.Tensor) -> None:
        """Raise ValueError unless topk_ids [T, k] fits the message's W ids."""
        if topk_ids.numel() > self.id_words:
            raise ValueError(f"{topk_ids.shape[0]} tokens x top-k do not fit the exchange buffer of {self.id_words} "
                             "ids")

    def pad(self, device=None) -> torch.Tensor:
        """[2 W] int32: -1 (no expert) for the ids' padding, then 0 (the bits of 0.0) for the weights' padding."""
        return torch.cat([torch.full((self.id_words,), -1, dtype=torch.int32, device=device),
                          torch.zeros(self.id_words, dtype=torch.int32, device=device)])

    def pack(self, out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, pad: torch.Tensor,
             token_counts: torch.Tensor, header: torch.Tensor) -> torch.Tensor:
        """Fill `out` [words] int32 with ONE kernel (a `torch.cat` into `out`).

        Args:
            out: [words] int32, the message buffer.
            topk_ids: [T, k] int32 global expert ids (-1 = none); narrowed by the layer after its range check.
            topk_weights: [T, k] fp32.
            pad: `self.pad(device)`, made once.
            token_counts: [T_max + 1] int32 device vector 0..T_max, so T needs no host-to-device copy.
            header: [HEADER_WORDS] int32, this call's coordination header (on the device).
        """
        self.check_fits(topk_ids)
        words, n = self.id_words, topk_ids.numel()
        num_tokens = topk_ids.shape[0]
        return torch.cat([topk_ids.reshape(-1).to(torch.int32), pad[:words - n],
                          topk_weights.reshape(-1).view(torch.int32), pad[words:2 * words - n],
                          token_counts[num_tokens:num_tokens + 1], header], out=out)

    def pack_call(self, out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, header: torch.Tensor,
                  io: torch.Tensor, x: torch.Tensor, result: torch.Tensor, error_code: int, status: torch.Tensor,
                  control: torch.Tensor, flags: torch.Tensor, num_experts: int) -> None:
        """Everything the device-resident call does before its graph, in ONE Triton launch: `out` gets the message
        (`pack`'s words; `header` with its error-code word replaced by `error_code`), then the device header's call
        number advances; `io` [2] int64 gets the addresses of x and `result` (what the resident kernel reads instead
        of pointer arguments); `status` goes through `sync.carry_rejection`; `control` and `flags` are zeroed.

        Args as `pack`, except: topk_ids [T, k] int32 or int64 (int64 narrowed here without wrapping: ids outside
        [-1, E) become -2 or E, which the counts kernel's verdict still counts as out of range); `header`:
        [HEADER_WORDS] int32 on the device; `io`: [2] int64 on the device; `status`: int32 [2 * STATUS_WORDS]
        (kernels/sync.py: live word, reported rejection); `control`: int32, the megakernel's control block;
        `flags`: int32, this rank's arrival and combine flags of the call's parity (zeroed before this rank's
        message leaves: a peer writes them only after it received that message, workspace.py); `num_experts`: E.
        """
        if status.dtype != torch.int32 or status.numel() < 2 * sync.STATUS_WORDS:
            raise ValueError(f"status must be int32 with >= {2 * sync.STATUS_WORDS} words (live and reported words)")
        for name, tensor in (("control", control), ("flags", flags)):
            if tensor.dtype != torch.int32 or not tensor.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int32 tensor")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        self.check_fits(topk_ids)
        words, n = self.id_words, topk_ids.numel()
        grid = (triton.cdiv(words, _PACK_BLOCK), 1, 1)
        args = (topk_ids, topk_weights, out, header, io, status, control, flags, n, topk_ids.shape[0], x.data_ptr(),
                result.data_ptr(), error_code, words, control.numel(), flags.numel(), num_experts)
        # one compiled kernel per (device, ids dtype): the launch below bypasses the JIT's dispatch on dtypes
        key = (out.device, topk_ids.dtype)
        compiled = _PACK_COMPILED.get(key) if out.is_cuda else None
        if compiled is not None:
            # the compiled kernel directly: Triton's JIT launch spends ~25 us of host time per call binding and
            # specialising arguments (measured on the H200 machine), this ~5. Valid for any arguments: no pointer
            # or integer is specialised (do_not_specialize), the dtypes are the key's.
            compiled[grid](*args, HEADER_WORDS, HEADER_CALL_WORD, _PACK_BLOCK)  # the launcher takes the constexprs
        else:
            compiled = _pack_kernel[grid](*args, HEADER=HEADER_WORDS, CALL_WORD=HEADER_CALL_WORD, BLOCK=_PACK_BLOCK,
                                          num_warps=4, **sync.LAUNCH)
            if out.is_cuda:
                _PACK_COMPILED[key] = compiled

    def unpack(self, messages: torch.Tensor):
        """Views of gathered messages [EP, words] int32: (ids [EP, T_max, k] int32, weights [EP, T_max, k] fp32,
        tokens [EP] int32)."""
        world_size, words = messages.shape[0], self.id_words
        ids = messages[:, :words].view(world_size, self.max_tokens, self.top_k)
        weights = messages[:, words:2 * words].view(torch.float32).view(world_size, self.max_tokens, self.top_k)
        return ids, weights, messages[:, self.tokens_word]

    def headers(self, messages: torch.Tensor) -> torch.Tensor:
        """[EP, HEADER_WORDS] int32 view: every rank's call header in gathered messages [EP, words]."""
        return messages[:, self.header_word:]


_PACK_BLOCK = 4096
_PACK_COMPILED: dict = {}   # (device, ids dtype) -> the compiled _pack_kernel (RoutingMessage.pack_call)
_RETIRED: list = []         # (event, pinned tensors) of dropped CallSlots rings, kept until the event has passed


def _retire(tensors: tuple, last_call: list) -> None:
    """A CallSlots ring was dropped: keep its pinned memory until its last call has run (`last_call[0]`, the event
    recorded after it; None: no call was made)."""
    if last_call[0] is not None:
        _RETIRED.append((last_call[0], tensors))


def _release_retired() -> None:
    """Free the retired rings whose queued work has run."""
    _RETIRED[:] = [(event, tensors) for event, tensors in _RETIRED if not event.query()]


class CallSlots:
    """The device-resident call's per-call arguments through host memory, so that the call's first kernel (the
    message pack) is inside the call's CUDA graph and a call costs the host a few stores and one graph launch instead
    of a kernel launch (~13 us through Triton's launcher on the H200 machine) before it.

    A ring of `num_slots` slots in pinned host memory, which the GPU reads through its device address (unified
    addressing), of SLOT_WORDS int64 words each:

        [x address | out address | topk_ids address | topk_weights address | T | error code | ids int64 (0/1) | T*k]

    Protocol (one writer, the host; one reader, the pack kernel; both count calls from 0):
    1. The host's n-th call writes slot n % num_slots (`write`), then enqueues the call's graph.
    2. The graph's pack kernel reads slot `cursor % num_slots`, cursor being a device counter that only that kernel
       advances, by one per call, once every program of it has read the slot (an arrival count); it then stores the
       new cursor into `consumed`, in host memory. So the kernel of call n reads the slot the host wrote for call n,
       as long as every call that wrote a slot enqueued exactly one pack kernel (a call captured into a caller's CUDA
       graph writes no slot and launches the argument pack instead, `RoutingMessage.pack_call`).
    3. Before writing slot n the host checks that call n - num_slots has read its slot (consumed > n - num_slots); if
       not (more than num_slots calls queued on the GPU), it waits, bounded by `wait` (the caller's deadline).

    The calls of one layer run in order on the GPU (one stream, or streams the caller orders), as the layer's other
    buffers require too: two of its calls running at once on unordered streams could read each other's slots.
    Kernels read the slots by address, which torch's pinned-memory allocator does not track: a ring dropped while its
    calls may still be queued is kept (`_RETIRED`) until the event its owner records after every call
    (`track_calls`) has passed, so no later pinned allocation reuses memory a queued kernel still reads.
    Under the interpreter (CPU tests) the slots are ordinary CPU memory, which the interpreted kernel reads alike.
    """

    SLOT_WORDS = 8

    def __init__(self, message: RoutingMessage, device: torch.device, num_slots: int = 1024) -> None:
        pinned = device.type == "cuda"
        _release_retired()
        self.message, self.num_slots, self.written = message, num_slots, 0
        self.slots = torch.zeros(num_slots, self.SLOT_WORDS, dtype=torch.int64, pin_memory=pinned)
        self.slots_numpy = self.slots.numpy()
        self.consumed = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)
        self.consumed_numpy = self.consumed.numpy()
        self.cursor = torch.zeros(1, dtype=torch.int32, device=device)
        self.done = torch.zeros(1, dtype=torch.int32, device=device)
        self.last_call: list = [None]   # the owner's per-call event (track_calls); a list, shared with the finalizer
        if pinned:
            weakref.finalize(self, _retire, (self.slots, self.consumed), self.last_call)

    def track_calls(self, event: torch.cuda.Event) -> None:
        """`event` is recorded after every call that wrote a slot (on the call's stream): the ring's memory is freed
        only once it has passed (class docstring)."""
        self.last_call[0] = event

    def write(self, x: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              error_code: int, wait) -> None:
        """This call's slot (protocol step 1); `wait(is_done)` polls `is_done` until it is True or raises at the
        caller's deadline (step 3). topk_ids [T, k] int32 / int64 and topk_weights [T, k] fp32, contiguous."""
        n = self.written
        self.message.check_fits(topk_ids)
        if n - int(self.consumed_numpy[0]) >= self.num_slots:
            wait(lambda: n - int(self.consumed_numpy[0]) < self.num_slots)
        self.slots_numpy[n % self.num_slots] = (x.data_ptr(), out.data_ptr(), topk_ids.data_ptr(),
                                                topk_weights.data_ptr(), topk_ids.shape[0], error_code,
                                                topk_ids.dtype == torch.int64, topk_ids.numel())
        self.written = n + 1

    def launch(self, message_out: torch.Tensor, header: torch.Tensor, io: torch.Tensor, status: torch.Tensor,
               control: torch.Tensor, flags: torch.Tensor, num_experts: int) -> None:
        """The pack kernel that reads the next slot (protocol step 2): `RoutingMessage.pack_call`'s work, same
        arguments but the call's own, which come from the slot."""
        words = self.message.id_words
        grid = (triton.cdiv(words, _PACK_BLOCK),)
        _pack_slot_kernel[grid](self.slots, self.cursor, self.done, self.consumed, message_out, header, io, status,
                                control, flags, self.num_slots, words, control.numel(), flags.numel(), num_experts,
                                SLOT=self.SLOT_WORDS, HEADER=HEADER_WORDS, CALL_WORD=HEADER_CALL_WORD,
                                BLOCK=_PACK_BLOCK, num_warps=4, **sync.LAUNCH)


@triton.jit
def _pack_ahead(pid, header_ptr, status_ptr, HEADER: tl.constexpr):
    """Program 0's loads that depend on nothing the kernel loads first (the device header, the live status word),
    issued at its start so that they overlap the loads of the call's arguments instead of following them (a 1-token
    call's pack is a chain of dependent loads: the cursor, the slot in host memory, the ids). Zeros in the other
    programs, which do not use them."""
    header = tl.load(header_ptr + tl.arange(0, HEADER), mask=pid == 0, other=0)
    return header, sync.load_live(status_ptr, pid == 0)


@triton.jit
def _pack_words(pid, offs, ids, weights, header, live, message_ptr, header_ptr, io_ptr, status_ptr, control_ptr,
                flags_ptr, num_tokens, x_address, out_address, error_code, words, control_words, flag_words,
                num_experts, HEADER: tl.constexpr, CALL_WORD: tl.constexpr, BLOCK: tl.constexpr):
    """What both pack kernels do with this program's block of loaded ids (int32 or int64, -1 padded) and weights
    (fp32, 0 padded): words [pid * BLOCK, +BLOCK) of the message and the same share of the zeroed control block and
    flags; program 0 also T, the header (`header`, as `_pack_ahead` loaded it; then the call number + 1), the
    addresses and the carried rejection (of `live`, `_pack_ahead`'s)."""
    ids = tl.minimum(tl.maximum(ids, -2), num_experts).to(tl.int32)  # int64 narrowed without wrapping
    tl.store(message_ptr + offs, ids, mask=offs < words)
    tl.store(message_ptr + words + offs, weights.to(tl.int32, bitcast=True), mask=offs < words)
    zeros = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, control_words, tl.num_programs(0) * BLOCK):
        tl.store(control_ptr + start + tl.arange(0, BLOCK), zeros, mask=start + tl.arange(0, BLOCK) < control_words)
    for start in range(pid * BLOCK, flag_words, tl.num_programs(0) * BLOCK):
        tl.store(flags_ptr + start + tl.arange(0, BLOCK), zeros, mask=start + tl.arange(0, BLOCK) < flag_words)
    if pid == 0:
        tl.store(message_ptr + 2 * words, num_tokens)
        hh = tl.arange(0, HEADER)
        tl.store(message_ptr + 2 * words + 1 + hh, tl.where(hh == HEADER - 1, error_code, header))
        tl.debug_barrier()  # every thread has read the header before it advances
        tl.store(header_ptr + hh, header + 1, mask=hh == CALL_WORD)
        tl.store(io_ptr, x_address.to(tl.int64))
        tl.store(io_ptr + 1, out_address.to(tl.int64))
        sync.carry_rejection(status_ptr, live)


@triton.jit(do_not_specialize=["ids_ptr", "weights_ptr", "message_ptr", "header_ptr", "io_ptr", "status_ptr",
                               "control_ptr", "flags_ptr", "num_ids", "num_tokens", "x_address", "out_address",
                               "error_code", "words", "control_words", "flag_words", "num_experts"])
def _pack_kernel(ids_ptr, weights_ptr, message_ptr, header_ptr, io_ptr, status_ptr, control_ptr, flags_ptr, num_ids,
                 num_tokens, x_address, out_address, error_code, words, control_words, flag_words, num_experts,
                 HEADER: tl.constexpr, CALL_WORD: tl.constexpr, BLOCK: tl.constexpr):
    """RoutingMessage.pack_call: the call's tensors and values as arguments (_pack_words)."""
    sync.pdl_enter()
    pid = tl.program_id(0)
    header, live = _pack_ahead(pid, header_ptr, status_ptr, HEADER)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    given = offs < num_ids
    ids = tl.load(ids_ptr + offs, mask=given, other=-1)
    weights = tl.load(weights_ptr + offs, mask=given, other=0.0)
    _pack_words(pid, offs, ids, weights, header, live, message_ptr, header_ptr, io_ptr, status_ptr, control_ptr,
                flags_ptr, num_tokens, x_address, out_address, error_code, words, control_words, flag_words,
                num_experts, HEADER, CALL_WORD, BLOCK)


def copy_status(status: torch.Tensor, host: torch.Tensor) -> None:
    """host[:] = status[:] (int32 words; `host` in pinned memory, which the GPU writes through its device address)
    by a one-CTA kernel launched with programmatic dependent launch, the resident call's last node: it starts as its
    predecessor finishes (~1 us), where a copy-engine transfer after a kernel began ~6 us after it (H200, in a CUDA
    graph). The stores reach host memory by the time the kernel has completed, i.e. by an event recorded after it.
    Under the interpreter both are CPU tensors."""
    if status.shape != host.shape or status.dtype != torch.int32 or host.dtype != torch.int32:
        raise ValueError(f"copy_status: expected two int32 tensors of one shape, given {status.dtype} "
                         f"{tuple(status.shape)} and {host.dtype} {tuple(host.shape)}")
    words = status.numel()
    _status_copy_kernel[(1,)](status, host, words, BLOCK=triton.next_power_of_2(words), num_warps=1, **sync.LAUNCH)


@triton.jit
def _status_copy_kernel(status_ptr, host_ptr, words, BLOCK: tl.constexpr):
    """copy_status."""
    sync.pdl_enter()
    offs = tl.arange(0, BLOCK)
    tl.store(host_ptr + offs, tl.load(status_ptr + offs, mask=offs < words), mask=offs < words)


@triton.jit
def _word(values, lanes, index):
    """Word `index` of a vector loaded once (`values` over `lanes` = tl.arange), as a scalar."""
    return tl.sum(tl.where(lanes == index, values, 0), axis=0)


@triton.jit(do_not_specialize=["slots_ptr", "cursor_ptr", "done_ptr", "consumed_ptr", "message_ptr", "header_ptr",
                               "io_ptr", "status_ptr", "control_ptr", "flags_ptr", "num_slots", "words",
                               "control_words", "flag_words", "num_experts"])
def _pack_slot_kernel(slots_ptr, cursor_ptr, done_ptr, consumed_ptr, message_ptr, header_ptr, io_ptr, status_ptr,
                      control_ptr, flags_ptr, num_slots, words, control_words, flag_words, num_experts,
                      SLOT: tl.constexpr, HEADER: tl.constexpr, CALL_WORD: tl.constexpr, BLOCK: tl.constexpr):
    """CallSlots.launch: the call's addresses and values from slot `cursor % num_slots` of the host's ring (CallSlots:
    the slot layout), then _pack_words; the last program to finish advances the cursor and tells the host the slot
    is free (`consumed`: every program has read it). A grid of one program (ids of up to one block: decode calls of
    a layer whose T_max * k fits it) does so without the arrival count: its own loads of the slot have returned,
    their words used, before its stores, which saves the count's barrier and acq_rel round trip on the call's chain."""
    sync.pdl_enter()
    pid = tl.program_id(0)
    header, live = _pack_ahead(pid, header_ptr, status_ptr, HEADER)
    cursor = tl.load(cursor_ptr)          # advanced only after every program has read it (below)
    # the slot as ONE vector load (a read of pinned host memory crosses PCIe: one transaction per warp, not one per
    # word), its words then picked out in registers
    lanes = tl.arange(0, SLOT)
    slot = tl.load(slots_ptr + (cursor % num_slots) * SLOT + lanes)
    x_address = _word(slot, lanes, 0)
    out_address = _word(slot, lanes, 1)
    ids_address = _word(slot, lanes, 2)
    weights_address = _word(slot, lanes, 3)
    num_tokens = _word(slot, lanes, 4).to(tl.int32)
    error_code = _word(slot, lanes, 5).to(tl.int32)
    wide_ids = _word(slot, lanes, 6)
    num_ids = _word(slot, lanes, 7).to(tl.int32)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    given = offs < num_ids
    if wide_ids != 0:
        ids = tl.load(ids_address.to(tl.pointer_type(tl.int64)) + offs, mask=given, other=-1)
    else:
        ids = tl.load(ids_address.to(tl.pointer_type(tl.int32)) + offs, mask=given, other=-1).to(tl.int64)
    weights = tl.load(weights_address.to(tl.pointer_type(tl.float32)) + offs, mask=given, other=0.0)
    _pack_words(pid, offs, ids, weights, header, live, message_ptr, header_ptr, io_ptr, status_ptr, control_ptr,
                flags_ptr, num_tokens, x_address, out_address, error_code, words, control_words, flag_words,
                num_experts, HEADER, CALL_WORD, BLOCK)
    ticket = tl.zeros([], dtype=tl.int32)   # one program: it is the last to have read the slot
    if tl.num_programs(0) > 1:
        ticket = sync.arrive(done_ptr, False)
    if ticket == tl.num_programs(0) - 1:   # every program has read the slot
        tl.store(done_ptr, 0)
        tl.store(cursor_ptr, cursor + 1)
        tl.store(consumed_ptr, (cursor + 1).to(tl.int64))


def hit_matrix(all_ids: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """[EP, T_max, EP] bool: token t of rank s has an expert on rank d."""
    world_size, max_tokens, _ = all_ids.shape
    owner = torch.where(all_ids >= 0, all_ids.long() // num_local_experts, -1)
    hit = torch.zeros(world_size, max_tokens, world_size + 1, dtype=torch.bool, device=all_ids.device)
    hit.scatter_(2, owner + 1, True)  # column 0 collects the -1 ids and is dropped
    return hit[:, :, 1:]


def static_bincount(index: torch.Tensor, size: int) -> torch.Tensor:
    """bincount with a static size and no host sync (torch.bincount on CUDA reads the max back)."""
    out = torch.zeros(size, dtype=torch.long, device=index.device)
    return out.scatter_add_(0, index, torch.ones_like(index))


def count_routing(all_ids: torch.Tensor, num_tokens: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[EP tokens | EP*EP send rows | E expert pairs] int32 on the device, from gathered ids [EP, T_max, k]
    (-1 beyond each rank's token count and for "no expert") and tokens [EP]."""
    world_size = all_ids.shape[0]
    hit = hit_matrix(all_ids, num_experts // world_size)
    send_rows = hit.sum(dim=1, dtype=torch.int32).flatten()
    pairs = static_bincount(all_ids.flatten().long() + 1, num_experts + 1)[1:].to(torch.int32)
    return torch.cat([num_tokens.to(torch.int32), send_rows, pairs])


@dataclass(frozen=True)
class CountsFormat:
    """The counts vector (module docstring): its size, where each field starts, its parsing on the host; and `build`
    and `verdict`, its construction in torch (the definition kernels/counts.py is tested against)."""

    world_size: int
    num_experts: int
    status_words: int

    @property
    def tokens_offset(self) -> int:
        """[EP] tokens of each rank: the first field."""
        return 0

    @property
    def send_rows_offset(self) -> int:
        """[EP, EP] rows sent, row s = source, column d = destination."""
        return self.tokens_offset + self.world_size

    @property
    def expert_pairs_offset(self) -> int:
        return self.send_rows_offset + self.world_size * self.world_size

    @property
    def bad_ids_offset(self) -> int:
        return self.expert_pairs_offset + self.num_experts

    @property
    def headers_offset(self) -> int:
        """[EP, HEADER_WORDS] every rank's call header."""
        return self.bad_ids_offset + self.world_size

    @property
    def status_offset(self) -> int:
        return self.headers_offset + self.world_size * HEADER_WORDS

    @property
    def size(self) -> int:
        return self.status_offset + self.status_words

    def build(self, messages: torch.Tensor, message: RoutingMessage, status: torch.Tensor) -> torch.Tensor:
        """Counts of gathered `messages` [EP, words], then bad ids per rank, every rank's header, then `status`.
        Ids outside [-1, E) are counted per source rank and replaced by -1 IN PLACE, so nothing downstream indexes
        out of range; the host raises on every rank together. Not idempotent: a second run on the same messages
        counts no bad ids."""
        ids = messages[:, :message.id_words]
        bad = (ids < -1) | (ids >= self.num_experts)
        bad_ids = bad.sum(dim=1, dtype=torch.int32)
        ids.masked_fill_(bad, -1)
        all_ids, _, tokens = message.unpack(messages)
        return torch.cat([count_routing(all_ids, tokens, self.num_experts), bad_ids,
                          message.headers(messages).flatten(), status])

    def verdict(self, counts: torch.Tensor, rank: int, status: torch.Tensor) -> None:
        """The device-resident call's check of a counts vector (`build`'s output), with no host sync: if any rank
        failed its local checks, met another layer or call, or sent ids outside [-1, E), write the rejection
        [code, rank at fault, detail, this rank's call number] (kernels/sync.py) into `status` unless it already
        holds an error (the first one stays). Every rank reads the same gathered counts, so every rank writes the same
        code, and the kernels that follow do no work (the megakernel checks the word when it starts)."""
        ep = self.world_size
        bad = counts[self.bad_ids_offset:self.bad_ids_offset + ep]
        headers = counts[self.headers_offset:self.status_offset].view(ep, HEADER_WORDS)
        mine = headers[rank]
        failed = headers[:, HEADER_CODE_WORD] != 0
        other_call = (headers[:, :HEADER_CODE_WORD] != mine[:HEADER_CODE_WORD]).any(dim=1)
        codes = torch.where(failed, sync.REJECT_PEER_FAILED,
                            torch.where(other_call, sync.REJECT_CALL_ORDER,
                                        torch.where(bad > 0, sync.REJECT_BAD_IDS, 0))).to(torch.int32)
        # one-element index tensors throughout: indexing with a 0-d tensor reads it on the host (a sync, which also
        # breaks CUDA-graph capture)
        first = (codes != 0).to(torch.int32).argmax(dim=0, keepdim=True)   # [1] the lowest rank at fault (0: none)
        code = codes.gather(0, first)
        at_fault = headers.index_select(0, first)[0]
        code_word = at_fault[HEADER_CODE_WORD:HEADER_CODE_WORD + 1]
        call_word = at_fault[HEADER_CALL_WORD:HEADER_CALL_WORD + 1]
        detail = torch.where(code == sync.REJECT_PEER_FAILED, code_word,
                             torch.where(code == sync.REJECT_CALL_ORDER, call_word, bad.gather(0, first)))
        rejection = torch.cat([code, first.to(torch.int32), detail.to(torch.int32),
                               mine[HEADER_CALL_WORD:HEADER_CALL_WORD + 1]])
        status.copy_(torch.where((status[0:1] == 0) & (code != 0), rejection, status))

    def parse(self, flat: list[int]) -> tuple[LayoutCounts, list[int], list[list[int]], list[int]]:
        """(counts, bad ids per rank [EP], headers [EP][HEADER_WORDS], status words) of the host copy of a counts
        vector."""
        if len(flat) != self.size:
            raise ValueError(f"counts vector has {len(flat)} words, expected {self.size}")
        ep = self.world_size
        tokens = flat[self.tokens_offset:self.tokens_offset + ep]
        send = [flat[self.send_rows_offset + s * ep:self.send_rows_offset + (s + 1) * ep] for s in range(ep)]
        pairs = flat[self.expert_pairs_offset:self.bad_ids_offset]
        bad = flat[self.bad_ids_offset:self.headers_offset]
        headers = [flat[self.headers_offset + r * HEADER_WORDS:self.headers_offset + (r + 1) * HEADER_WORDS]
                   for r in range(ep)]
        status = flat[self.status_offset:]
        return LayoutCounts(tokens, send, pairs), bad, headers, status
