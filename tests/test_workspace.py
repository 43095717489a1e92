"""The shared workspace (backends/weave/workspace.py) on the CPU: sizes, views, growth, the registry, and the flag
protocol across layers, checked by an emulation of EP ranks that interleaves their steps at random.

The megakernel itself runs on a shared workspace (two layers, alternating parity) under the interpreter in
tests/test_megakernel_cpu.py.
"""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch

from weave_moe.backends.coordination import HEADER_WORDS
from weave_moe.backends.weave.exchange import RoutingMessage
from weave_moe.backends.weave.workspace import (_IPC_ROUNDS, EXCHANGE_CTRL_FIXED, SymmetricWorkspace, WorkspaceBytes,
                                             retire_shared)
from weave_moe.models import MoESpec
from weave_moe.plan import MAX_CHUNKS

CPU = torch.device("cpu")
MiB = 1 << 20


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def test_two_layers_share_one_workspace_sized_by_the_larger():
    ws = SymmetricWorkspace(None, 0, 1, CPU)
    small = ws.attach(max_tokens=8, hidden_size=16, intermediate_size=12, max_pairs=20)
    assert ws.generation == 1
    large = ws.attach(max_tokens=30, hidden_size=40, intermediate_size=8, max_pairs=50)
    assert ws.generation == 2 and small.generation == 2, "the larger layer re-points the smaller one's views"
    assert ws.capacity.rows == WorkspaceBytes.of(1, 30, 40).rows and ws.buffer.numel() == ws.capacity.symmetric
    assert ws.capacity.h == max(20 * 12, 50 * 8) * 2 and ws.capacity.y == 50 * 40 * 2  # each part by its largest
    # each layer's views: its own shape, at the start of the shared regions
    assert small.recv().shape == (8, 16) and large.recv().shape == (30, 40)
    assert small.comb(1).shape == (8, 16) and large.comb(0).shape == (30, 40)
    assert small.h().shape == (20, 12) and large.y().shape == (50, 40)
    base = ws.buffer.data_ptr()
    for view in (small, large):
        assert view.recv().data_ptr() == base + ws.recv_offset
        assert [view.comb(p).data_ptr() for p in (0, 1)] == [base + o for o in ws.comb_offsets]
        assert [view.flags(p).data_ptr() for p in (0, 1)] == [base + o for o in ws.flags_offsets]
        assert view.comb_flags(1).data_ptr() == view.flags(1).data_ptr() + 4 * MAX_CHUNKS
        assert (view.recv_offset, view.comb_offsets, view.flags_offsets) == (ws.recv_offset, ws.comb_offsets,
                                                                             ws.flags_offsets)
        assert view.h().data_ptr() == ws.h_buffer.data_ptr() and view.y().data_ptr() == ws.y_buffer.data_ptr()
    # regions never overlap and stay inside the buffer
    spans = sorted([_span(large.flags(0)), _span(large.flags(1)), _span(large.recv()), _span(large.comb(0)),
                    _span(large.comb(1))])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert spans[0][0] >= base and spans[-1][1] <= base + ws.buffer.numel()
    assert all(offset % 256 == 0 for offset in (ws.recv_offset, *ws.comb_offsets, *ws.flags_offsets))


