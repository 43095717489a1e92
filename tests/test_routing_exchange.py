"""The routing exchange kernel (backends/weave/kernels/routing_exchange.py) without a GPU.

Under TRITON_INTERPRET=1, in a subprocess like tests/test_megakernel_cpu.py. The interpreter runs one launch at a time,
programs one after another, so EP ranks are emulated in one process: each rank has its own workspace (ordinary CPU
memory) and `exchange_ctrl`, one peer_bases table holds every rank's buffer address, and a call launches the send
stage of every rank, then the receive stage of every rank (STAGE_SEND leaves the sequence counter, STAGE_RECV
advances it). EP = 1 also runs the production launch (STAGE_BOTH, one part). Every all_routing is compared BITWISE
with the stack of the packed messages, padding included, i.e. with what the all-gather it replaces gives.

The sm_90 PTX is checked for the memory ordering the protocol relies on.
"""

import re
import textwrap

import pytest
import torch

from weave_moe.backends.weave.exchange import RoutingMessage
from weave_moe.backends.weave.kernels import routing_exchange as rx
from weave_moe.backends.weave.workspace import SymmetricWorkspace
from interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    r"""
    import random
    import torch
    from weave_moe.backends.coordination import HEADER_WORDS
    from weave_moe.backends.weave.exchange import RoutingMessage
    from weave_moe.backends.weave.kernels import routing_exchange as rx
    from weave_moe.backends.weave.workspace import SymmetricWorkspace

    CPU = torch.device("cpu")
    GARBAGE = 0x5A5A5A5A
    NUM_EXPERTS = 6


    class Ranks:
        # EP emulated ranks, each with its own workspace; one peer_bases table of their symmetric buffers
        def __init__(self, ep, max_tokens, top_k, seed):
            self.ep, self.rng = ep, random.Random(seed)
            self.workspaces = [SymmetricWorkspace(None, r, ep, CPU) for r in range(ep)]
            self.attach(max_tokens, top_k)
            self.all_routing = [None] * ep

        def attach(self, max_tokens, top_k):
            self.msg = RoutingMessage(max_tokens, top_k)
            self.views = [ws.attach(max_tokens, 8, routing_words=self.msg.words) for ws in self.workspaces]
            self.table = torch.tensor([ws.buffer.data_ptr() for ws in self.workspaces], dtype=torch.int64)
            self.statuses = [torch.zeros(4, dtype=torch.int32) for _ in range(self.ep)]
            for view in self.views:  # what older calls of larger layers could have left in the slots
                view.routing(0).fill_(GARBAGE)
                view.routing(1).fill_(GARBAGE)

        def pack(self, tokens):
            msg = self.msg
            ids = torch.tensor([[self.rng.randrange(-1, NUM_EXPERTS) for _ in range(msg.top_k)]
                                for _ in range(tokens)], dtype=torch.int32).view(tokens, msg.top_k)
            weights = torch.rand(tokens, msg.top_k, generator=torch.Generator().manual_seed(self.rng.randrange(99)))
            header = torch.tensor([self.rng.randrange(-5, 1 << 30) for _ in range(HEADER_WORDS)], dtype=torch.int32)
            out = torch.full((msg.words,), GARBAGE, dtype=torch.int32)
            msg.pack(out, ids, weights, msg.pad(), torch.arange(msg.max_tokens + 1, dtype=torch.int32), header)
            return out

        def call(self, tokens, parts, production=False, skip_send=(), timeout_ns=10 ** 9):
            # one exchange of every rank; tokens[r] = T of rank r; returns the packed messages
            sends = [self.pack(t) for t in tokens]
            for r in range(self.ep):
                self.all_routing[r] = torch.full((self.ep, self.msg.words), GARBAGE, dtype=torch.int32)
            common = dict(parts=parts, peer_bases=self.table, block=8, timeout_ns=timeout_ns)
            if production:
                assert self.ep == 1
                rx.exchange_routing(self.views[0], self.msg, sends[0], self.all_routing[0], self.statuses[0],
                                    stage=rx.STAGE_BOTH, **common)
                return sends
            for r in range(self.ep):
                if r not in skip_send:
                    rx.exchange_routing(self.views[r], self.msg, sends[r], self.all_routing[r], self.statuses[r],
                                        stage=rx.STAGE_SEND, **common)
            for r in range(self.ep):
                rx.exchange_routing(self.views[r], self.msg, sends[r], self.all_routing[r], self.statuses[r],
                                    stage=rx.STAGE_RECV, **common)
            return sends

        def check(self, sends, seq, tokens):
            expected = torch.stack(sends)
            msg, W = self.msg, self.msg.id_words
            for r, view in enumerate(self.views):
                assert self.statuses[r][:4].tolist() == [0, 0, 0, 0], (r, self.statuses[r])
                assert torch.equal(self.all_routing[r], expected), (r, self.all_routing[r], expected)
                # one advance per call, the send counters back at zero, every source's flag at this call
                assert view.exchange_ctrl.tolist() == [seq, 0] + [0] * self.ep, (r, view.exchange_ctrl)
                assert view.routing_flags().tolist() == [seq] * self.ep, (r, view.routing_flags())
                # the call went through the slots of parity seq % 2: the used words sit there
                slots = view.routing(seq % 2)
                for s, t in enumerate(tokens):
                    n = t * msg.top_k
                    for a, b in ((0, n), (W, W + n), (2 * W, msg.words)):
                        assert torch.equal(slots[s, a:b], sends[s][a:b]), (r, s, seq, a, b)


    # (a) one call at EP 1 (production and staged), 2 and 3; T differs per rank, T = 0 and T = T_max included
    for ep, max_tokens, top_k, parts, tokens in [
            (1, 7, 3, 1, [5]), (1, 6, 2, 3, [6]), (2, 9, 2, 1, [4, 0]), (2, 9, 2, 3, [9, 2]),
            (3, 5, 4, 2, [0, 5, 3]), (3, 8, 1, 4, [1, 0, 8])]:
        for production in ([True, False] if ep == 1 and parts == 1 else [False]):
            ranks = Ranks(ep, max_tokens, top_k, seed=ep * 100 + parts)
            ranks.check(ranks.call(tokens, parts, production), 1, tokens)

    # (b) consecutive calls with shrinking T: parities alternate, seq advances by one per call, no stale word leaks
    for ep, parts, production in [(1, 1, True), (2, 2, False), (3, 1, False)]:
        ranks = Ranks(ep, 10, 2, seed=7 + ep)
        schedule = [[10, 9, 7][:ep], [6, 10, 2][:ep], [3, 0, 2][:ep], [0, 4, 1][:ep], [2, 1, 0][:ep]]
        for seq, tokens in enumerate(schedule, start=1):
            ranks.check(ranks.call(tokens, parts, production), seq, tokens)
        # a larger layer grows every rank's workspace (re-allocation): the flags and the sequence restart together
        ranks.attach(12, 3)
        assert all(view.generation == 2 for view in ranks.views)
        for seq, tokens in enumerate([[12, 3, 1][:ep], [0, 0, 0][:ep], [4, 12, 5][:ep]], start=1):
            ranks.check(ranks.call(tokens, parts, production), seq, tokens)

    # (c) a missing peer: rank 1 never sends; rank 0's receive times out, records it and returns
    ranks = Ranks(2, 6, 2, seed=3)
    sends = ranks.call([4, 3], parts=2, skip_send=(1,), timeout_ns=2000)
    for r in range(2):  # neither rank got rank 1's message (rank 1 waits for its own, too)
        assert ranks.statuses[r].tolist() == [5, 1, 0, 1], (r, ranks.statuses[r])
        # rank 0's message did arrive and was copied; rank 1's row is untouched
        assert torch.equal(ranks.all_routing[r][0], sends[0])
        assert (ranks.all_routing[r][1] == GARBAGE).all()
        assert ranks.views[r].exchange_ctrl[0] == 1  # the launch still counted

    # (d) a rejection left in one rank's live status word (the rank whose input was refused raises in the call and
    # never reads its word): its next call must still run. Without the pack launch's carry the word stays set through
    # the exchange, so that rank's waits give up at once (on a GPU its receive had not seen the peer's flag yet) and
    # its kernels do nothing while the peer runs the call (seen at EP = 2 on one GPU; the interpreter runs the sends
    # first, so the receive here finds the flag and copies anyway). With the carry (what every resident call runs
    # first), the live word is clean and the rejection waits in the reported word for the host.
    from weave_moe.backends.coordination import HEADER_WORDS
    from weave_moe.backends.weave.kernels import sync
    rejection = [sync.REJECT_PEER_FAILED, 1, 1, 1]
    for carry in (False, True):
        ranks = Ranks(2, 6, 2, seed=11)
        ranks.statuses = [torch.zeros(8, dtype=torch.int32) for _ in range(2)]
        ranks.check(ranks.call([3, 4], parts=1), 1, [3, 4])
        ranks.statuses[1][:4] = torch.tensor(rejection, dtype=torch.int32)
        sends = []
        for r in range(2):
            send = torch.empty(ranks.msg.words, dtype=torch.int32)
            ids = torch.tensor([[r, 5], [2, -1]], dtype=torch.int32)
            header = torch.tensor([7, 0, 2, 0], dtype=torch.int32)[:HEADER_WORDS]
            if carry:
                x = torch.empty(2, 8, dtype=torch.bfloat16)
                ranks.msg.pack_call(send, ids, torch.rand(2, 2), header, torch.zeros(2, dtype=torch.int64), x, x, 0,
                                    ranks.statuses[r], torch.ones(3, dtype=torch.int32),
                                    torch.ones(4, dtype=torch.int32), NUM_EXPERTS)
            else:
                ranks.msg.pack(send, ids, torch.rand(2, 2), ranks.msg.pad(),
                               torch.arange(ranks.msg.max_tokens + 1, dtype=torch.int32), header)
            sends.append(send)
        for stage in (rx.STAGE_SEND, rx.STAGE_RECV):
            for r in range(2):
                ranks.all_routing[r] = (torch.full((2, ranks.msg.words), GARBAGE, dtype=torch.int32)
                                        if stage == rx.STAGE_SEND else ranks.all_routing[r])
                rx.exchange_routing(ranks.views[r], ranks.msg, sends[r], ranks.all_routing[r], ranks.statuses[r],
                                    stage=stage, parts=1, peer_bases=ranks.table, block=8, timeout_ns=10 ** 9)
        for r in range(2):
            assert torch.equal(ranks.all_routing[r], torch.stack(sends)), (carry, r)
        after = [0, 0, 0, 0] + rejection if carry else rejection + [0, 0, 0, 0]
        assert ranks.statuses[1].tolist() == after, (carry, ranks.statuses[1])
        assert not ranks.statuses[0].any()
    print("ROUTING EXCHANGE INTERPRETER OK")
    """
)


