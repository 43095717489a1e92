"""The megakernel's task tables, executed task by task in torch on the CPU for all ranks, must reproduce the MoE.

This checks every index the kernel uses (dispatch slots, arrival counts, sorted pair rows, M tiles, DAG order,
combine positions and weights, reduce masks) without a GPU: the kernel does exactly these reads and writes.
"""

import warnings
from dataclasses import dataclass

import pytest
import torch

from weave_moe.backends.weave.layout import build_layout
from weave_moe.plan import MAX_CHUNKS
from weave_moe.reference import moe_error, reference_moe


def _routing(num_tokens, num_experts, top_k, seed, mode):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty(0, top_k, dtype=torch.long)
    if mode == "one_rank" and num_tokens:
        ids = torch.stack([torch.randperm(num_experts // 2, generator=g)[:top_k] for _ in range(num_tokens)])
    if mode == "minus_one" and num_tokens:
        ids[::3, 0] = -1
        ids[1::5, :] = -1
    w = torch.rand(num_tokens, top_k, generator=g) + 0.1
    return ids.to(torch.int32), w


def emulate(tokens, world_size, num_experts, top_k, hidden, inter, chunks, seed=0, mode="uniform",
            block_m=4, block_n0=8, block_n1=8, rows=3):
    torch.manual_seed(seed)
    num_local = num_experts // world_size
    max_tokens = max(max(tokens), 1) + 2
    routing = [_routing(t, num_experts, top_k, seed + r, mode) for r, t in enumerate(tokens)]
    # bf16 values held in fp32, so the emulation and weave_moe.reference read the same numbers
    xs = [torch.randn(t, hidden).bfloat16().float() for t in tokens]
    w13 = (torch.randn(num_experts, 2 * inter, hidden) / hidden ** 0.5).bfloat16().float()
    w2 = (torch.randn(num_experts, hidden, inter) / inter ** 0.5).bfloat16().float()
    all_ids = torch.full((world_size, max_tokens, top_k), -1, dtype=torch.int32)
    all_w = torch.zeros(world_size, max_tokens, top_k)
    for r, (ids, w) in enumerate(routing):
        all_ids[r, : tokens[r]] = ids
        all_w[r, : tokens[r]] = w
    layouts = [
        build_layout(all_ids, all_w, torch.tensor(tokens), torch.tensor(chunks), r, num_experts,
                     hidden_size=hidden, intermediate_size=inter,
                     block_m=block_m, block_n0=block_n0, block_n1=block_n1, dispatch_rows=rows,
                     combine_rows=rows, reduce_rows=rows)
        for r in range(world_size)
    ]
    nan = float("nan")
    recv = [torch.full((world_size * max_tokens, hidden), nan) for _ in range(world_size)]
    arrived = [torch.zeros(world_size, MAX_CHUNKS, dtype=torch.long) for _ in range(world_size)]
    # dispatch
    for r, lay in enumerate(layouts):
        for dest, chunk, start, count in lay.dispatch_tasks[: lay.meta[0]].tolist():
            assert count > 0
            tok = lay.send_token[start:start + count].long()
            slot = lay.send_slot[start:start + count].long()
            recv[dest][r * max_tokens + slot] = xs[r][tok]
            arrived[dest][r, chunk] += count
        assert int(lay.dispatch_tasks[lay.meta[0]:, 3].sum()) == 0
    for d, lay in enumerate(layouts):
        assert torch.equal(arrived[d], lay.arrival_expected.long()), "arrival counts differ from expectations"
    comb = [torch.full((world_size * max_tokens, hidden), nan) for _ in range(world_size)]
    comb_rows = [torch.zeros(world_size, dtype=torch.long) for _ in range(world_size)]
    for d, lay in enumerate(layouts):
        h = torch.full((lay.max_pairs, inter), nan)
        y = torch.full((lay.max_pairs, hidden), nan)
        done0 = torch.zeros(lay.num_mtiles_bound, dtype=torch.long)
        done1 = torch.zeros(MAX_CHUNKS, dtype=torch.long)
        n0 = -(-inter // block_n0)
        for kind, chunk, expert, row_start, num_rows, n_start, mtile, _ in lay.gemm_tasks[: lay.meta[1]].tolist():
            assert num_rows > 0
            e = d * num_local + expert
            rows_ = slice(row_start, row_start + num_rows)
            if kind == 0:
                # the arrival of this chunk from every source must be complete (the kernel waits for it)
                a = recv[d][lay.gather_rows[rows_].long()]
                assert not a.isnan().any()
                cols = slice(n_start, min(n_start + block_n0, inter))
                g = a @ w13[e, cols].T
                u = a @ w13[e, inter + cols.start: inter + cols.stop].T
                h[rows_, cols] = (torch.nn.functional.silu(g) * u).bfloat16().float()  # rounded as the kernel does
                done0[mtile] += 1
            else:
                assert done0[mtile] == n0, "GEMM1 tile queued before its GEMM0 tiles"
                cols = slice(n_start, min(n_start + block_n1, hidden))
                y[rows_, cols] = h[rows_] @ w2[e, cols].T
                done1[chunk] += 1
        assert torch.equal(done1, lay.gemm1_expected.long())
        last_chunk = -1
        for source, chunk, start, count in lay.combine_tasks[: lay.meta[2]].tolist():
            assert chunk >= last_chunk, "combine tasks not in chunk order"
            last_chunk = chunk
            pos = lay.combine_pos[start:start + count].long()
            wt = lay.combine_weight[start:start + count]
            acc = torch.zeros(count, hidden)
            for j in range(top_k):
                ok = pos[:, j] >= 0
                acc[ok] += wt[ok, j, None] * y[pos[ok, j]]
            tok = lay.combine_token[start:start + count].long()
            comb[source][d * max_tokens + tok] = acc
            comb_rows[source][d] += count
    outs = []
    for r, lay in enumerate(layouts):
        assert torch.equal(comb_rows[r], lay.combine_expected.long())
        out = torch.full((tokens[r], hidden), nan)
        for task in range(int(lay.meta[3])):
            t = torch.arange(task * rows, min((task + 1) * rows, tokens[r]))
            acc = torch.zeros(t.numel(), hidden)
            for d in range(world_size):
                bit = ((lay.token_dest_mask[t] >> d) & 1).bool()
                acc[bit] += comb[r][d * max_tokens + t[bit]]
            out[t] = acc
        ref = reference_moe(xs[r].bfloat16(), routing[r][0], routing[r][1], w13.bfloat16(), w2.bfloat16())
        assert not out.isnan().any(), "an output row was never written"
        # Same inputs and the same bf16 rounding of h; only the reference's final bf16 rounding (relative 2^-9) and
        # the summation order differ, so 4e-3 is tight: one dropped or doubled pair moves the error by >= ~5%.
        rel_error, _ = moe_error(out, ref)
        assert rel_error <= 4e-3, rel_error
        outs.append(out)
    return layouts


@dataclass
class Case:
    tokens: tuple
    experts: int = 8
    top_k: int = 3
    chunks: tuple = None
    mode: str = "uniform"
    hidden: int = 12
    inter: int = 10


CASES = [
    Case((7, 5)), Case((7, 5), chunks=(2, 3)), Case((9, 4), chunks=(8, 1)), Case((0, 6)), Case((1, 1), chunks=(4, 4)),
    Case((6, 6), mode="one_rank"), Case((10, 3), mode="minus_one", chunks=(3, 2)), Case((5,), experts=4, top_k=2),
    Case((4, 7, 0, 5), experts=8, top_k=2, chunks=(1, 2, 3, 4)), Case((8, 8), experts=4, top_k=4, hidden=13, inter=9),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.tokens}-{c.mode}-{c.chunks}")
def test_layout_executes_to_reference(case):
    world_size = len(case.tokens)
    chunks = list(case.chunks or [1] * world_size)
    emulate(list(case.tokens), world_size, case.experts, case.top_k, case.hidden, case.inter, chunks, mode=case.mode)


@pytest.mark.parametrize("T", [0, 1, 5, 7])
def test_pack_routing_is_the_exchange_message_bit_for_bit(T):
    from weave_moe.backends.weave.exchange import RoutingMessage

    k, max_tokens = 3, 7
    message = RoutingMessage(max_tokens, k)
    words = message.id_words
    ids = torch.randint(-1, 9, (T, k), dtype=torch.int64)
    weights = torch.rand(T, k)
    header = torch.tensor([0x1234567, 3, 9, 0], dtype=torch.int32)  # identity, creation index, call, error code
    counts = torch.arange(max_tokens + 1, dtype=torch.int32)
    out = torch.full((message.words,), 12345, dtype=torch.int32)  # poisoned: every word must be written
    message.pack(out, ids, weights, message.pad(), counts, header)
    expected = torch.cat([ids.reshape(-1).int(), torch.full((words - T * k,), -1, dtype=torch.int32),
                          weights.reshape(-1).view(torch.int32), torch.zeros(words - T * k, dtype=torch.int32),
                          torch.tensor([T], dtype=torch.int32), header])
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="do not fit"):
        message.pack(out, torch.zeros(max_tokens + 1, k, dtype=torch.int32), torch.zeros(max_tokens + 1, k),
                     message.pad(), torch.arange(max_tokens + 2, dtype=torch.int32), header)
    # unpack reads back what pack wrote, for every rank of a gathered [EP, words] block
    gathered = torch.stack([out, out])
    message.pack(gathered[1], ids, weights, message.pad(), counts, header + 1)
    got_ids, got_weights, got_tokens = message.unpack(gathered)
    assert torch.equal(got_ids[1, :T], ids.int()) and torch.equal(got_weights[1, :T], weights)
    assert torch.equal(message.headers(gathered), torch.stack([header, header + 1]))
    assert int(got_tokens[1]) == T and bool((got_ids[1, T:] == -1).all())


@pytest.mark.slow
@pytest.mark.skipif(not (__import__("shutil").which("g++") or __import__("shutil").which("c++")),
                    reason="Inductor's CPU backend needs a C++ compiler")
def test_compiled_build_layout_equals_eager():
    """KernelConfig.compile_layout: build_layout through torch.compile (fullgraph, static shapes) gives the same
    tables bit for bit (here with Inductor's CPU backend; the GPU run compiles to Triton)."""
    import dataclasses

    from weave_moe import routing
    from weave_moe.backends.weave.graphs import compiled_build_layout

    world, tokens, experts, k = 2, 64, 16, 4
    ids = torch.stack([routing.uniform(tokens, experts, k, seed=r)[0].int() for r in range(world)])
    ids[1, 40:] = -1                                    # a shorter rank: padding past its tokens
    weights = torch.rand(world, tokens, k)
    args = (ids, weights, torch.tensor([tokens, 40]), torch.tensor([2, 3]), 1, experts)
    kwargs = dict(hidden_size=64, intermediate_size=32, block_m=16, block_n0=16, block_n1=32, dispatch_rows=4,
                  combine_rows=4, reduce_rows=4)
    eager = build_layout(*args, **kwargs)
    compiled = compiled_build_layout()(*args, **kwargs)
    for field in dataclasses.fields(eager):
        a, b = getattr(eager, field.name), getattr(compiled, field.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field.name


@pytest.mark.slow
@pytest.mark.skipif(not (__import__("shutil").which("g++") or __import__("shutil").which("c++")),
                    reason="Inductor's CPU backend needs a C++ compiler")
def test_compiled_layout_past_the_compile_limit_falls_back_to_eager_tables(monkeypatch):
    """More layer shapes in one process than LAYOUT_COMPILE_LIMIT: fullgraph=True makes Dynamo raise on the next
    recompile (it did on the H200 pair in the validation suite); the builder warns and returns the eager tables."""
    import dataclasses

    import torch._dynamo

    from weave_moe import routing
    from weave_moe.backends.weave import graphs

    torch._dynamo.reset()
    monkeypatch.setattr(graphs, "LAYOUT_COMPILE_LIMIT", 1)
    world, k = 2, 2
    results = []
    for tokens, experts in ((16, 8), (24, 8)):          # two shapes, limit one
        ids = torch.stack([routing.uniform(tokens, experts, k, seed=r)[0].int() for r in range(world)])
        args = (ids, torch.rand(world, tokens, k), torch.tensor([tokens, tokens]), torch.tensor([1, 2]), 0, experts)
        kwargs = dict(hidden_size=64, intermediate_size=32, block_m=16, block_n0=16, block_n1=32, dispatch_rows=4,
                      combine_rows=4, reduce_rows=4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            builder = graphs.LayoutBuilder(compile_layout=True)
            layout = builder(*args, **kwargs)
            compiled = builder.compiled
        results.append((compiled, [str(w.message) for w in caught]))
        eager = build_layout(*args, **kwargs)
        for field in dataclasses.fields(eager):
            a, b = getattr(eager, field.name), getattr(layout, field.name)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field.name
    torch._dynamo.reset()
    assert results[0][0] is True
    assert results[1][0] is False and any("building them eagerly" in m for m in results[1][1])
