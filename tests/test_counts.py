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

import pytest

from interpreter import run_interpreted

SCRIPT = r'''
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
print("COUNTS OK")
'''


def test_counts_kernel_equals_build_and_verdict_under_the_interpreter():
    out = run_interpreted(SCRIPT, "COUNTS OK", timeout=900)
    assert "ROUTING OK" in out and "VERDICT OK" in out


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
