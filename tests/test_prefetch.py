"""The weights' L2 prefetch (kernels/prefetch.py): its definition (`prefetch_sizes`) by hand, the kernel against it
under the interpreter (its TRACE of every piece's size), fed by the counts kernel's own counts vector at every rank,
and its sm_90 compile; the KernelConfig setting."""

import re

import pytest

from interpreter import run_interpreted

from weave_moe.backends.weave.kernels.prefetch import PIECE_BYTES, prefetch_sizes


def test_prefetch_sizes_by_hand():
    """w13 of every expert with rows in expert order, then their w2, cut at the budget; pieces cut at the matrix end."""
    w13, w2, piece = 96, 48, 32          # 3 pieces per w13, 2 per w2 (the last of 16 bytes)
    rows = [0, 3, 0, 1]
    whole = prefetch_sizes(rows, w13, w2, 10**6, piece)
    assert whole.shape == (4, 2, 3)
    assert not whole[[0, 2]].any()                                        # experts without rows
    assert whole[1, 0].tolist() == [32, 32, 32] and whole[3, 0].tolist() == [32, 32, 32]
    assert whole[1, 1].tolist() == [32, 16, 0] and whole[3, 1].tolist() == [32, 16, 0]
    assert whole.sum() == 2 * (w13 + w2)
    # a budget of 2 * w13 + 40: both w13, then expert 1's w2 up to byte 40 (a piece cut at 8), nothing of expert 3's
    cut = prefetch_sizes(rows, w13, w2, 2 * w13 + 40, piece)
    assert cut[1, 0].sum() == cut[3, 0].sum() == w13
    assert cut[1, 1].tolist() == [32, 8, 0] and not cut[3, 1].any()
    # a budget inside the first w13; no rows at all
    assert prefetch_sizes(rows, w13, w2, 40, piece)[1, 0].tolist() == [32, 8, 0]
    assert prefetch_sizes(rows, w13, w2, 40, piece)[3].sum() == 0
    assert not prefetch_sizes([0, 0, 0, 0], w13, w2, 10**6, piece).any()
    assert PIECE_BYTES % 16 == 0


SCRIPT = r'''
import numpy as np
import torch
from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage
from weave_moe.backends.weave.kernels.counts import DeviceCounts
from weave_moe.backends.weave.kernels.prefetch import WeightPrefetch, prefetch_sizes

generator = torch.Generator().manual_seed(0)
cases = 0
# (EP, E, k, T_max, tokens per rank, H, I, budgets in bytes, piece)
for ep, E, k, T_max, tokens, H, I, budgets, piece in [
        (1, 8, 2, 4, (1,), 64, 32, (16, 8192, 10**7), 1024),
        (2, 12, 3, 5, (5, 0), 32, 24, (4096, 3 * 32 * 24 * 4 + 2 * 1536 + 48, 10**7), 512),   # E_local 6
        (3, 9, 2, 6, (6, 1, 3), 16, 16, (2048, 10**6), 256),
        (2, 16, 4, 3, (0, 0), 64, 64, (10**6,), 2048),                     # no rows: nothing
        (2, 8, 8, 40, (40, 37), 32, 32, (5 * 4096 + 1040, 10**6), 1024)]:  # skew: every expert has rows
    message = RoutingMessage(T_max, k)
    messages = torch.zeros(ep, message.words, dtype=torch.int32)
    all_ids = []
    for r, n in enumerate(tokens):
        ids = torch.full((T_max, k), -1, dtype=torch.int32)
        for t in range(n):
            ids[t] = torch.randperm(E, generator=generator)[:k].int()
        if n:
            ids[0, -1] = -1               # a -1 hole
        all_ids.append(ids)
        message.pack(messages[r], ids[:n], torch.rand(n, k, generator=generator), message.pad(),
                     torch.arange(T_max + 1, dtype=torch.int32), torch.tensor([7, 1, 5, 0], dtype=torch.int32))
    fmt = CountsFormat(ep, E, 4)
    counts = DeviceCounts(fmt, message, "cpu").build(messages, torch.zeros(4, dtype=torch.int32), 0, verdict=False)
    ids = torch.cat(all_ids).view(-1)
    pairs = torch.bincount(ids[ids >= 0].long(), minlength=E)
    local = E // ep
    for rank in range(ep):
        w13 = torch.zeros(local, 2 * I, H, dtype=torch.bfloat16)
        w2 = torch.zeros(local, H, I, dtype=torch.bfloat16)
        for budget in budgets:
            prefetch = WeightPrefetch(local, H, I, budget, fmt.expert_pairs_offset + rank * local, piece=piece)
            trace = torch.zeros(prefetch.trace_shape(), dtype=torch.int64)
            prefetch.launch(counts, w13, w2, trace)
            want = prefetch_sizes(pairs[rank * local:(rank + 1) * local].numpy(), prefetch.w13_bytes,
                                  prefetch.w2_bytes, budget, piece)
            assert np.array_equal(trace.numpy(), want), (ep, rank, budget, trace, want)
            assert trace.sum() == min(budget, int((pairs[rank * local:(rank + 1) * local] > 0).sum())
                                      * (prefetch.w13_bytes + prefetch.w2_bytes))
            cases += 1
print("PREFETCH OK", cases)
'''