def test_routing_exchange_under_interpreter():
    run_interpreted(SCRIPT, "ROUTING EXCHANGE INTERPRETER OK")


# ---- the launcher's checks (they raise before any launch, so no interpreter is needed) ------------------------------
def _setup(ep=2, routing=True):
    msg = RoutingMessage(4, 2)
    view = SymmetricWorkspace(None, 0, ep, torch.device("cpu")).attach(4, 8,
                                                                        routing_words=msg.words if routing else 0)
    return view, msg, torch.zeros(msg.words, dtype=torch.int32), torch.zeros(ep, msg.words, dtype=torch.int32)


@pytest.mark.parametrize("change, match", [
    (dict(routing=False), "routing_words"),
    (dict(send=torch.zeros(3, dtype=torch.int32)), "send"),
    (dict(send=torch.zeros(4 * 2 * 2 + 5, dtype=torch.int64)), "send"),
    (dict(all_routing=torch.zeros(1, 4 * 2 * 2 + 5, dtype=torch.int32)), "all_routing"),
    (dict(status=torch.zeros(2, dtype=torch.int32)), "status"),
    (dict(stage=3), "stage"),
    (dict(timeout_ns=0), "timeout_ns"),
    (dict(parts=65), "parts"),
    (dict(parts=0), "parts"),
    (dict(block=12), "block"),
    (dict(peer_bases=torch.zeros(3, dtype=torch.int64)), "peer_bases"),
])
def test_launcher_rejects_bad_arguments(change, match):
    view, msg, send, all_routing = _setup(routing=change.pop("routing", True))
    args = dict(send=send, all_routing=all_routing, status=torch.zeros(4, dtype=torch.int32), timeout_ns=10) | change
    with pytest.raises(ValueError, match=match):
        rx.exchange_routing(view, msg, **args)


