"""The counts kernel (kernels/counts.py) against `CountsFormat.build` and `CountsFormat.verdict`, bit for bit, under
the interpreter; and its sm_90 PTX.

Every case compares the counts vector, the messages after the in-place replacement of bad ids, and the status word,
for the verdict of every rank and for the host-driven mode (no verdict: the status word untouched). Cases: EP 1-4;
uniform, skewed (every id on one expert) and -1-holed routing; empty ranks (T = 0) and T_max = 1; top-k 1, 3, 8, 16;
ids below -1 and at or above E; a failed rank's header, a rank at another call or layer; a status word that already
holds an error; more blocks than programs (a program sums several blocks) and a single program; launches back to back
on one scratch (each launch leaves it zero for the next).
"""

import re
from pathlib import Path

import pytest

from interpreter import run_interpreted

HELPERS = r'''
import torch
from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage
from weave_moe.backends.weave.kernels.counts import DeviceCounts
from weave_moe.backends.weave.kernels import sync

HEADER = [7, 1, 5, 0]


def gathered(ep, E, k, T_max, tokens, mode, generator, headers=None, bad=0):
    message = RoutingMessage(T_max, k)
    rows = []
    for r, n in enumerate(tokens):
        if mode == "uniform":
            ids = torch.stack([torch.randperm(E, generator=generator)[:k] for _ in range(n)]).int() if n else \
                torch.zeros(0, k, dtype=torch.int32)
        elif mode == "holes":  # -1 holes and repeated experts
            ids = torch.randint(-1, E, (n, k), generator=generator, dtype=torch.int32)
        else:  # skewed: every id on the last expert
            ids = torch.full((n, k), E - 1, dtype=torch.int32)
        if bad and n:  # ids below -1 and at or above E at random places
            flat = ids.view(-1)
            where = torch.randperm(flat.numel(), generator=generator)[:bad]
            flat[where] = torch.tensor([-2, E, E + 100, -(2 ** 31), 2 ** 31 - 1] * bad, dtype=torch.int32)[:bad]
        out = torch.empty(message.words, dtype=torch.int32)
        header = torch.tensor(HEADER if headers is None else headers[r], dtype=torch.int32)
        message.pack(out, ids, torch.rand(n, k, generator=generator), message.pad(),
                     torch.arange(T_max + 1, dtype=torch.int32), header)
        rows.append(out)
    return message, torch.stack(rows)


def check(ep, E, k, T_max, tokens, mode="uniform", seed=0, headers=None, bad=0, status=None, max_programs=None,
          ranks=None):
    generator = torch.Generator().manual_seed(seed)
    message, messages = gathered(ep, E, k, T_max, tokens, mode, generator, headers, bad)
    fmt = CountsFormat(ep, E, 4)
    options = {} if max_programs is None else dict(max_programs=max_programs)
    kernel = DeviceCounts(fmt, message, "cpu", **options)
    status = torch.zeros(4, dtype=torch.int32) if status is None else torch.tensor(status, dtype=torch.int32)
    words = []
    for rank in range(ep) if ranks is None else ranks:
        for verdict in (True, False):
            ref_messages, ref_status = messages.clone(), status.clone()
            ref = fmt.build(ref_messages, message, ref_status)
            if verdict:
                fmt.verdict(ref, rank, ref_status)
            got_messages, got_status = messages.clone(), status.clone()
            got = kernel.build(got_messages, got_status, rank, verdict=verdict)
            what = (ep, E, k, T_max, tokens, mode, seed, rank, verdict)
            assert torch.equal(got, ref), (what, got.tolist(), ref.tolist())
            assert torch.equal(got_messages, ref_messages), what
            assert torch.equal(got_status, ref_status), (what, got_status.tolist(), ref_status.tolist())
            assert not kernel.scratch.any(), (what, kernel.scratch.tolist())
            if verdict:
                words.append(got_status.tolist())
    if headers is None:  # every rank refuses the call, or none does (with headers that differ, each rank names
        assert all(w[0] == words[0][0] for w in words), words   # the others)
    return words[0]
'''

