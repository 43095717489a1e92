"""The routing exchange through the symmetric workspace: every rank's RoutingMessage to every rank, in one kernel.

It replaces the all-gather of the routing messages (`all_routing` [EP, words] int32, exchange.py's format) with a
device-resident exchange: no host involvement, capturable in a CUDA graph, every wait bounded. Regions (workspace.py):
`routing` [2 parities][EP sources][M] int32 and `rflags` [EP] int32 in every rank's symmetric buffer, reached as
peer base address + byte offset; `exchange_ctrl` (local) holds [SEQ, DONE, SENT[EP]] (the CTRL_* constants).

Grid = EP x P: program (i, part) sends part `part` of this rank's message to destination i, then receives part `part`
of source i's message. Protocol, per launch:

1. Sequence number. Every program reads seq = ctrl[SEQ] + 1 with an atomic (the same in every thread). Every rank
   makes the same launches in the same order, so seq is the same on every rank for the same call. parity = seq % 2.
2. Counter advance, exactly once per launch. At its end (after its send and receive, so that the atomic round trip
   and the CTA barrier of the count are not ahead of the send), every program counts itself on ctrl[DONE]
   (`sync.arrive`: acq_rel). The program that sees the last count (EP * P - 1) resets ctrl[DONE] to 0 and stores seq
   into ctrl[SEQ]. Race-free: each program's read of ctrl[SEQ] comes before its release on ctrl[DONE], and the last
   program's acquire of ctrl[DONE] saw every one of them, so no program of this launch can read the new value; the
   next launch is stream-ordered after this one and reads it. (ctrl[DONE] is back at 0 for the next launch.) Every
   program gets there, a receive that timed out included.
3. Send. Program (d, part) copies its share of the USED words of this rank's message (ids and weights of the first
   T * k entries, T read from the message's T word, and the tail: T and the header) into destination d's slot
   routing[parity][this rank], at the same word positions as in the message. Then it counts itself on the local
   ctrl[SENT + d] (`sync.arrive`, system scope, after a CTA barrier); the program that completes d's P parts resets
   that counter and release-stores seq into d's rflags[this rank] at system scope (`sync.signal_store`). A flag
   value >= seq means "source's message seq is complete in its slot". The chain part's stores -> its release on
   SENT -> the last part's acquire on SENT -> its release on the flag -> the destination's acquire of the flag is
   system-scoped throughout, so every part's stores are visible to the destination.
4. Receive. Program (s, part) waits (`sync.wait_at_least`, acquire, system scope, deadline `timeout_ns`) until
   rflags[s] in this rank's buffer reaches seq. On timeout it records ERROR_EXCHANGE_TIMEOUT in the status word
   ([5, s, value seen, seq]) and stops; so do the other waits of the launch once the status word is set (as every
   wait of sync.py does: a status word already set by an earlier kernel makes a wait that is not yet satisfied
   return at once). After a timeout the ranks' sequences may have parted: retire the workspace on every rank, as
   after any WeaveTimeoutError (workspace.py). After the
   wait it copies its share of routing[parity][s] into all_routing[s] (the local, fixed-address tensor the counts
   code reads): ids beyond T * k are written as -1 and weights beyond T * k as 0 (bits), explicitly, so words of an
   older, longer message in the slot never leak. Each program waits for the one source it copies; the launch ends
   only when all sources arrived.
5. Why two parities suffice. A sender writes parity p again only at seq + 2. It starts its seq + 2 launch only after
   its seq + 1 launch ended (stream order), which waited for every peer's seq + 1 message; a peer sends that only in
   its own seq + 1 launch, which starts after its seq launch, copy-out of slot p included, has ended. So slot p is
   never overwritten while a receiver still reads it. A flag may already read seq + 1 while a receiver is at seq
   (the source moved on): the data of seq is complete then too (the source's release of seq + 1 comes after its
   seq in stream order and is cumulative), and seq + 1 went to the other parity.
   The same argument makes the exchange a barrier in the sense workspace.py's flag protocol needs: no rank passes
   its call-n exchange before every rank has entered it, i.e. finished its call n - 1 work in stream order.
6. Co-residency. A program waits only for peers' flags, and sends before it waits, so the exchange cannot deadlock
   as long as all EP * P programs of a rank are resident together (the launcher keeps EP * P <= MAX_PROGRAMS,
   below the SM count of the GPUs this runs on; a program waiting for a program that is not yet resident would
   wait for itself). At EP = 1 the rank sends to itself: the same code, so tests and single-GPU runs exercise it.
7. Restart. The flags restart at 0 and ctrl[SEQ] at 0 whenever the workspace (re-)allocates its symmetric buffer,
   on every rank at the same layer (workspace.py). Sequence numbers are int32: 2^31 - 1 launches per allocation.

Stages (`STAGE`): STAGE_BOTH (0) is production. STAGE_SEND (1) runs steps 1 and 3 only and leaves ctrl[SEQ] as it
is; STAGE_RECV (2) runs steps 1, 2 and 4. So a send launch followed by a receive launch on one rank is one
production launch. The CPU interpreter runs programs one after another, one launch at a time, and so cannot run two
ranks' production launches at once; tests emulate EP ranks in one process by launching STAGE_SEND for every rank,
then STAGE_RECV for every rank (each rank with its own workspace, `exchange_ctrl` and a shared peer_bases table).
Under the interpreter a production launch runs only with P = 1 at EP = 1 (a part would otherwise wait for a later
part's flag store).

Every spin steers on CTA-uniform values: seq and the arrival counts come from scalar atomics, the wait is
`sync.wait_at_least` (status word by atomics, clock through `sync.uniform_time_ns`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weave_moe.backends.weave.exchange import RoutingMessage
from weave_moe.backends.weave.kernels import sync
from weave_moe.backends.weave.kernels.peers import peer_ptr
from weave_moe.backends.weave.workspace import EXCHANGE_CTRL_FIXED, WorkspaceView

__all__ = ["exchange_routing", "compile_exchange_ptx", "routing_exchange_kernel", "STAGE_BOTH", "STAGE_SEND",
           "STAGE_RECV", "MAX_PROGRAMS"]

# exchange_ctrl layout (int32, local; workspace.py allocates EXCHANGE_CTRL_FIXED + EP words)
CTRL_SEQ = tl.constexpr(0)    # the last sequence number this rank's launches completed step 2 for
CTRL_DONE = tl.constexpr(1)   # programs of the current launch that read CTRL_SEQ (the last one resets it)
CTRL_SENT = tl.constexpr(2)   # [EP] parts of the current message copied to destination d (the last one resets it)
assert CTRL_SENT.value == EXCHANGE_CTRL_FIXED

STAGE_BOTH = tl.constexpr(0)   # production: send, then receive
STAGE_SEND = tl.constexpr(1)   # send only (leaves ctrl[SEQ])
STAGE_RECV = tl.constexpr(2)   # receive only (advances ctrl[SEQ])

#: most programs (EP * P) of one launch: all must be resident together (protocol step 6); H100/H200 have 132 SMs
MAX_PROGRAMS = 128
#: default int32 words one program copies per loop step
DEFAULT_BLOCK = 1024
#: default upper bound on P, the parts each message is split into per destination
DEFAULT_MAX_PARTS = 8


@triton.jit
def _slot_ptr(peer_base_ptr, owner, routing_offset, parity, source, world_size, slot_words):
    """int32 pointer to routing[parity][source] in `owner`'s symmetric buffer."""
    slot = (parity * world_size + source).to(tl.int64) * slot_words
    return peer_ptr(peer_base_ptr, owner, routing_offset + slot * 4, tl.int32)