def test_default_parts_keep_every_program_resident():
    assert rx.default_parts(1, RoutingMessage(8, 2).words) == 1  # a small message: one program per peer
    assert rx.default_parts(2, RoutingMessage(8192, 8).words) == rx.DEFAULT_MAX_PARTS
    for ep in (1, 2, 8, 64, 128):
        assert ep * rx.default_parts(ep, RoutingMessage(8192, 8).words) <= rx.MAX_PROGRAMS


# ---- sm_90 PTX ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ptx():
    return rx.compile_exchange_ptx(rx.STAGE_BOTH)


def _has_atomic(ptx: str, *modifiers: str) -> bool:
    """An `atom`/`red` instruction carrying every one of `modifiers` (any order: Triton's order varies)."""
    return any(set(modifiers) <= set(m.group(1).split("."))
               for m in re.finditer(r"\b(?:atom|red)((?:\.[a-z0-9_:]+)+)", ptx))


def test_exchange_ptx_has_the_memory_ordering_it_relies_on(ptx):
    # the flag: one release exchange of seq at system scope; the receiver polls it with system-scope acquire loads
    assert _has_atomic(ptx, "global", "sys", "release", "exch")
    assert re.search(r"ld\.global\.sys\.acquire", ptx)
    # the parts of a message count themselves with acq_rel adds at system scope before the flag is set
    assert _has_atomic(ptx, "global", "sys", "acq_rel", "add")
    # bounded waits: the global timer, and the first error recorded with a CAS on the status word
    assert "%globaltimer" in ptx and "nanosleep" in ptx
    assert _has_atomic(ptx, "global", "cas")