def test_a_paired_layer_sizes_the_receive_region_for_its_pairs():
    """`attach(recv_rows=)` (a layer whose paired calls at EP > 1 receive one row per (token, expert) pair): the
    receive region alone grows to that many rows; the combine regions keep EP * T_max rows of the largest layer and
    follow it, none overlapping; a layer without recv_rows sees EP * T_max rows of the same region."""
    ws = SymmetricWorkspace(None, 0, 1, CPU)
    plain = ws.attach(max_tokens=16, hidden_size=32)
    paired = ws.attach(max_tokens=8, hidden_size=32, recv_rows=8 * 6)
    assert ws.generation == 2 and ws.capacity.rows == WorkspaceBytes.of(1, 16, 32).rows
    assert ws.capacity.recv == 48 * 32 * 2 and ws.buffer.numel() == ws.capacity.symmetric
    assert paired.recv().shape == (48, 32) and paired.recv_rows == 48
    assert plain.recv().shape == (16, 32) and paired.comb(0).shape == (8, 32)
    assert plain.recv().data_ptr() == paired.recv().data_ptr()
    spans = sorted([_span(paired.flags(0)), _span(paired.flags(1)), _span(paired.recv()), _span(plain.comb(0)),
                    _span(plain.comb(1))])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] <= ws.buffer.data_ptr() + ws.buffer.numel()
    assert ws.comb_offsets[0] == ws.recv_offset + ws.capacity.recv
    # the pair rows region: one int32 per receive row of the paired layer, none for the other
    assert paired.pair_rows().shape == (48,) and plain.pair_rows().numel() == 0 and ws.capacity.pair_rows == 256
    assert paired.pair_rows().data_ptr() == ws.buffer.data_ptr() + ws.pair_rows_offset
    assert _span(paired.pair_rows())[1] <= ws.buffer.data_ptr() + ws.recv_offset and ws.pair_rows_offset % 256 == 0
    again = ws.attach(max_tokens=8, hidden_size=32, recv_rows=40)   # fits: no growth
    assert ws.generation == 2 and again.recv().shape == (40, 32)
    with pytest.raises(ValueError, match="recv_rows"):
        ws.attach(max_tokens=8, hidden_size=32, recv_rows=-1)


def test_a_smaller_layer_does_not_grow_the_workspace():
    ws = SymmetricWorkspace(None, 0, 1, CPU)
    ws.attach(64, 128, 32, 100)
    buffer = ws.buffer
    view = ws.attach(16, 64, 16, 10)
    assert ws.generation == 1 and ws.buffer is buffer and view.recv().shape == (16, 64)


def test_growth_keeps_the_call_sequence_and_zeroes_the_new_flags():
    ws = SymmetricWorkspace(None, 0, 2, CPU)
    first = ws.attach(4, 8)
    first.flags(0).fill_(7)
    first.finish_call()
    second = ws.attach(9, 8)
    assert ws.parity == 1 and first.parity == second.parity == 1
    assert not first.flags(0).any() and not first.flags(1).any()
    assert first.flags(0).numel() == 2 * MAX_CHUNKS + 2


def test_shared_returns_one_workspace_per_group_and_device_until_retired():
    a = SymmetricWorkspace.shared(None, 0, 1, CPU)
    assert SymmetricWorkspace.shared(None, 0, 1, CPU) is a
    assert SymmetricWorkspace.shared(None, 0, 1, "cpu") is a
    assert SymmetricWorkspace.shared(None, 1, 2, CPU) is not a
    view = a.attach(4, 8)
    del view
    gc.collect()
    # it outlives its layers: whether a construction allocates (a collective) must not depend on garbage collection
    assert SymmetricWorkspace.shared(None, 0, 1, CPU) is a
    a.retire()
    assert SymmetricWorkspace.shared(None, 0, 1, CPU) is not a
    SymmetricWorkspace.shared(None, 0, 1, CPU).retire()
    SymmetricWorkspace.shared(None, 1, 2, CPU).retire()


class _Group:
    def __init__(self, name):
        self.group_name = name


def test_retire_shared_retires_the_groups_workspaces_only():
    g, other = _Group("g"), _Group("other")
    mine = [SymmetricWorkspace.shared(g, rank, 2, CPU) for rank in (0, 1)]
    theirs = SymmetricWorkspace.shared(other, 0, 2, CPU)
    assert retire_shared(g) == 2
    assert retire_shared(g) == 0
    assert all(SymmetricWorkspace.shared(g, rank, 2, CPU) is not mine[rank] for rank in (0, 1))
    assert SymmetricWorkspace.shared(other, 0, 2, CPU) is theirs
    retire_shared(g), retire_shared(other)


@pytest.mark.parametrize("bad", [dict(max_tokens=-1), dict(hidden_size=2.5), dict(max_pairs=None)])
def test_attach_rejects_bad_sizes(bad):
    ws = SymmetricWorkspace(None, 0, 1, CPU)
    args = dict(max_tokens=4, hidden_size=8, intermediate_size=4, max_pairs=4) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        ws.attach(**args)