@triton.jit
def _used_ids(tokens, id_words, top_k):
    """T * k clamped to [0, W]: how many id (and weight) words of a message are used."""
    tokens = tl.minimum(tl.maximum(tokens, 0), id_words // top_k)
    return tokens * top_k


# Not specialised on the values that differ between ranks (Triton compiles an int argument equal to 1 separately):
# every rank runs the same binary, so no rank compiles while its peers already spin in their first exchange (seen on
# the H200: at EP 2 the rank-1 compile outlasted rank 0's 1 s deadline).
@triton.jit(do_not_specialize=["rank", "world_size", "timeout_ns"])
def routing_exchange_kernel(send_ptr, all_routing_ptr, peer_base_ptr, ctrl_ptr, status_ptr, routing_offset,
                            routing_flags_offset, slot_words, rank, world_size, id_words, words, top_k, timeout_ns,
                            STAGE: tl.constexpr, BLOCK: tl.constexpr):
    sync.pdl_enter()
    peer = tl.program_id(0)  # destination of the send, source of the receive
    part = tl.program_id(1)
    num_parts = tl.num_programs(1)
    offs = tl.arange(0, BLOCK)

    # 1. this launch's sequence number and parity
    seq = tl.atomic_add(ctrl_ptr + CTRL_SEQ, 0, sem="relaxed", scope="gpu") + 1
    parity = seq % 2
    # 3. send this rank's used words to routing[parity][rank] of destination `peer`
    if STAGE != STAGE_RECV:
        n = _used_ids(tl.load(send_ptr + 2 * id_words), id_words, top_k)
        total = 2 * n + (words - 2 * id_words)  # ids, weights, then the T word and the header
        dst = _slot_ptr(peer_base_ptr, peer, routing_offset, parity, rank, world_size, slot_words)
        for start in range(part * BLOCK, total, num_parts * BLOCK):
            v = start + offs
            word = tl.where(v < n, v, tl.where(v < 2 * n, id_words + v - n, 2 * id_words + v - 2 * n))
            mask = v < total
            tl.store(dst + word, tl.load(send_ptr + word, mask=mask), mask=mask)
        if sync.arrive(ctrl_ptr + CTRL_SENT + peer, True) == num_parts - 1:
            tl.atomic_xchg(ctrl_ptr + CTRL_SENT + peer, 0, sem="relaxed", scope="gpu")
            flag = peer_ptr(peer_base_ptr, peer, routing_flags_offset + rank * 4, tl.int32)
            sync.signal_store(flag, seq, True)

    # 4. receive source `peer`'s message from this rank's routing[parity][peer] into all_routing[peer]
    if STAGE != STAGE_SEND:
        flag = peer_ptr(peer_base_ptr, rank, routing_flags_offset + peer * 4, tl.int32)
        ok = sync.wait_at_least(flag, seq, status_ptr, sync.ERROR_EXCHANGE_TIMEOUT, peer, timeout_ns, True)
        if ok != 0:
            src = _slot_ptr(peer_base_ptr, rank, routing_offset, parity, peer, world_size, slot_words)
            n = _used_ids(tl.load(src + 2 * id_words), id_words, top_k)
            out = all_routing_ptr + peer.to(tl.int64) * words
            for start in range(part * BLOCK, words, num_parts * BLOCK):
                w = start + offs
                is_id = w < id_words
                used = (w < n) | ((w >= id_words) & (w < id_words + n)) | (w >= 2 * id_words)
                mask = w < words
                value = tl.load(src + w, mask=mask & used, other=0)  # padding weights: 0.0
                tl.store(out + w, tl.where(is_id & ~used, -1, value), mask=mask)  # padding ids: -1

    # 2. the counter advances once per launch, at its end (the send-only stage leaves it to the receive stage)
    if STAGE != STAGE_SEND:
        done = sync.arrive(ctrl_ptr + CTRL_DONE, False)
        if done == tl.num_programs(0) * num_parts - 1:
            tl.atomic_xchg(ctrl_ptr + CTRL_DONE, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(ctrl_ptr + CTRL_SEQ, seq, sem="relaxed", scope="gpu")


def default_parts(world_size: int, words: int, block: int = DEFAULT_BLOCK) -> int:
    """P: one part per 4 blocks of the message, at most DEFAULT_MAX_PARTS and at most MAX_PROGRAMS // EP."""
    return max(1, min(DEFAULT_MAX_PARTS, triton.cdiv(words, 4 * block), MAX_PROGRAMS // world_size))


def exchange_routing(view: WorkspaceView, message: RoutingMessage, send: torch.Tensor, all_routing: torch.Tensor,
                     status: torch.Tensor, timeout_ns: int, *, stage: int = STAGE_BOTH, parts: int | None = None,
                     peer_bases: torch.Tensor | None = None, block: int = DEFAULT_BLOCK,
                     num_warps: int = 4, compile_only: bool = False) -> torch.Tensor:
    """Exchange this rank's routing message with every rank of the view's group (module docstring); one launch, no
    host sync, no allocation (capturable). Every rank must make the same calls in the same order.

    Args:
        view: the layer's WorkspaceView, attached with routing_words >= message.words.
        message: the layer's RoutingMessage (W = T_max * k, k, words).
        send: [words] int32, this rank's packed message (RoutingMessage.pack); T is read from it on the device.
        all_routing: [EP, words] int32 contiguous, filled with every rank's message, padding written explicitly
            (bitwise what an all-gather of the packed messages gives).
        status: int32 status word (>= 4 words, kernels/sync.py); a timeout records [5, source rank, seen, seq].
        timeout_ns: deadline of each wait, ns.
        stage: STAGE_BOTH (production), or STAGE_SEND / STAGE_RECV for the interpreter's emulation of several ranks.
        parts: P, programs per peer (default `default_parts`); EP * P <= MAX_PROGRAMS.
        peer_bases: [EP] int64 base addresses; default view.peer_bases (tests pass a table of several ranks' buffers).
        block: int32 words a program copies per step (a power of 2).
        num_warps: warps per program.
        compile_only: compile for these arguments and launch nothing (a layer does it before its first call, so
            that no rank compiles while its peers wait in the exchange).

    Returns `all_routing`.
    """
    ep = view.world_size
    words = message.words
    stage = stage.value if isinstance(stage, tl.constexpr) else stage
    if view.routing_words < words or view.routing_slot_words < words:
        raise ValueError(f"the view was attached with routing_words={view.routing_words}, the message has {words} "
                         f"words: attach the layer with routing_words=message.words")
    if send.dtype != torch.int32 or send.shape != (words,) or not send.is_contiguous():
        raise ValueError(f"send must be a contiguous [{words}] int32 tensor, got {send.dtype} {tuple(send.shape)}")
    if all_routing.dtype != torch.int32 or all_routing.shape != (ep, words) or not all_routing.is_contiguous():
        raise ValueError(f"all_routing must be a contiguous [{ep}, {words}] int32 tensor, got {all_routing.dtype} "
                         f"{tuple(all_routing.shape)}")
    if status.dtype != torch.int32 or status.numel() < 4:
        raise ValueError("status must be an int32 status word of at least 4 words")
    if stage not in (0, 1, 2):
        raise ValueError(f"stage must be STAGE_BOTH, STAGE_SEND or STAGE_RECV, got {stage!r}")
    if not isinstance(timeout_ns, int) or timeout_ns <= 0:
        raise ValueError(f"timeout_ns must be an int > 0, got {timeout_ns!r}")
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a power of 2, got {block}")
    parts = default_parts(ep, words, block) if parts is None else parts
    if not isinstance(parts, int) or parts < 1 or ep * parts > MAX_PROGRAMS:
        raise ValueError(f"parts must be an int >= 1 with EP * parts <= {MAX_PROGRAMS}, got {parts!r} at EP {ep}")
    peer_bases = view.peer_bases if peer_bases is None else peer_bases
    if peer_bases.dtype != torch.int64 or peer_bases.numel() != ep:
        raise ValueError(f"peer_bases must be [{ep}] int64")
    args = (send, all_routing, peer_bases, view.exchange_ctrl, status, view.routing_offset, view.routing_flags_offset,
            view.routing_slot_words, view.rank, ep, message.id_words, words, message.top_k, timeout_ns)
    if compile_only:
        routing_exchange_kernel.warmup(*args, STAGE=stage, BLOCK=block, num_warps=num_warps, grid=(ep, parts),
                                       **sync.LAUNCH)
    else:
        routing_exchange_kernel[(ep, parts)](*args, STAGE=stage, BLOCK=block, num_warps=num_warps, **sync.LAUNCH)
    return all_routing


def compile_exchange_ptx(stage: int = 0, block: int = DEFAULT_BLOCK, capability: int = 90,
                         num_warps: int = 4) -> str:
    """Compile the exchange kernel for `sm_<capability>` without a GPU and return its PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(send_ptr="*i32", all_routing_ptr="*i32", peer_base_ptr="*i64", ctrl_ptr="*i32",
                     status_ptr="*i32", routing_offset="i64", routing_flags_offset="i64", slot_words="i64",
                     rank="i32", world_size="i32", id_words="i32", words="i32", top_k="i32", timeout_ns="i64",
                     STAGE="constexpr", BLOCK="constexpr")
    stage = stage.value if isinstance(stage, tl.constexpr) else stage
    source = ASTSource(fn=routing_exchange_kernel, signature=signature, constexprs=dict(STAGE=stage,
                                                                                      BLOCK=block))
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})
    return compiled.asm["ptx"]