def test_exchange_spin_loop_steers_on_cta_uniform_values(ptx):
    """As in test_megakernel_cpu: no per-thread volatile loads, the clock through a CTA-wide max."""
    assert "ld.volatile" not in ptx
    timer = ptx.index("%globaltimer")
    window = ptx[timer:timer + 20000]
    assert "shfl.sync.bfly" in window and "bar.sync" in window


@pytest.mark.parametrize("stage", [rx.STAGE_SEND, rx.STAGE_RECV])
def test_exchange_stages_compile(stage):
    ptx = rx.compile_exchange_ptx(stage)
    # the send stage sets flags and never waits; the receive stage waits and never sets a flag
    assert _has_atomic(ptx, "global", "sys", "release", "exch") == (stage == rx.STAGE_SEND)
    assert bool(re.search(r"ld\.global\.sys\.acquire", ptx)) == (stage == rx.STAGE_RECV)


PACK_SCRIPT = r'''
import torch
from weave_moe.backends.coordination import HEADER_CALL_WORD, HEADER_WORDS
from weave_moe.backends.weave.exchange import CallSlots, RoutingMessage
from weave_moe.backends.weave.kernels import sync
E = 8
for T_max, k, T, code, dtype in [(5, 2, 5, 0, torch.int32), (5, 2, 3, 7, torch.int64), (4097, 3, 4000, 0, torch.int32),
                                 (4097, 3, 4000, 0, torch.int64), (3, 4, 0, 2, torch.int32)]:
    msg = RoutingMessage(T_max, k)
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(-1, 9, (T, k), generator=g, dtype=torch.int32)   # 8 = E: out of range, stays E
    w = torch.rand(T, k, generator=g)
    header = torch.tensor([11, 12, 13, 0], dtype=torch.int32)[:HEADER_WORDS]
    ref = torch.empty(msg.words, dtype=torch.int32)
    want_header = header.clone(); want_header[-1] = code
    msg.pack(ref, ids, w, msg.pad(), torch.arange(T_max + 1, dtype=torch.int32), want_header)
    given = ids.to(dtype)
    if dtype == torch.int64 and T:   # wide ids are narrowed without wrapping: 2**32 + 3 must not become expert 3
        given[0, 0], given[-1, -1] = 2**32 + 3, -2**40
        ref[0] = E
        ref[T * k - 1] = -2
    got = torch.full((msg.words,), 12345, dtype=torch.int32)
    io = torch.zeros(2, dtype=torch.int64)
    x, out = torch.empty(T, 8, dtype=torch.bfloat16), torch.empty(T, 8, dtype=torch.bfloat16)
    status = torch.zeros(8, dtype=torch.int32)
    control, flags = torch.full((9000,), 7, dtype=torch.int32), torch.full((37,), 5, dtype=torch.int32)
    msg.pack_call(got, given, w, header, io, x, out, code, status, control, flags, E)
    assert torch.equal(got, ref), (T_max, k, T, (got != ref).nonzero()[:5])
    assert io.tolist() == [x.data_ptr(), out.data_ptr()]
    want_after = [11, 12, 13, 0][:HEADER_WORDS]
    want_after[HEADER_CALL_WORD] += 1   # the call number advances; the device header keeps its own error word
    assert header.tolist() == want_after, header.tolist()
    assert not status.any() and not control.any() and not flags.any()
    # the same call through a slot of the host ring (CallSlots: the in-graph pack of the resident call): the same
    # words, addresses, header, status, control block and flags
    slots = CallSlots(msg, torch.device("cpu"), num_slots=2)
    for call in range(3):   # wraps the ring of two slots
        got2 = torch.full((msg.words,), 12345, dtype=torch.int32)
        io2 = torch.zeros(2, dtype=torch.int64)
        header2 = torch.tensor([11, 12, 13, 0], dtype=torch.int32)[:HEADER_WORDS]
        status2 = torch.zeros(8, dtype=torch.int32)
        control2, flags2 = torch.full((9000,), 7, dtype=torch.int32), torch.full((37,), 5, dtype=torch.int32)
        slots.write(x, out, given, w, code, wait=None)
        slots.launch(got2, header2, io2, status2, control2, flags2, E)
        assert torch.equal(got2, ref), (T_max, k, T, call, (got2 != ref).nonzero()[:5])
        assert io2.tolist() == io.tolist() and header2.tolist() == want_after
        assert not status2.any() and not control2.any() and not flags2.any()
        assert slots.cursor.item() == call + 1 and int(slots.consumed_numpy[0]) == call + 1
        assert slots.done.item() == 0   # reset by the last program
# a full ring: the host waits (bounded by its caller) before it overwrites a slot no kernel has read yet
slots = CallSlots(RoutingMessage(4, 2), torch.device("cpu"), num_slots=2)
ids, w, x = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, 2), torch.empty(1, 8)
waited = []
def refuse(is_done):
    waited.append(is_done())
    raise TimeoutError("ring full")
slots.write(x, x, ids, w, 0, wait=refuse)
slots.write(x, x, ids, w, 0, wait=refuse)
try:
    slots.write(x, x, ids, w, 0, wait=refuse)
    raise AssertionError("a third write into a ring of two unread slots did not wait")
except TimeoutError:
    pass
assert waited == [False] and slots.written == 2
# the status word: a rejection moves from the live word into the reported one (first error wins) and the live word
# is cleared, so the call runs; a kernel error (code < 16) stays live
msg = RoutingMessage(4, 2)
ids, w = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2)
got, io, x = torch.empty(msg.words, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), torch.empty(2, 8)
header, control, flags = (torch.zeros(n, dtype=torch.int32) for n in (HEADER_WORDS, 4, 4))
for before, after in [
    ([sync.REJECT_BAD_IDS, 1, 3, 7, 0, 0, 0, 0], [0, 0, 0, 0, sync.REJECT_BAD_IDS, 1, 3, 7]),
    ([sync.REJECT_CALL_ORDER, 0, 9, 8, sync.REJECT_BAD_IDS, 1, 3, 7], [0, 0, 0, 0, sync.REJECT_BAD_IDS, 1, 3, 7]),
    ([0, 0, 0, 0, sync.REJECT_PEER_FAILED, 1, 1, 2], [0, 0, 0, 0, sync.REJECT_PEER_FAILED, 1, 1, 2]),
    ([5, 1, 3, 4, 0, 0, 0, 0], [5, 1, 3, 4, 0, 0, 0, 0]),
    ([0] * 8, [0] * 8),
]:
    status = torch.tensor(before, dtype=torch.int32)
    msg.pack_call(got, ids, w, header, io, x, x, 0, status, control, flags, E)
    assert status.tolist() == after, (before, status.tolist())
    # ... and through the ring's in-graph pack (its live word loaded at the kernel's start, one program)
    status = torch.tensor(before, dtype=torch.int32)
    ring = CallSlots(msg, torch.device("cpu"), num_slots=2)
    ring.write(x, x, ids, w, 0, wait=None)
    ring.launch(got, header, io, status, control, flags, E)
    assert status.tolist() == after, (before, status.tolist())
print("PACK OK")
'''