def test_memory_per_rank_formula_deepseek_v3():
    """The number the module docstring gives: DeepSeek-V3 at T_max 8192, EP 2."""
    spec, ep, max_tokens = MoESpec.from_name("deepseek-v3"), 2, 8192
    max_pairs = ep * max_tokens * min(spec.top_k, spec.num_experts // ep)
    words = RoutingMessage(max_tokens, spec.top_k).words
    assert words == 131077 == 2 * max_tokens * spec.top_k + 1 + HEADER_WORDS
    size = WorkspaceBytes.of(ep, max_tokens, spec.hidden_size, spec.intermediate_size, max_pairs, words)
    assert size.rows == 224 * MiB and size.flags == 512
    assert size.routing_flags == 256 and size.routing == 2 * MiB + 256
    assert size.symmetric == 674 * MiB + 1024
    assert (size.h, size.y) == (512 * MiB, 1792 * MiB)
    assert size.total == 2978 * MiB + 1024


def test_routing_region_is_sized_by_the_largest_message_and_regrows_collectively():
    ep = 3
    ws = SymmetricWorkspace(None, 1, ep, CPU)
    a = ws.attach(4, 8, routing_words=RoutingMessage(4, 2).words)
    assert a.routing_words == 4 * 2 * 2 + 1 + HEADER_WORDS and ws.routing_slot_words >= a.routing_words
    assert a.routing(0).shape == (ep, ws.routing_slot_words) and a.routing_flags().shape == (ep,)
    assert a.exchange_ctrl is ws.exchange_ctrl and a.exchange_ctrl.shape == (EXCHANGE_CTRL_FIXED + ep,)
    base = ws.buffer.data_ptr()
    assert a.routing_flags().data_ptr() == base + a.routing_flags_offset
    assert [a.routing(p).data_ptr() for p in (0, 1)] == [
        base + a.routing_offset + p * ep * ws.routing_slot_words * 4 for p in (0, 1)]
    spans = sorted([_span(a.flags(0)), _span(a.flags(1)), _span(a.routing_flags()), _span(a.routing(0)),
                    _span(a.routing(1)), _span(a.recv()), _span(a.comb(0)), _span(a.comb(1))])
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:]))
    assert spans[0][0] >= base and spans[-1][1] <= base + ws.buffer.numel() == base + ws.capacity.symmetric
    assert all(o % 256 == 0 for o in (a.routing_offset, a.routing_flags_offset, a.recv_offset))
    # a layer without routing words and a smaller message do not grow it
    ws.attach(4, 8)
    ws.attach(2, 8, routing_words=RoutingMessage(2, 2).words)
    assert ws.generation == 1
    # what the exchange left: flags at some sequence number, the counter at it
    a.routing_flags().fill_(41)
    a.exchange_ctrl[0] = 41
    a.finish_call()
    # a larger message (same rows) re-allocates the symmetric part: generation bump, views re-pointed, and the
    # monotonic flags and the sequence counter restart together; the call parity is kept
    b = ws.attach(4, 8, routing_words=RoutingMessage(4, 7).words)
    assert ws.generation == 2 and a.generation == 2 and ws.parity == 1
    assert ws.routing_slot_words >= b.routing_words > a.routing_words
    assert a.routing_offset == b.routing_offset and a.recv_offset == b.recv_offset
    assert a.routing(1).shape == (ep, ws.routing_slot_words)
    assert not a.routing_flags().any() and not ws.exchange_ctrl.any() and a.exchange_ctrl is ws.exchange_ctrl
    assert a.recv().data_ptr() == ws.buffer.data_ptr() + ws.recv_offset


def test_attach_rejects_bad_routing_words():
    with pytest.raises(ValueError, match="routing_words"):
        SymmetricWorkspace(None, 0, 1, CPU).attach(4, 8, routing_words=-3)