def test_prefetch_kernel_equals_prefetch_sizes_under_the_interpreter():
    """Every rank of EP 1-3 reads its own experts' pair counts from the counts kernel's vector; budgets below one
    piece, across a w13 / w2 boundary and past everything; E_local not a power of two; a rank without rows."""
    out = run_interpreted(SCRIPT, "PREFETCH OK", timeout=600)
    assert int(out.split("PREFETCH OK")[1].split()[0]) == 21


@pytest.mark.parametrize("model,ep,mib", [("qwen3-30b-a3b", 2, 48), ("deepseek-v3", 2, 48), ("deepseek-v3", 1, 2047),
                                          ("phi-3.5-moe", 8, 16)])
def test_prefetch_compiles_for_sm90_as_bulk_l2_prefetches(model, ep, mib):
    """The launch as specialised for the layer: the bulk L2 prefetch, predicated per lane, and no local memory."""
    from weave_moe.backends.weave.exchange import CountsFormat
    from weave_moe.backends.weave.kernels.prefetch import WeightPrefetch, compile_prefetch
    from weave_moe.models import MoESpec

    spec = MoESpec.from_name(model)
    local = spec.num_experts // ep
    prefetch = WeightPrefetch(local, spec.hidden_size, spec.intermediate_size, mib << 20,
                              CountsFormat(ep, spec.num_experts, 4).expert_pairs_offset + (ep - 1) * local)
    ptx = compile_prefetch(prefetch).asm["ptx"]
    assert len(re.findall(r"@p cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], %r\d+;", ptx)) == 2
    assert ".local" not in ptx and "st.global" not in ptx


def test_weight_prefetch_refuses_what_it_cannot_prefetch():
    import torch

    from weave_moe.backends.weave.kernels.prefetch import WeightPrefetch

    with pytest.raises(ValueError, match="multiple of 8"):
        WeightPrefetch(4, 12, 5, 1 << 20, 0)
    with pytest.raises(ValueError, match="multiples of 16"):
        WeightPrefetch(4, 16, 16, 1000, 0)
    with pytest.raises(ValueError, match="multiples of 16"):
        WeightPrefetch(4, 16, 16, 1 << 20, 0, piece=24)
    prefetch = WeightPrefetch(4, 16, 16, 1 << 20, 0)
    counts = torch.zeros(8, dtype=torch.int32)
    good13, good2 = torch.zeros(4, 32, 16, dtype=torch.bfloat16), torch.zeros(4, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="w13"):
        prefetch.launch(counts, good13[:3], good2)
    with pytest.raises(ValueError, match="w2"):
        prefetch.launch(counts, good13, good2.transpose(1, 2))
    with pytest.raises(ValueError, match="w13"):
        prefetch.launch(counts, good13.float(), good2)
    with pytest.raises(ValueError, match="trace"):   # outside the interpreter: no trace
        prefetch.launch(counts, good13, good2, torch.zeros(prefetch.trace_shape(), dtype=torch.int64))


def test_prefetch_mib_setting():
    from weave_moe.backends.weave.config import PREFETCH_MIB_MAX, KernelConfig

    assert KernelConfig().prefetch_mib == 0
    assert KernelConfig.from_text("prefetch_mib=48", "X").prefetch_mib == 48
    assert KernelConfig.from_text("prefetch_mib=0", "X").prefetch_mib == 0
    for bad in (-1, PREFETCH_MIB_MAX + 1):
        with pytest.raises(ValueError, match="prefetch_mib"):
            KernelConfig(prefetch_mib=bad)
    with pytest.raises(ValueError, match="prefetch_mib"):
        KernelConfig(prefetch_mib=True)
    with pytest.raises(ValueError, match="positive"):   # the other ints stay positive
        KernelConfig(block_m=0)
    assert PREFETCH_MIB_MAX << 20 < 2 ** 31