SCRIPT = HELPERS + r'''

# routing: EP 1-4, empty ranks, one token, k 1..16, several blocks per rank, one or many programs
for i, (ep, E, k, T_max, tokens) in enumerate([
        (1, 8, 2, 5, (5,)), (1, 64, 16, 130, (130,)), (2, 8, 3, 40, (40, 37)), (2, 16, 1, 3000, (3000, 2999)),
        (3, 12, 4, 30, (30, 0, 22)), (4, 8, 2, 9, (0, 0, 0, 0)), (4, 16, 8, 300, (300, 1, 0, 257)),
        (2, 4, 4, 1, (1, 1)), (4, 512, 8, 600, (600, 599, 1, 333))]):
    for mode in ("uniform", "holes", "skewed"):
        if mode == "uniform" and k > E:
            continue
        assert check(ep, E, k, T_max, tokens, mode, seed=i) == [0, 0, 0, 0]
        check(ep, E, k, T_max, tokens, mode, seed=i, max_programs=1, ranks=[ep - 1])
        check(ep, E, k, T_max, tokens, mode, seed=i, max_programs=3, ranks=[0])
print("ROUTING OK")

# bad ids: counted per rank, replaced by -1, rejected (rank at fault = the lowest, detail = its count)
assert check(2, 8, 3, 40, (40, 37), "holes", seed=1, bad=5)[:2] == [sync.REJECT_BAD_IDS, 0]
assert check(4, 16, 8, 300, (0, 300, 0, 257), "holes", seed=2, bad=3, max_programs=5)[:3] == \
    [sync.REJECT_BAD_IDS, 1, 3]
assert check(1, 512, 16, 200, (200,), "uniform", seed=3, bad=4)[:3] == [sync.REJECT_BAD_IDS, 0, 4]
# headers: a failed rank outranks one at another call, which outranks bad ids; the lowest rank at fault is named
other_call, other_layer, failed = [7, 1, 6, 0], [8, 1, 5, 0], [7, 1, 5, 2]
assert check(3, 6, 2, 4, (4, 2, 0), "holes", headers=[HEADER, HEADER, failed])[:3] == \
    [sync.REJECT_PEER_FAILED, 2, 2]
assert check(3, 6, 2, 4, (4, 2, 0), "holes", headers=[HEADER, other_call, HEADER])[:2] == \
    [sync.REJECT_CALL_ORDER, 1]
assert check(3, 6, 2, 4, (4, 2, 0), "holes", headers=[HEADER, [7, 1, 6, 2], HEADER], bad=2)[:3] == \
    [sync.REJECT_BAD_IDS, 0, 2]
assert check(3, 6, 2, 4, (0, 2, 4), "holes", headers=[HEADER, [7, 1, 6, 2], HEADER], bad=2)[:3] == \
    [sync.REJECT_PEER_FAILED, 1, 2]
check(4, 8, 2, 9, (9, 3, 0, 9), "holes", headers=[other_layer, HEADER, HEADER, HEADER])
check(2, 8, 2, 9, (0, 0), "uniform", headers=[failed, failed], bad=1)
# the first error stays: a kernel error or an earlier rejection
assert check(2, 8, 3, 40, (40, 37), "holes", seed=4, bad=5, status=[1, 3, 4, 9]) == [1, 3, 4, 9]
assert check(2, 8, 3, 40, (40, 37), "holes", headers=[HEADER, failed], status=[sync.REJECT_BAD_IDS, 0, 1, 2]) == \
    [sync.REJECT_BAD_IDS, 0, 1, 2]
print("VERDICT OK")

# back to back on one scratch: a second launch on the same messages finds no bad ids (they are -1 now), as build
message, messages = gathered(2, 8, 3, 40, (40, 37), "holes", torch.Generator().manual_seed(5), bad=6)
fmt = CountsFormat(2, 8, 4)
kernel = DeviceCounts(fmt, message, "cpu", max_programs=2)
reference = messages.clone()
for launch in range(3):
    ref = fmt.build(reference, message, torch.zeros(4, dtype=torch.int32))
    got = kernel.build(messages, torch.zeros(4, dtype=torch.int32), 0, verdict=False)
    assert torch.equal(got, ref) and torch.equal(messages, reference), launch
    assert (ref[fmt.bad_ids_offset:fmt.headers_offset].sum() > 0) == (launch == 0)

# the tile tables of a rank's experts in the same launch (build(tiles=)): equal to build_tile_table_torch on the
# prefix sum of that rank's pairs, over every entry the GEMMs read (each section's count); one or two kinds, split
# tails; no rows at all; tables sized for far more rows than the call has (only the used blocks are written)
from weave_moe.backends.weave.kernels import grouped_tiles as gt
for i, (ep, E, k, T_max, tokens, kinds) in enumerate([
        (1, 8, 2, 5, (5,), [(8, False)]), (1, 64, 8, 64, (33,), [(8, False), (16, True)]),
        (2, 16, 4, 40, (40, 3), [(16, True)]), (2, 8, 2, 9, (0, 0), [(8, False), (32, False)]),
        (4, 256, 8, 64, (64, 1, 0, 17), [(64, False), (8, True)])]):
    for mode in ("uniform", "skewed", "holes"):
        message, messages = gathered(ep, E, k, T_max, tokens, mode, torch.Generator().manual_seed(i))
        fmt = CountsFormat(ep, E, 4)
        kernel = DeviceCounts(fmt, message, "cpu", max_programs=3)
        L = E // ep
        for rank in range(ep):
            ref = fmt.build(messages.clone(), message, torch.zeros(4, dtype=torch.int32))
            pairs = ref[fmt.expert_pairs_offset + rank * L:fmt.expert_pairs_offset + (rank + 1) * L]
            offsets = torch.cat([torch.zeros(1, dtype=torch.int32), pairs.cumsum(0).int()])
            max_rows = ep * T_max * k
            tables = [gt.TileTable(torch.full((3, 2 * (max_rows // m + L)), -7, dtype=torch.int32),
                                   torch.full((2,), -7, dtype=torch.int32), m, tail) for m, tail in kinds]
            got = kernel.build(messages.clone(), torch.zeros(4, dtype=torch.int32), rank, verdict=True, tiles=tables)
            assert torch.equal(got, ref), (i, mode, rank)
            for table in tables:
                want = gt.build_tile_table_torch(offsets, table.block_m, max_rows, table.split_tail)
                what = (i, mode, rank, table.block_m, table.split_tail)
                assert torch.equal(table.num_tiles, want.num_tiles), (what, table.num_tiles, want.num_tiles)
                for section, n in enumerate(want.num_tiles.tolist()):
                    cols = slice(section * table.max_tiles, section * table.max_tiles + n)
                    wcols = slice(section * want.max_tiles, section * want.max_tiles + n)
                    assert torch.equal(table.table[:, cols], want.table[:, wcols]), what
print("COUNTS OK")
'''