def test_pack_call_equals_pack_under_interpreter():
    """The resident call's one launch before its graph writes the message `pack` writes (bitwise, padding included;
    int64 ids narrowed without wrapping), the error code in place of the header's, the addresses of x and out;
    advances the call number, zeroes the control block and the flags, and carries a rejection out of the live status
    word."""
    run_interpreted(PACK_SCRIPT, "PACK OK", timeout=300)


@pytest.mark.parametrize("ids_dtype", ["*i32", "*i64"])
def test_pack_kernel_compiles_for_sm90(ids_dtype):
    """The launch before the resident call's graph compiles for Hopper with int32 and int64 ids (one compiled
    kernel per dtype: RoutingMessage.pack_call keys its direct launches by it), without local memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from weave_moe.backends.weave.exchange import _pack_kernel

    pointers = dict(ids_ptr=ids_dtype, weights_ptr="*fp32", io_ptr="*i64")
    signature = {name: pointers.get(name, "*i32") if name.endswith("_ptr") else
                 "constexpr" if name in ("HEADER", "CALL_WORD", "BLOCK") else
                 "i64" if name.endswith("_address") else "i32" for name in _pack_kernel.arg_names}
    source = ASTSource(fn=_pack_kernel, signature=signature, constexprs=dict(HEADER=4, CALL_WORD=2, BLOCK=4096))
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert ".local" not in ptx and "bar.sync" in ptx


def test_slot_pack_kernel_compiles_for_sm90():
    """The resident call's in-graph pack (CallSlots) compiles for Hopper, both ids widths in one kernel, without local
    memory; the slot's addresses become pointers (no argument carries them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from weave_moe.backends.weave.exchange import _pack_slot_kernel

    pointers = dict(slots_ptr="*i64", consumed_ptr="*i64", io_ptr="*i64")
    constexprs = dict(SLOT=8, HEADER=4, CALL_WORD=2, BLOCK=4096)
    signature = {name: pointers.get(name, "*i32") if name.endswith("_ptr") else
                 "constexpr" if name in constexprs else "i32" for name in _pack_slot_kernel.arg_names}
    source = ASTSource(fn=_pack_slot_kernel, signature=signature, constexprs=constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert ".local" not in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx   # the programs' arrival count before the cursor advances


def _production_exchange_worker(rank: int, world_size: int, schedule: list) -> list:
    """One rank of test_production_exchange_across_two_processes (TRITON_INTERPRET=1 inherited from the test)."""
    import torch.distributed as dist

    from weave_moe.backends.coordination import HEADER_WORDS

    workspace = SymmetricWorkspace(dist.group.WORLD, rank, world_size, torch.device("cpu"))
    msg = RoutingMessage(8, 2)
    view = workspace.attach(8, 8, routing_words=msg.words)
    status = torch.zeros(4, dtype=torch.int32)
    results = []
    for call, tokens in enumerate(schedule):
        g = torch.Generator().manual_seed(100 * call + rank)
        ids = torch.randint(-1, 6, (tokens[rank], 2), generator=g, dtype=torch.int32)
        weights = torch.rand(tokens[rank], 2, generator=g)
        header = torch.tensor([rank, call, 7, 0], dtype=torch.int32)[:HEADER_WORDS]
        send = torch.empty(msg.words, dtype=torch.int32)
        msg.pack(send, ids, weights, msg.pad(), torch.arange(msg.max_tokens + 1, dtype=torch.int32), header)
        all_routing = torch.full((world_size, msg.words), 0x5A5A5A5A, dtype=torch.int32)
        rx.exchange_routing(view, msg, send, all_routing, status, timeout_ns=120 * 10**9, parts=1, block=8)
        results.append(dict(send=send, all_routing=all_routing, status=status.tolist(),
                            ctrl=view.exchange_ctrl.tolist()))
    dist.barrier()  # no rank frees its buffer while a peer may still read it
    return results


@pytest.mark.parametrize("schedule", [[[5, 8], [0, 3], [8, 0], [2, 2]], [[3, 8, 0, 5], [8, 1, 2, 0]]],
                         ids=["ep2", "ep4"])
def test_production_exchange_across_processes(monkeypatch, schedule):
    """The production launch (send, then receive, in one launch) between real processes (EP 2 and 4): each rank's
    buffer opened by the others through the ipc transport (shared memory on the CPU), the kernels under the
    interpreter, the ranks running at the same time; consecutive calls with changing T (both parities, T = 0 and
    T_max). Every rank's all_routing equals the stack of every rank's message, bit for bit."""
    from weave_moe.testing import run_distributed

    monkeypatch.setenv("TRITON_INTERPRET", "1")   # inherited by the spawned ranks, before they import triton
    world_size = len(schedule[0])
    results = run_distributed(_production_exchange_worker, world_size, schedule, backend="gloo", timeout_s=600,
                              env=dict(TRITON_INTERPRET="1"), shared_device=True)
    for call in range(len(schedule)):
        expected = torch.stack([results[r][call]["send"] for r in range(world_size)])
        for rank in range(world_size):
            got = results[rank][call]
            assert got["status"] == [0, 0, 0, 0], (call, rank, got["status"])
            assert torch.equal(got["all_routing"], expected), (call, rank)
            assert got["ctrl"] == [call + 1, 0] + [0] * world_size, (call, rank, got["ctrl"])


def test_a_dropped_slot_ring_is_kept_until_its_last_call_has_run():
    """CallSlots' pinned memory is read by kernels the allocator does not know about: a ring dropped with calls still
    queued stays referenced until its owner's per-call event has passed, then is freed at the next ring's creation
    (and one that never made a call is freed at once)."""
    from weave_moe.backends.weave import exchange

    class Event:   # a CUDA event's query(), without a GPU
        done = False

        def query(self):
            return self.done

    ring, event = (torch.zeros(2),), Event()
    exchange._RETIRED.clear()
    exchange._retire(ring, [None])
    assert exchange._RETIRED == []          # no call made: nothing can still read it
    exchange._retire(ring, [event])
    exchange._release_retired()
    assert exchange._RETIRED == [(event, ring)]   # its last call has not run yet
    event.done = True
    exchange.CallSlots(RoutingMessage(4, 2), torch.device("cpu"), num_slots=2)   # a new ring frees the old one
    assert exchange._RETIRED == []


STATUS_SCRIPT = textwrap.dedent(
    r"""
    import torch
    from weave_moe.backends.weave.exchange import copy_status
    for words in (1, 8, 13):
        status = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32)
        host = torch.full((words + 3,), 7, dtype=torch.int32)
        copy_status(status, host[:words])
        assert torch.equal(host[:words], status) and (host[words:] == 7).all(), (status, host)
    try:
        copy_status(torch.zeros(8, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    except ValueError as error:
        assert "copy_status" in str(error)
    else:
        raise AssertionError("a shape mismatch was accepted")
    print("STATUS-COPY-OK")
    """)


def test_copy_status_copies_every_word_and_nothing_past_it():
    """The resident call's last node (exchange.copy_status): the status words bitwise, no word past them written."""
    run_interpreted(STATUS_SCRIPT, "STATUS-COPY-OK", timeout=120)
