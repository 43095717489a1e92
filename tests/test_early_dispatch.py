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
                                      flags_offsets=(0, 256), flags=lambda parity: flags)
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
        args = launcher._arguments(ids, tokens, torch.zeros(num_experts, **i32), io, workspace, status, 1, 10 ** 9,
                                   torch.zeros(num_experts // world_size + 1, **i32))
    return sm90.compile_for_sm90(kernel, args, dict(launcher.constants, **extra, num_warps=ed.NUM_WARPS))


@pytest.mark.parametrize("kind", ["early", "tables", "pairs"])
@pytest.mark.parametrize("world_size, num_experts, top_k, hidden", [(2, 128, 8, 2048), (2, 256, 8, 7168),
                                                                    (8, 64, 6, 4096)])
def test_dispatch_beside_the_tables_compiles_for_sm90_with_vector_rows_and_its_ordering(kind, world_size,
                                                                                      num_experts, top_k, hidden):
    """Each dispatch beside the tables, as launched: no local memory; the rows in 16-byte vectors (x and the peers'
    receive rows declared aligned, peers.py); rows released onto their flags at system scope, the owed rows acquired
    at system scope (sync.py's protocol)."""
    ptx = _compiled(kind, world_size, num_experts, top_k, hidden).asm["ptx"]
    assert ".local" not in ptx
    assert re.search(r"ld\.global(\.[a-z]+)*\.v4", ptx) and re.search(r"st\.global(\.[a-z]+)*\.v4", ptx)
    assert not re.search(r"(ld|st)\.global\.b16", ptx), "a row copied one element per access"
    assert re.search(r"atom\.global\.sys\.release\.add", ptx)
    assert re.search(r"atom\.global\.sys\.acquire\.add", ptx)


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


def test_pair_dispatch_refuses_what_the_tables_would_not_match():
    from weave_moe.backends.weave.kernels.early_dispatch import PairDispatch

    with pytest.raises(ValueError, match="local experts"):
        PairDispatch(2, 8, 6, 32, 64, 4, 4)
    with pytest.raises(ValueError, match="max_call_tokens"):
        PairDispatch(2, 16, 4, 32, 16, 8, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        PairDispatch(2, 16, 4, 36, 64, 4, 4)