def test_counts_kernel_equals_build_and_verdict_under_the_interpreter():
    out = run_interpreted(SCRIPT, "COUNTS OK", timeout=900)
    assert "ROUTING OK" in out and "VERDICT OK" in out


FUSED_SCRIPT = HELPERS + r'''
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import planner_cases as cases
from weave_moe.backends.weave.kernels import planner_mirror
from weave_moe.backends.weave.kernels.planner import DevicePlanner
from weave_moe.models import MoESpec

plans_checked = 0
for i, (E, k, H, I, T_max, tokens, mode, profile_name, policy, bad, max_programs) in enumerate([
        (16, 8, 2048, 768, 3000, (3000, 2999), "uniform", "h200_measured", "weave", 0, None),
        (256, 8, 7168, 2048, 64, (64, 1), "uniform", "h200_grouped_serial", "weave", 0, None),
        (32, 4, 4096, 1408, 300, (300, 1, 0, 257), "skewed", "odd20", "weave", 0, 3),
        (8, 2, 72, 40, 5, (5,), "holes", "h200_grouped_serial", "weave", 0, 1),
        (12, 3, 1000, 300, 40, (40, 0, 22), "uniform", "h200_default", "spatial", 0, None),
        (8, 2, 2048, 1408, 9, (0, 0), "uniform", "odd20", "static:5,2", 0, None),
        (16, 2, 5120, 1536, 64, (64, 64, 64, 64), "holes", "h200_measured", "per_iteration", 0, 2),
        (16, 1, 2048, 768, 16, (16, 3), "uniform", "h200_measured", "serial", 0, None),
        (8, 3, 2048, 512, 40, (40, 37), "holes", "h200_measured", "weave", 5, None)]):
    ep = len(tokens)
    spec = MoESpec(E, k, H, I)
    planner = DevicePlanner(spec, ep, cases.PROFILES[profile_name](), policy)
    message, messages = gathered(ep, E, k, T_max, tokens, mode, torch.Generator().manual_seed(i), bad=bad)
    fmt = CountsFormat(ep, E, 4)
    options = {} if max_programs is None else dict(max_programs=max_programs)
    fused = DeviceCounts(fmt, message, "cpu", planner=planner, **options)
    plain = DeviceCounts(fmt, message, "cpu", **options)
    for rank in range(ep):
        what = (E, k, T_max, tokens, mode, profile_name, policy, rank)
        ref_messages, ref_status = messages.clone(), torch.zeros(4, dtype=torch.int32)
        ref = plain.build(ref_messages, ref_status, rank, verdict=True).clone()
        got_messages, got_status = messages.clone(), torch.zeros(4, dtype=torch.int32)
        plans = torch.full((ep, 4), -7, dtype=torch.int32)
        got = fused.build(got_messages, got_status, rank, verdict=True, plans=plans)
        # the counts, the messages and the verdict as without the planner
        assert torch.equal(got, ref) and torch.equal(got_messages, ref_messages), what
        assert torch.equal(got_status, ref_status), (what, got_status.tolist())
        assert (got_status[0] != 0) == (bad > 0), what
        assert not fused.scratch.any(), what
        # the plans: the mirror's bit for bit, the planner's own launch on the same counts, the Python planner's
        vector = got[:planner.counts_words].numpy()[None]
        mirror = planner_mirror.mirror(planner, vector)[0]
        assert np.array_equal(plans.numpy(), mirror), (what, plans.tolist(), mirror.tolist())
        alone = planner.launch(got, torch.full((ep, 4), -7, dtype=torch.int32))
        assert torch.equal(plans, alone), what
        stats = cases.compare([cases.Group(spec, ep, profile_name, policy, vector.astype(np.int64))], [plans.numpy()[None]])
        assert not stats["failures"], (what, stats["failures"])
        plans_checked += ep
print("FUSED PLANS OK", plans_checked)
'''