# ---- the flag protocol across layers, emulated -------------------------------------------------------------------
class _Emulation:
    """EP ranks, each with its own workspace (ordinary memory here), running one call sequence over several layers.

    Each rank runs its steps in order: the routing all-gather (a barrier: it completes when every rank reached it),
    the task-table build that zeroes the other parity's flags, then the kernel: add its dispatch counts onto each
    destination's arrival counters, wait for its own arrivals, add combine counts onto each source's combine
    counters, wait for its own. A scheduler interleaves the ranks' steps at random, as the GPUs would. A wait that
    completes with a counter above what this call promised means a count leaked from another call.
    """

    def __init__(self, world_size: int, layers: list[tuple[int, int]], seed: int, parity_of=None):
        self.ep, self.rng = world_size, random.Random(seed)
        workspaces = [SymmetricWorkspace(None, r, world_size, CPU) for r in range(world_size)]
        self.views = [[workspaces[r].attach(t, h) for t, h in layers] for r in range(world_size)]
        for r in range(world_size):  # one workspace per rank, shared by its layers
            assert len({id(v.workspace) for v in self.views[r]}) == 1
        self.layer_calls = [[0] * len(layers) for _ in range(world_size)]
        self.parity_of = parity_of or (lambda rank, layer: self.views[rank][layer].parity)
        self.arrived: dict[int, int] = {}

    def rank_steps(self, rank, schedule):
        for n, (layer, counts, raises) in enumerate(schedule):
            view = self.views[rank][layer]
            self.arrived[n] = self.arrived.get(n, 0) + 1
            yield lambda n=n: self.arrived[n] == self.ep         # the all-gather of call n
            parity = self.parity_of(rank, layer)
            view.flags(1 - parity).zero_()                      # the task tables' graph zeroes the next call's
            if raises:                                          # bad ids: every rank raises before its kernel
                continue
            base = MAX_CHUNKS * self.ep
            for dest in self.rng.sample(range(self.ep), self.ep):
                for chunk in range(MAX_CHUNKS):
                    if counts[rank][dest][chunk]:
                        self.views[dest][layer].flags(parity)[rank * MAX_CHUNKS + chunk] += counts[rank][dest][chunk]
                        yield lambda: True
            own = view.flags(parity)
            expected = torch.tensor([counts[s][rank][c] for s in range(self.ep) for c in range(MAX_CHUNKS)])
            yield lambda: bool((own[:base] >= expected).all())
            assert torch.equal(own[:base], expected), ("arrival counters leaked from another call", n, layer)
            for source in self.rng.sample(range(self.ep), self.ep):
                rows = sum(counts[source][rank])
                if rows:
                    self.views[source][layer].flags(parity)[base + rank] += rows
                    yield lambda: True
            combine_expected = torch.tensor([sum(counts[rank][d]) for d in range(self.ep)])
            yield lambda: bool((own[base:] >= combine_expected).all())
            assert torch.equal(own[base:], combine_expected), ("combine counters leaked from another call", n)
            view.finish_call()
            self.layer_calls[rank][layer] += 1

    def run(self, schedule):
        ranks = {r: self.rank_steps(r, schedule) for r in range(self.ep)}
        waiting = {r: next(ranks[r], None) for r in ranks}
        while any(w is not None for w in waiting.values()):
            ready = [r for r, w in waiting.items() if w is not None and w()]
            assert ready, "deadlock: every rank waits"
            r = self.rng.choice(ready)
            waiting[r] = next(ranks[r], None)


def _schedule(rng: random.Random, world_size: int, num_layers: int, num_calls: int):
    calls = []
    for _ in range(num_calls):
        counts = [[[rng.choice([0, 0, 1, 3, 17]) for _ in range(MAX_CHUNKS)] for _ in range(world_size)]
                  for _ in range(world_size)]
        calls.append((rng.randrange(num_layers), counts, rng.random() < 0.1))
    return calls


@pytest.mark.parametrize("world_size,seed", [(1, 0), (2, 1), (3, 2), (4, 3)])
def test_flag_protocol_holds_across_layers_sharing_flags(world_size, seed):
    layers = [(5, 8), (13, 4), (3, 16)]  # different T_max and H: the second grows every rank's workspace
    emulation = _Emulation(world_size, layers, seed)
    schedule = _schedule(random.Random(seed), world_size, len(layers), 40)
    emulation.run(schedule)
    launched = sum(1 for _, _, raises in schedule if not raises)
    assert all(emulation.views[r][0].workspace.calls == launched for r in range(world_size))


