"""The dispatches beside the task tables (kernels/early_dispatch.py) compiled for sm_90 as launched, and what their
launch classes refuse. Their rows and counters are checked under the interpreter across processes in
tests/test_megakernel_cpu.py (test_resident_call_sequence_across_processes, the dying-peer and pair-dispatch tests)."""

import re
import types

import pytest
import torch


def _compiled(kind: str, world_size: int, num_experts: int, top_k: int, hidden: int):
    """The kernel of `kind` (early: after the counts, tables: beside the emit, pairs: the pair rows) compiled for
    sm_90 with the arguments its launch class passes (`_arguments`), as the backend would launch it."""
    from weave_moe.backends.weave.config import DECODE_TOKENS
    from weave_moe.backends.weave.kernels import early_dispatch as ed
    from weave_moe.backends.weave.kernels import sm90
    from weave_moe.backends.weave.kernels.tables import TableBuffers

    max_tokens = 2048
    i32 = dict(dtype=torch.int32)
    flags = torch.zeros(64, **i32)
    workspace = types.SimpleNamespace(peer_bases=torch.zeros(world_size, dtype=torch.int64), recv_offset=1 << 20,
                                      flags_offsets=(0, 256), flags=lambda parity: flags,
                                      recv_rows=world_size * max_tokens * top_k, pair_rows_offset=1 << 19,
                                      pair_slots=world_size * max_tokens * top_k)
    ids, tokens = torch.zeros(world_size, max_tokens, top_k, **i32), torch.zeros(world_size, **i32)
    chunks, status = torch.zeros(world_size, 4, **i32)[:, 1], torch.zeros(4, **i32)
    io = torch.zeros(2, dtype=torch.int64)
    extra = {}
    if kind == "early":
        launcher, kernel = ed.EarlyDispatch(world_size, num_experts, top_k, hidden, max_tokens, DECODE_TOKENS, 132), \
            ed.early_dispatch_kernel
        args = launcher._arguments(ids, tokens, chunks, io, workspace, status, 1, 10 ** 9)
    elif kind == "tables":
        launcher, kernel = ed.TablesDispatch(world_size, hidden, max_tokens, 132), ed.tables_dispatch_kernel
        tables = TableBuffers.for_layer(world_size, max_tokens, top_k, num_experts, hidden_size=hidden,
                                        intermediate_size=1024, block_m=64, block_n0=128, block_n1=128,
                                        dispatch_rows=16, combine_rows=16, device="cpu")
        args = launcher._arguments(tables, tokens, chunks, io, workspace, status, 1, 10 ** 9)
        extra = dict(BT=tables.shapes.BT)
    else:
        launcher, kernel = ed.PairDispatch(world_size, num_experts, top_k, hidden, max_tokens, DECODE_TOKENS, 132), \
            ed.pair_dispatch_kernel
        # at EP = 1 into local rows (the backend's y), as the backend launches it; else into the peers' regions
        local = torch.zeros(DECODE_TOKENS * top_k, hidden, dtype=torch.bfloat16) if world_size == 1 else None
        # at EP = 1 without the offsets, as the backend launches it (the tile tables come from the counts)
        offsets = None if world_size == 1 else torch.zeros(num_experts // world_size + 1, **i32)
        args = launcher._arguments(ids, tokens, torch.zeros(num_experts, **i32), io, workspace, status,
                                   min(1, world_size - 1), 10 ** 9, offsets, torch.zeros(launcher.rows_shape, **i32),
                                   local)
        extra = launcher._variant(local, offsets)
    return sm90.compile_for_sm90(kernel, args, dict(launcher.constants, **extra, num_warps=ed.NUM_WARPS))


@pytest.mark.parametrize("kind", ["early", "tables", "pairs"])
@pytest.mark.parametrize("world_size, num_experts, top_k, hidden", [(2, 128, 8, 2048), (2, 256, 8, 7168),
                                                                    (8, 64, 6, 4096), (1, 64, 8, 2048),
                                                                    (1, 128, 8, 7168)])
def test_dispatch_beside_the_tables_compiles_for_sm90_with_vector_rows_and_its_ordering(kind, world_size,
                                                                                      num_experts, top_k, hidden):
    """Each dispatch beside the tables, as launched: no local memory; the rows in 16-byte vectors (x and the peers'
    receive rows declared aligned, peers.py); rows released onto their flags at system scope, the owed rows acquired
    at system scope (sync.py's protocol); except the pair dispatch at EP = 1, which writes local rows that only later
    launches read, and so neither releases nor waits."""
    ptx = _compiled(kind, world_size, num_experts, top_k, hidden).asm["ptx"]
    assert ".local" not in ptx
    assert re.search(r"ld\.global(\.[a-z]+)*\.v4", ptx) and re.search(r"st\.global(\.[a-z]+)*\.v4", ptx)
    assert not re.search(r"(ld|st)\.global\.b16", ptx), "a row copied one element per access"
    flags = kind != "pairs" or world_size > 1
    assert bool(re.search(r"atom\.global\.sys\.release\.add", ptx)) is flags
    assert bool(re.search(r"atom\.global\.sys\.acquire\.add", ptx)) is flags


def test_early_dispatch_refuses_what_it_cannot_send():
    from weave_moe.backends.weave.kernels.early_dispatch import EarlyDispatch

    with pytest.raises(ValueError, match="hidden_size must be a multiple of 8"):
        EarlyDispatch(2, 8, 2, 36, 16, 4, 4)
    with pytest.raises(ValueError, match="max_call_tokens"):
        EarlyDispatch(2, 8, 2, 32, 16, 17, 4)
    early = EarlyDispatch(2, 8, 2, 32, 16, 4, 4)
    with pytest.raises(ValueError, match="all_ids"):
        early._arguments(torch.zeros(2, 15, 2, dtype=torch.int32), None, None, None, None, None, 0, 1)
    with pytest.raises(ValueError, match="chunks"):
        early._arguments(torch.zeros(2, 16, 2, dtype=torch.int32), None, torch.zeros(2, dtype=torch.int32), None,
                         None, None, 0, 1)


def test_tables_dispatch_refuses_what_it_cannot_send():
    from weave_moe.backends.weave.kernels.early_dispatch import TablesDispatch
    from weave_moe.backends.weave.kernels.tables import TableBuffers

    with pytest.raises(ValueError, match="hidden_size must be a multiple of 8"):
        TablesDispatch(2, 36, 16, 4)
    with pytest.raises(ValueError, match="rows must be a power of two"):
        TablesDispatch(2, 32, 16, 4, rows=3)
    tables = TableBuffers.for_layer(2, 12, 2, 8, hidden_size=32, intermediate_size=16, block_m=16, block_n0=16,
                                    block_n1=16, dispatch_rows=4, combine_rows=4, device="cpu")
    with pytest.raises(ValueError, match="T_max 12"):
        TablesDispatch(2, 32, 16, 4)._arguments(tables, None, None, None, None, None, 0, 1)
    with pytest.raises(ValueError, match="chunks"):
        TablesDispatch(2, 32, 12, 4)._arguments(tables, torch.zeros(2, dtype=torch.int32),
                                                torch.zeros(2, dtype=torch.int32), None, None, None, 0, 1)


@pytest.mark.parametrize("call_tokens", [64, 512])
@pytest.mark.parametrize("num_experts, top_k, hidden", [(64, 8, 2048), (128, 8, 7168)])
def test_the_programmatic_pair_dispatch_waits_then_releases_before_any_load(num_experts, top_k, hidden,
                                                                            call_tokens):
    """KernelConfig.chain_pairs: the pair dispatch launched programmatically waits for the counts launch and then
    lets the next launch (a preloading GEMM0) start, before its first global load; the plain one holds neither.
    Both without local memory, for a decode layer's calls (64 tokens: one pair per step on 132 SMs) and for a long
    paired call's size class (512: four pairs per step, the rows counted by a histogram)."""
    from weave_moe.backends.weave.kernels import early_dispatch as ed
    from weave_moe.backends.weave.kernels import sm90
    from weave_moe.backends.weave.workspace import SymmetricWorkspace

    i32 = dict(dtype=torch.int32)
    launcher = ed.PairDispatch(1, num_experts, top_k, hidden, 2048, call_tokens, 132)
    assert launcher.pipe == (1 if call_tokens == 64 else ed.PIPE_PAIRS)
    workspace = SymmetricWorkspace(None, 0, 1, torch.device("cpu")).attach(2048, hidden)
    local = torch.zeros(call_tokens * top_k, hidden, dtype=torch.bfloat16)
    args = launcher._arguments(torch.zeros(1, 2048, top_k, **i32), torch.zeros(1, **i32),
                               torch.zeros(num_experts, **i32), torch.zeros(2, dtype=torch.int64), workspace,
                               torch.zeros(4, **i32), 0, 10 ** 9, None, torch.zeros(launcher.rows_shape, **i32), local)
    for pdl in (False, True):
        variant = launcher._variant(local, None, pdl)
        assert variant.get("launch_pdl", False) is (pdl and sync_pdl())
        variant.pop("launch_pdl", None)
        ptx = sm90.compile_for_sm90(ed.pair_dispatch_kernel, args, dict(variant, num_warps=ed.NUM_WARPS)).asm["ptx"]
        assert ".local" not in ptx
        if not pdl:
            assert "griddepcontrol" not in ptx
            continue
        wait, release = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
        assert wait < release < ptx.index("ld.global"), "the release must follow the wait, both before any load"


def sync_pdl() -> bool:
    from weave_moe.backends.weave.kernels import sync

    return sync.PDL


@pytest.mark.parametrize("world_size, num_experts, top_k, hidden, call_tokens",
                         [(2, 128, 8, 2048, 512), (2, 256, 8, 7168, 128), (8, 64, 6, 4096, 256)])
def test_pair_dispatch_into_peers_four_pairs_per_step_compiles_for_sm90(world_size, num_experts, top_k, hidden,
                                                                        call_tokens):
    """KernelConfig.pair_peers' long calls: the pair dispatch at EP > 1 walking four pairs per step (`_peer_pairs`),
    as launched: no local memory, rows in 16-byte vectors, its counts released at system scope and the owed rows
    acquired at system scope."""
    from weave_moe.backends.weave.kernels import early_dispatch as ed
    from weave_moe.backends.weave.kernels import sm90

    i32, slots = dict(dtype=torch.int32), world_size * call_tokens * top_k
    workspace = types.SimpleNamespace(peer_bases=torch.zeros(world_size, dtype=torch.int64), flags_offsets=(0, 256),
                                      recv_offset=1 << 20, flags=lambda parity: torch.zeros(64, **i32),
                                      recv_rows=slots, pair_rows_offset=1 << 19, pair_slots=slots)
    launcher = ed.PairDispatch(world_size, num_experts, top_k, hidden, call_tokens, call_tokens, 132, recv_rows=slots)
    assert launcher.pipe == ed.PIPE_PAIRS
    args = launcher._arguments(torch.zeros(world_size, call_tokens, top_k, **i32), torch.zeros(world_size, **i32),
                               torch.zeros(num_experts, **i32), torch.zeros(2, dtype=torch.int64), workspace,
                               torch.zeros(4, **i32), 1, 10 ** 9, None, torch.zeros(launcher.rows_shape, **i32), None)
    variant = dict(launcher._variant(None, None), num_warps=ed.NUM_WARPS)
    assert variant["PIPE"] == ed.PIPE_PAIRS and not variant["LOCAL"]
    ptx = sm90.compile_for_sm90(ed.pair_dispatch_kernel, args, variant).asm["ptx"]
    assert ".local" not in ptx
    assert re.search(r"ld\.global(\.[a-z]+)*\.v4", ptx) and re.search(r"st\.global(\.[a-z]+)*\.v4", ptx)
    assert re.search(r"atom\.global\.sys\.release\.add", ptx) and re.search(r"atom\.global\.sys\.acquire", ptx)


def test_pair_dispatch_refuses_what_the_tables_would_not_match():
    from weave_moe.backends.weave.kernels.early_dispatch import PairDispatch

    with pytest.raises(ValueError, match="local experts"):
        PairDispatch(2, 8, 6, 32, 64, 4, 4)
    # at EP > 1 every source's pairs of its longest call must fit each destination's receive region
    with pytest.raises(ValueError, match="2 ranks .64 rows. do not fit the receive region .32 rows"):
        PairDispatch(2, 16, 4, 32, 16, 8, 4)
    assert PairDispatch(2, 16, 4, 32, 16, 8, 4, recv_rows=64).recv_rows == 64   # a region sized for pairs
    with pytest.raises(ValueError, match="do not fit the receive region .63 rows"):
        PairDispatch(2, 16, 4, 32, 16, 8, 4, recv_rows=63)
    with pytest.raises(ValueError, match="multiple of 8"):
        PairDispatch(2, 16, 4, 36, 64, 4, 4)
    with pytest.raises(ValueError, match="max_tokens = 16"):
        PairDispatch(1, 16, 4, 32, 16, 17, 4)
    # at EP = 1 the pairs of more than T_max / k tokens go to local rows (the GEMMs' y), which must hold them all
    alone = PairDispatch(1, 16, 4, 32, 16, 8, 4)
    i32 = dict(dtype=torch.int32)
    args = (torch.zeros(1, 16, 4, **i32), torch.zeros(1, **i32), torch.zeros(16, **i32), None,
            types.SimpleNamespace(peer_bases=None, recv_offset=0, pair_rows_offset=0, flags_offsets=(0, 0),
                                  flags=lambda parity: None, recv_rows=16, pair_slots=64),
            None, 0, 1, torch.zeros(17, **i32), torch.zeros(alone.rows_shape, **i32))
    with pytest.raises(ValueError, match="do not fit the receive region"):
        alone._arguments(*args, None)
    with pytest.raises(ValueError, match="local rows"):
        alone._arguments(*args, torch.zeros(31, 32, dtype=torch.bfloat16))
    local = torch.zeros(32, 32, dtype=torch.bfloat16)
    alone._arguments(*args, local)
    with pytest.raises(ValueError, match="pairs must be"):   # the rows' places come from the counts' pairs
        alone._arguments(*args[:2], None, *args[3:], local)


def test_pair_dispatch_spreads_only_a_pipelined_walk_over_more_programs():
    """KernelConfig.pair_programs (`spread`): a pair dispatch of four pairs per step into local rows (EP = 1) on
    `spread` times the SMs' programs, no more than the longest call's steps; one of one pair per step keeps one
    program per SM, and its walk is not turned into the pipelined one by the spread; an EP > 1 dispatch (into the
    peers' receive regions) walks four pairs per step too, on one program per SM at most. The backend spreads the
    long size class only (test_weave_host.py)."""
    from weave_moe.backends.weave.kernels.early_dispatch import PIPE_PAIRS, PairDispatch

    long = PairDispatch(1, 128, 8, 2048, 2048, 512, 132, spread=4)   # Qwen3-30B-A3B at EP = 2, 4096 pairs
    assert (long.pipe, long.num_programs) == (PIPE_PAIRS, 528)
    assert PairDispatch(1, 128, 8, 2048, 2048, 512, 132).num_programs == 132
    shorter = PairDispatch(1, 128, 8, 2048, 2048, 128, 132, spread=4)   # 1024 pairs: 256 steps of four
    assert (shorter.pipe, shorter.num_programs) == (PIPE_PAIRS, 256)
    decode = PairDispatch(1, 128, 8, 2048, 2048, 64, 132, spread=4)
    assert (decode.pipe, decode.num_programs) == (1, 132)
    peers = PairDispatch(2, 128, 8, 2048, 512, 512, 132, spread=4, recv_rows=2 * 512 * 8)
    assert (peers.pipe, peers.num_programs) == (PIPE_PAIRS, 132)
    with pytest.raises(ValueError, match="spread"):
        PairDispatch(1, 128, 8, 2048, 2048, 512, 132, spread=0)


@pytest.mark.parametrize("top_k, hidden", [(8, 2048), (8, 7168), (6, 4096)])
def test_pair_combine_compiles_for_sm90_with_vector_rows(top_k, hidden):
    """The paired call's combine as launched: no local memory, y read and out written in 16-byte vectors (out's
    address from `io`, declared aligned); compiled with the status words' copy to the host (program 0's), as the
    backend launches it in either chain (the copy's values: `_paired_call`'s interpreter runs).
    KernelConfig.chain_pairs: launched programmatically, its wait before any load."""
    from weave_moe.backends.weave.config import DECODE_TOKENS
    from weave_moe.backends.weave.kernels import pair_combine, sm90

    combine = pair_combine.PairCombine(hidden, top_k, DECODE_TOKENS, 132)
    i32 = dict(dtype=torch.int32)
    report = (torch.zeros(8, **i32), torch.zeros(8, **i32))
    for chain in (False, True):
        args = combine._arguments(torch.zeros(64, hidden, dtype=torch.bfloat16),
                                  torch.zeros(DECODE_TOKENS, top_k, **i32), torch.zeros(1, 2048, top_k),
                                  torch.zeros(1, **i32), torch.zeros(2, dtype=torch.int64), torch.zeros(4, **i32), 0,
                                  report)
        variant = combine._variant(chain, report)
        variant.pop("launch_pdl", None)
        ptx = sm90.compile_for_sm90(pair_combine.pair_combine_kernel, args,
                                    dict(variant, num_warps=pair_combine.NUM_WARPS)).asm["ptx"]
        assert ".local" not in ptx
        assert re.search(r"ld\.global(\.[a-z]+)*\.v4", ptx) and re.search(r"st\.global(\.[a-z]+)*\.v4", ptx)
        assert not re.search(r"(ld|st)\.global\.b16", ptx), "a row accessed one element per access"
        assert ("griddepcontrol.wait" in ptx) is chain
        if chain:
            assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    with pytest.raises(ValueError, match="report"):
        combine._arguments(*args[:7], (torch.zeros(6, **i32), torch.zeros(6, **i32)))


def _paired_call(T, E, k, H, max_tokens, ids, weights, x, refuse=False, chain=False, pipe=None, combine_tokens=None):
    """One paired call at EP = 1 under the interpreter, as `WeaveBackend._resident_paired` makes it minus the GEMMs:
    pack, counts (verdict), `PairDispatch`, then y made from the pair rows by a stand-in for the experts (row p of
    expert e: bf16(recv[p] * (e + 1) / 8), e read off the offsets the dispatch wrote), then `PairCombine` into a
    poisoned out of T + 1 rows. `chain` (KernelConfig.chain_pairs): the counts launch also writes a tile table of 4
    rows per tile (checked against build_tile_table_torch on the offsets), the pair dispatch compiled for
    programmatic launch. `pipe`: the pair dispatch's pairs per step (PIPE; None: the launcher's, 4 here: 24 pairs of
    the longest call on 5 programs). `combine_tokens`: the T the combine's grid is sized for (`PairCombine.grid`;
    None: the call's, as the backend launches it; 1: one program, which then takes every token's item in turn).
    Returns (out, rows table, offsets, receive region, status)."""
    from weave_moe.backends.coordination import HEADER_WORDS
    from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage
    from weave_moe.backends.weave.kernels import sync
    from weave_moe.backends.weave.kernels.counts import DeviceCounts
    from weave_moe.backends.weave.kernels.early_dispatch import PairDispatch
    from weave_moe.backends.weave.kernels.pair_combine import PairCombine
    from weave_moe.backends.weave.workspace import SymmetricWorkspace

    message = RoutingMessage(max_tokens, k)
    fmt = CountsFormat(1, E, sync.STATUS_WORDS)
    counts = DeviceCounts(fmt, message, torch.device("cpu"))
    ws = SymmetricWorkspace(None, 0, 1, torch.device("cpu")).attach(max_tokens, H, routing_words=message.words)
    all_routing = torch.zeros(1, message.words, dtype=torch.int32)
    status = torch.zeros(2 * sync.STATUS_WORDS, dtype=torch.int32)
    header = torch.tensor([77, 0, 0, 0], dtype=torch.int32)[:HEADER_WORDS]
    io, ctrl = torch.zeros(2, dtype=torch.int64), torch.zeros(64, dtype=torch.int32)
    out = torch.full((T + 1, H), -3.0, dtype=torch.bfloat16)
    ws.recv().fill_(float("nan"))
    message.pack_call(all_routing[0], ids, weights, header, io, x, out, 0, status, ctrl, ws.flags(0), E)
    if refuse:
        status[0] = sync.ERROR_ARRIVAL_TIMEOUT.value   # any error: the call is refused
    all_ids, all_weights, tokens = message.unpack(all_routing)
    dispatch = PairDispatch(1, E, k, H, max_tokens, max_call_tokens=8, num_programs=5)
    assert dispatch.pipe == 4
    if pipe is not None:
        dispatch.pipe = pipe
    rows = torch.full(dispatch.rows_shape, -9, dtype=torch.int32)
    offsets = torch.full((E + 1,), -7, dtype=torch.int32)
    # the pair rows into the GEMMs' y ([max_pairs, H]), as the backend writes them: 8 tokens x k pairs do not fit
    # the receive region's T_max rows
    recv = torch.full((max_tokens * k, H), float("nan"), dtype=torch.bfloat16)
    from weave_moe.backends.weave.kernels.grouped_tiles import TileTable, build_tile_table_torch

    table = TileTable(torch.full((3, 2 * (max_tokens * k // 4 + E)), -5, dtype=torch.int32),
                      torch.full((2,), -5, dtype=torch.int32), 4)
    vector = counts.build(all_routing, status[:sync.STATUS_WORDS], 0, verdict=True, tiles=[table] if chain else None)
    dispatch.launch(all_ids, tokens, vector[fmt.expert_pairs_offset:fmt.expert_pairs_offset + E], io, ws,
                    status[:sync.STATUS_WORDS], 0, 10 ** 9, offsets, rows, recv, pdl=chain)
    if chain:   # the GEMMs' tiles of the rows the dispatch placed (refused: from the counts' pairs all the same)
        pairs = vector[fmt.expert_pairs_offset:fmt.expert_pairs_offset + E]
        want = build_tile_table_torch(torch.cat([torch.zeros(1, dtype=torch.int32), pairs.cumsum(0).int()]), 4,
                                      max_tokens * k)
        assert torch.equal(table.num_tiles, want.num_tiles), (table.num_tiles, want.num_tiles)
        n = int(want.num_tiles[0])
        assert torch.equal(table.table[:, :n], want.table[:, :n]), (T, table.table[:, :n], want.table[:, :n])
    assert ws.recv().isnan().all()
    y = torch.full((max_tokens * k, H), float("nan"), dtype=torch.bfloat16)
    for e in range(E):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        y[lo:hi] = (recv[lo:hi].float() * (e + 1) / 8).bfloat16()
    host = torch.full_like(status, -9)   # the status words' host copy, which the combine writes (either chain)
    PairCombine(H, k, 8, 3).launch(y, rows, all_weights, tokens, io, status[:sync.STATUS_WORDS], 0, pdl=chain,
                                   report=(status, host), call_tokens=T if combine_tokens is None else combine_tokens)
    assert torch.equal(host, status), (host, status)
    return out, rows, offsets, recv, status


def test_pair_combine_after_the_pair_dispatch_at_ep1(monkeypatch):
    """KernelConfig.pair_dispatch's call at EP = 1 under the interpreter, the GEMMs replaced by a per-expert stand-in:
    each token's out row is the sum over its top-k slots, in slot order in fp32, of weight * (its expert's row),
    rounded once to bf16, as the megakernel's combine + reduce computes it at EP = 1 (bitwise); slots with no expert
    add nothing and a token naming one expert twice counts it twice; the rows table names, for each (token, slot),
    a receive row that holds the token's x; out's rows past T are not written. A refused call writes NaN rows and
    sends nothing."""
    from weave_moe.testing import run_distributed

    monkeypatch.setenv("TRITON_INTERPRET", "1")   # inherited by the spawned process, before it imports triton
    assert run_distributed(_pair_combine_worker, 1, backend="gloo", timeout_s=600, env=dict(TRITON_INTERPRET="1"),
                           shared_device=True) == ["checked"]


def _pair_combine_worker(rank: int, world_size: int) -> str:
    """The process of test_pair_combine_after_the_pair_dispatch_at_ep1 (under the interpreter)."""
    E, k, H, max_tokens = 8, 3, 40, 12   # calls of up to 8 tokens: 24 pairs, more than T_max
    generator = torch.Generator().manual_seed(5)
    # pipe: the pair dispatch's walk one pair per step (the decode calls'), two, and four (the launcher's here: each
    # of 5 programs has at least 4 of the longest call's 24 pairs); a step may hold pairs past the call's
    # combine_tokens: the combine's grid, one program per token (the backend's: H is one column block here) or one
    # program for the whole call (each item in turn)
    cases = [(T, chain, 4, None) for T, chain in ((0, False), (1, False), (2, False), (5, False), (8, False),
                                                  (0, True), (1, True), (5, True), (8, True))]
    cases += [(T, False, pipe, None) for pipe in (1, 2) for T in (1, 5, 7, 8)]
    cases += [(T, chain, 4, 1) for T, chain in ((5, False), (8, True))]
    for T, chain, pipe, combine_tokens in cases:
        ids = torch.stack([torch.randperm(E, generator=generator)[:k] for _ in range(T)]).int() if T else \
            torch.zeros(0, k, dtype=torch.int32)
        if T >= 2:
            ids[0, 1] = ids[0, 0]    # one expert twice
            ids[1, 2] = -1           # a slot with no expert
        weights = torch.rand(T, k, generator=generator)
        x = torch.randn(T, H, generator=generator).bfloat16()
        out, rows, offsets, recv, status = _paired_call(T, E, k, H, max_tokens, ids, weights, x, chain=chain,
                                                        pipe=pipe, combine_tokens=combine_tokens)
        assert status[:4].tolist() == [0, 0, 0, 0]
        assert offsets.tolist() == [0] + torch.bincount(ids[ids >= 0].long(), minlength=E).cumsum(0).tolist()
        for t in range(T):
            acc = torch.zeros(H)
            for j in range(k):
                e, row = int(ids[t, j]), int(rows[t, j])
                if e < 0:
                    assert row == -1, (T, t, j, row)
                    continue
                assert offsets[e] <= row < offsets[e + 1], (T, t, j, row)
                assert torch.equal(recv[row].view(torch.int16), x[t].view(torch.int16)), (T, t, j)
                acc += weights[t, j] * (x[t].float() * (e + 1) / 8).bfloat16().float()
            # the interpreter converts fp32 to bf16 by truncation (the GPU rounds to nearest), in this kernel as in
            # the megakernel's combine
            truncated = (acc.view(torch.int32) & -65536).view(torch.float32).bfloat16()
            assert torch.equal(out[t].view(torch.int16), truncated.view(torch.int16)), (T, t)
        assert len({int(r) for r in rows[:T].flatten() if r >= 0}) == int((ids >= 0).sum())   # one row per pair
        assert (out[T] == -3.0).all()
    out, rows, offsets, recv, status = _paired_call(2, E, k, H, max_tokens, ids[:2], weights[:2], x[:2], refuse=True)
    assert out[:2].isnan().all() and (out[2] == -3.0).all() and recv.isnan().all()
    assert offsets.tolist() == [0] * (E + 1) and (rows == -9).all()
    # a bad id: the counts refuse the call, the dispatch sends nothing and out is NaN
    bad = ids[:2].clone()
    bad[0, 0] = E
    out, rows, offsets, recv, status = _paired_call(2, E, k, H, max_tokens, bad, weights[:2], x[:2])
    assert status[0] != 0 and out[:2].isnan().all() and (out[2] == -3.0).all() and recv.isnan().all(), status[:4]
    return "checked"


@pytest.mark.parametrize("world_size, num_experts, top_k, hidden, call_tokens",
                         [(2, 128, 8, 2048, 64), (2, 256, 8, 7168, 64), (8, 64, 6, 4096, 64), (2, 128, 8, 2048, 512),
                          (2, 256, 8, 7168, 512)])
def test_peer_pair_combine_compiles_for_sm90(world_size, num_experts, top_k, hidden, call_tokens):
    """The paired call's combine at EP > 1 (`PeerPairCombine`, docs/perf-notes.md entry 41) as launched: no local
    memory in either launch; rows in 16-byte vectors (y read, the peers' combine rows written; the combine rows read,
    out written); each row released at system scope, the owed rows acquired at system scope. For decode calls and
    for a layer of KernelConfig.pair_peers' largest calls (512 tokens: the ids tile of 4096 slots per source)."""
    from weave_moe.backends.weave.kernels import pair_combine, sm90

    combine = pair_combine.PeerPairCombine(world_size, num_experts, top_k, hidden, 2048, call_tokens, 132)
    i32 = dict(dtype=torch.int32)
    rows = world_size * 2048
    workspace = types.SimpleNamespace(peer_bases=torch.zeros(world_size, dtype=torch.int64), comb_offsets=(0, 0),
                                      flags_offsets=(0, 0), comb=lambda parity: torch.zeros(rows, hidden,
                                                                                            dtype=torch.bfloat16),
                                      comb_flags=lambda parity: torch.zeros(world_size, **i32),
                                      pair_rows=lambda: torch.zeros(rows * top_k, **i32), pair_slots=rows * top_k)
    ids, tokens = torch.zeros(world_size, 2048, top_k, **i32), torch.zeros(world_size, **i32)
    weights, status = torch.zeros(world_size, 2048, top_k), torch.zeros(4, **i32)
    send = combine.send_arguments(ids, weights, tokens, torch.zeros(rows * top_k, hidden, dtype=torch.bfloat16),
                                  workspace, status, 1)
    reduce = combine.reduce_arguments(ids, tokens, torch.zeros(2, dtype=torch.int64), workspace, status, 1, 10 ** 9)
    for kernel, (args, options), scope in ((pair_combine.pair_combine_send_kernel, send, "release"),
                                          (pair_combine.pair_reduce_kernel, reduce, "acquire")):
        ptx = sm90.compile_for_sm90(kernel, args, options).asm["ptx"]
        assert ".local" not in ptx, kernel
        assert re.search(r"ld\.global(\.[a-z]+)*\.v4", ptx) and re.search(r"st\.global(\.[a-z]+)*\.v4", ptx), kernel
        assert not re.search(r"(ld|st)\.global\.b16", ptx), kernel
        assert re.search(rf"atom\.global\.sys\.{scope}", ptx), kernel