def test_counts_kernel_with_the_planner_writes_the_planners_plans_under_the_interpreter():
    """`DeviceCounts(planner=)`: the same counts, messages and verdict as without it, and every rank's plan equal to
    the mirror's bit for bit, to the planner's own launch on the same counts, and within the Python planner's
    tolerance (tests/planner_cases.py); EP 1-4, five policies, four profiles, bad ids, one to three programs."""
    out = run_interpreted(FUSED_SCRIPT, "FUSED PLANS OK", str(Path(__file__).parent), timeout=900)
    print(out.strip().splitlines()[-1])


def test_counts_kernel_refuses_wrong_buffers():
    import torch

    from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage
    from weave_moe.backends.weave.kernels.counts import DeviceCounts

    message = RoutingMessage(4, 2)
    kernel = DeviceCounts(CountsFormat(2, 8, 4), message, "cpu")
    assert kernel.counts.shape == (CountsFormat(2, 8, 4).size,) and not kernel.scratch.any()
    status = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="messages"):
        kernel.build(torch.zeros(1, message.words, dtype=torch.int32), status, 0, verdict=True)
    with pytest.raises(ValueError, match="status"):
        kernel.build(torch.zeros(2, message.words, dtype=torch.int32), status[:3], 0, verdict=True)
    with pytest.raises(ValueError, match="divisible"):
        DeviceCounts(CountsFormat(3, 8, 4), message, "cpu")


@pytest.mark.parametrize("ep,experts,top_k,max_tokens", [(1, 64, 8, 2048), (2, 16, 1, 16384), (4, 256, 6, 4096),
                                                         (8, 512, 16, 16384), (8, 256, 8, 1)])
@pytest.mark.parametrize("verdict", [True, False])
def test_counts_kernel_compiles_for_sm90_without_local_memory(ep, experts, top_k, max_tokens, verdict):
    """No spills to local memory; the data atomics relaxed, the ticket acq_rel behind a CTA barrier (module
    docstring), the read-and-clear by atomic exchanges."""
    from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage
    from weave_moe.backends.weave.kernels.counts import DeviceCounts, compile_counts_ptx

    kernel = DeviceCounts(CountsFormat(ep, experts, 4), RoutingMessage(max_tokens, top_k), "cpu")
    ptx = compile_counts_ptx(kernel, verdict=verdict)
    assert ".local" not in ptx
    ticket = re.search(r"bar\.sync[^\n]*\n(?:[^\n]*\n){0,8}?[^\n]*atom\.global\.gpu\.acq_rel\.add", ptx)
    assert ticket and len(re.findall(r"atom\.global\.gpu\.acq_rel", ptx)) == 1
    assert "atom.global.gpu.relaxed.add" in ptx and "atom.global.gpu.relaxed.exch" in ptx