def test_the_emulation_catches_a_per_layer_parity():
    """The protocol before sharing kept the parity per layer; with shared flags that leaks counts between layers,
    and the emulation must see it."""
    layers = [(5, 8), (13, 4)]
    emulation = _Emulation(2, layers, seed=5)
    emulation.parity_of = lambda rank, layer: emulation.layer_calls[rank][layer] % 2
    schedule = _schedule(random.Random(5), 2, 2, 10)
    schedule = [(i % 2, counts, False) for i, (_, counts, _) in enumerate(schedule)]
    with pytest.raises(AssertionError, match="leaked"):
        emulation.run(schedule)


def _ipc_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    workspace = SymmetricWorkspace(dist.group.WORLD, rank, world_size, CPU)
    view = workspace.attach(4, 8, routing_words=RoutingMessage(4, 2).words)
    # every rank writes its tag into every peer's routing flag of this source, through its own mapping of that peer
    for buffer in workspace.peer_buffers:
        buffer[view.routing_flags_offset:].view(torch.int32)[rank] = 100 + rank
    dist.barrier()
    flags = view.routing_flags().tolist()
    # growth: a new allocation, a new round of handles, the old flags gone
    grown = workspace.attach(16, 8, routing_words=RoutingMessage(16, 2).words)
    rounds = dict(_IPC_ROUNDS)
    # a workspace built after the old one is retired (as after a timeout) while the old buffers still exist: rank 0
    # publishes late, so a peer that looked its handle up under a reused key would map rank 0's OLD buffer
    workspace.retire()
    if rank == 0:
        time.sleep(1.0)
    fresh = SymmetricWorkspace(dist.group.WORLD, rank, world_size, CPU)
    fresh_view = fresh.attach(4, 8, routing_words=RoutingMessage(4, 2).words)
    for buffer in fresh.peer_buffers:
        buffer[fresh_view.routing_flags_offset:].view(torch.int32)[rank] = 200 + rank
    dist.barrier()
    return dict(flags=flags, rounds=rounds, grown_flags=grown.routing_flags().tolist(),
                peers=len(workspace.peer_buffers), generation=grown.generation,
                bases=[int(base) for base in grown.peer_bases.tolist()],
                mappings=[buffer.data_ptr() for buffer in workspace.peer_buffers],
                fresh_flags=fresh_view.routing_flags().tolist(), old_flags=grown.routing_flags().tolist())


def test_ipc_transport_maps_every_peers_buffer(monkeypatch):
    """WEAVE_MOE_TRANSPORT=ipc (ranks sharing one GPU; here two gloo processes on the CPU): each rank opens every
    peer's buffer through the handles in the store, and a store through that mapping lands in the peer's memory."""
    from weave_moe.testing import run_distributed

    results = run_distributed(_ipc_worker, 2, backend="gloo", timeout_s=120, shared_device=True)
    for rank, result in enumerate(results):
        assert result["flags"] == [100, 101], (rank, result)
        assert list(result["rounds"].values()) == [2] and result["peers"] == 2, (rank, result)
        assert result["generation"] == 2 and result["grown_flags"] == [0, 0], (rank, result)
        assert result["bases"] == result["mappings"], (rank, result)   # the kernels' table: this process's mappings
        # after a retire, every rank's stores land in the peers' NEW buffers, none in the retired ones
        assert result["fresh_flags"] == [200, 201] and result["old_flags"] == [0, 0], (rank, result)


def test_transport_setting_is_checked(monkeypatch):
    from weave_moe.backends.weave.workspace import transport_from_env

    monkeypatch.setenv("WEAVE_MOE_TRANSPORT", "nvlink")
    with pytest.raises(ValueError, match="WEAVE_MOE_TRANSPORT"):
        transport_from_env()
    monkeypatch.delenv("WEAVE_MOE_TRANSPORT")
    assert transport_from_env() == "symm"