@pytest.mark.parametrize("model,ep,max_tokens,policy", [("deepseek-v3", 2, 8192, "weave"), ("qwen3-30b-a3b", 8, 64, "weave"),
                                                        ("phi-3.5-moe", 4, 4096, "per_iteration")])
def test_counts_kernel_with_the_planner_compiles_for_sm90_as_the_planner_does(model, ep, max_tokens, policy):
    """The planning launch: no local memory, and the planner's arithmetic as in its own launch (IEEE division, no
    fused multiply-add: `planner_mirror.mirror` reproduces it bit for bit); the counts' ticket protocol unchanged."""
    from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage
    from weave_moe.backends.weave.kernels.counts import DeviceCounts, compile_counts_ptx
    from weave_moe.backends.weave.kernels.planner import DevicePlanner
    from weave_moe.models import MoESpec
    from weave_moe.plan import HardwareProfile

    spec = MoESpec.from_name(model)
    planner = DevicePlanner(spec, ep, HardwareProfile.default().with_grouped_serial(), policy)
    kernel = DeviceCounts(CountsFormat(ep, spec.num_experts, 4), RoutingMessage(max_tokens, spec.top_k), "cpu",
                          planner=planner)
    ptx = compile_counts_ptx(kernel, verdict=True)
    assert ".local" not in ptx
    assert re.search(r"div\.rn\.f32", ptx)
    assert not re.search(r"fma\.rn\.f32|mad\.[a-z.]*f32", ptx)
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel", ptx)) == 1


@pytest.mark.parametrize("model,local_experts,kinds", [("qwen3-30b-a3b", 64, [(8, False)]),
                                                       ("deepseek-v3", 128, [(8, False), (16, True)]),
                                                       ("deepseek-v3", 256, [(64, False)])])
def test_counts_kernel_with_tile_tables_compiles_for_sm90_without_local_memory(model, local_experts, kinds):
    """The paired call's counts launch that also writes the tile tables (KernelConfig.chain_pairs) at EP = 1, E_local
    up to 256: no local memory; the ticket protocol unchanged; the tables' stores after a CTA barrier."""
    import torch

    from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage
    from weave_moe.backends.weave.kernels.counts import DeviceCounts, compile_counts_ptx
    from weave_moe.backends.weave.kernels.grouped_tiles import TileTable
    from weave_moe.models import MoESpec

    spec = MoESpec.from_name(model)
    kernel = DeviceCounts(CountsFormat(1, local_experts, 4), RoutingMessage(8192, spec.top_k), "cpu")
    tables = [TileTable(torch.zeros(3, 2 * 1000, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), m, tail)
              for m, tail in kinds]
    ptx = compile_counts_ptx(kernel, verdict=True, tiles=tables)
    plain = compile_counts_ptx(kernel, verdict=True)
    assert ".local" not in ptx
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel", ptx)) == 1
    assert len(re.findall(r"bar\.sync", ptx)) > len(re.findall(r"bar\.sync", plain))


def test_counts_kernel_refuses_plans_it_was_not_built_for():
    import torch

    from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage
    from weave_moe.backends.weave.kernels.counts import DeviceCounts
    from weave_moe.backends.weave.kernels.planner import DevicePlanner
    from weave_moe.models import MoESpec
    from weave_moe.plan import HardwareProfile

    message, spec = RoutingMessage(4, 2), MoESpec(8, 2, 64, 32)
    messages, status = torch.zeros(2, message.words, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="plans must be given exactly"):
        DeviceCounts(CountsFormat(2, 8, 4), message, "cpu").build(messages, status, 0, True,
                                                                  plans=torch.zeros(2, 4, dtype=torch.int32))
    planning = DeviceCounts(CountsFormat(2, 8, 4), message, "cpu",
                            planner=DevicePlanner(spec, 2, HardwareProfile.default()))
    with pytest.raises(ValueError, match="plans must be given exactly"):
        planning.build(messages, status, 0, True)
    with pytest.raises(ValueError, match=r"plans must be a contiguous int32 \[2, 4\]"):
        planning.build(messages, status, 0, True, plans=torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="the planner plans EP=4"):
        DeviceCounts(CountsFormat(2, 8, 4), message, "cpu", planner=DevicePlanner(spec, 4, HardwareProfile.default()))
