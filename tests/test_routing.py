"""weave_moe.routing: generators, skew calibration, trace files, statistics, and the routing-stats command."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from weave_moe import routing
from weave_moe.models import MoESpec


@dataclass(frozen=True)
class Case:
    num_tokens: int
    num_experts: int
    top_k: int

    def __str__(self) -> str:
        return f"T{self.num_tokens}-E{self.num_experts}-k{self.top_k}"


CASES = [Case(0, 8, 2), Case(1, 8, 2), Case(7, 16, 2), Case(300, 64, 6), Case(1000, 256, 8), Case(5, 4, 4)]

GENERATORS = {
    "uniform": lambda c, seed: routing.uniform(c.num_tokens, c.num_experts, c.top_k, seed=seed),
    "skewed": lambda c, seed: routing.skewed(c.num_tokens, c.num_experts, c.top_k, skew=3.0, layer=1, seed=seed),
    "group_limited": lambda c, seed: routing.group_limited(
        c.num_tokens, c.num_experts, c.top_k, n_group=2, topk_group=2, seed=seed, skew=2.0
    ),
}


def _expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.bincount(topk_ids.flatten().long(), minlength=num_experts).double()


# --------------------------------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generator_contract(name, case):
    ids, weights = GENERATORS[name](case, 0)
    assert ids.shape == weights.shape == (case.num_tokens, case.top_k)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    if case.num_tokens:
        assert ids.min() >= 0 and ids.max() < case.num_experts
        ordered = ids.sort(dim=-1).values
        assert (ordered[:, 1:] != ordered[:, :-1]).all(), "an expert repeats within a token"
        # fp32 sum of k <= 8 positive terms normalised in fp32: a few ulps of 1.
        torch.testing.assert_close(weights.sum(dim=-1), torch.ones(case.num_tokens), atol=1e-5, rtol=0)
        assert (weights >= 0).all()


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_are_deterministic_per_seed(name):
    case = Case(200, 64, 6)
    ids_a, weights_a = GENERATORS[name](case, 3)
    ids_b, weights_b = GENERATORS[name](case, 3)
    ids_c, _ = GENERATORS[name](case, 4)
    assert torch.equal(ids_a, ids_b) and torch.equal(weights_a, weights_b)
    assert not torch.equal(ids_a, ids_c)


def test_uniform_is_balanced():
    ids, _ = routing.uniform(8192, 64, 8, seed=1)
    counts = _expert_counts(ids, 64)
    # Mean 1024 pairs per expert, std ~30: the busiest of 64 stays within ~3.5 std.
    assert counts.max() / counts.mean() < 1.12


@pytest.mark.parametrize("skew", [1.5, 3.0, 5.0, 7.0])
def test_skew_target_is_hit(skew):
    num_experts, top_k = 256, 8
    for layer in (0, 5):
        ids, _ = routing.skewed(8192, num_experts, top_k, skew=skew, layer=layer, seed=layer)
        counts = _expert_counts(ids, num_experts)
        measured = (counts.max() / counts.mean()).item()
        # 64k pairs: the calibration is 0-5 % high and the count noise is ~5 % of the mean; 15 % covers both.
        assert abs(measured / skew - 1) < 0.15, (skew, layer, measured)


@pytest.mark.parametrize("num_experts, top_k", [(16, 2), (64, 6), (128, 8), (160, 6)])
def test_skew_target_other_shapes(num_experts, top_k):
    ids, _ = routing.skewed(16384 // top_k * 2, num_experts, top_k, skew=4.0, seed=2)
    counts = _expert_counts(ids, num_experts)
    assert abs((counts.max() / counts.mean()).item() / 4.0 - 1) < 0.15


def test_skew_is_clamped_at_experts_over_top_k():
    ids, _ = routing.skewed(4096, 16, 2, skew=100.0)
    counts = _expert_counts(ids, 16)
    # At the clamp E / k = 8 the busiest expert is in (almost) every token.
    assert counts.max() >= 0.98 * 4096
    assert routing.max_skew(16, 2) == 8.0


def test_skew_one_is_uniform_popularity():
    popularity = routing.expert_popularity(32, 4, skew=1.0, layer=3)
    torch.testing.assert_close(popularity, torch.full((32,), 1 / 32, dtype=torch.float64))


def test_bad_skew_and_locality_raise():
    with pytest.raises(ValueError, match="skew"):
        routing.skewed(4, 16, 2, skew=0.5)
    with pytest.raises(ValueError, match="locality"):
        routing.skewed(4, 16, 2, locality=1.5)
    with pytest.raises(ValueError, match="top_k"):
        routing.uniform(4, 16, 17)


def test_hot_experts_move_across_layers_not_seeds():
    def hottest(layer, seed):
        ids, _ = routing.skewed(4096, 128, 8, skew=5.0, layer=layer, seed=seed)
        return set(_expert_counts(ids, 128).topk(4).indices.tolist())

    assert hottest(0, 0) != hottest(1, 0)
    assert len({frozenset(hottest(layer, 0)) for layer in range(6)}) >= 5
    # Popularity depends on the layer only, so ranks drawing with different seeds agree on the hot experts.
    assert hottest(2, 0) == hottest(2, 1)


def test_locality_raises_rank_imbalance():
    def rank_imbalance(locality):
        per_rank = [routing.skewed(1024, 256, 8, skew=7.0, seed=r, locality=locality)[0] for r in range(8)]
        return routing.routing_stats(per_rank, 256, 8).rank_imbalance

    spread, contiguous = rank_imbalance(0.0), rank_imbalance(1.0)
    assert spread < 1.4 < 1.8 < contiguous


@pytest.mark.parametrize("n_group, topk_group", [(8, 4), (8, 1), (4, 3)])
def test_group_limited_respects_groups(n_group, topk_group):
    num_experts, top_k = 64, 6 if topk_group > 1 else 4
    ids, weights = routing.group_limited(
        2000, num_experts, top_k, n_group=n_group, topk_group=topk_group, seed=5, skew=3.0
    )
    groups = ids.long() // (num_experts // n_group)
    groups_per_token = torch.zeros(ids.shape[0], n_group, dtype=torch.bool).scatter_(1, groups, True).sum(dim=1)
    assert groups_per_token.max() <= topk_group
    assert groups_per_token.min() >= 1
    ordered = ids.sort(dim=-1).values
    assert (ordered[:, 1:] != ordered[:, :-1]).all()
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2000), atol=1e-5, rtol=0)


def test_group_limited_bad_arguments():
    with pytest.raises(ValueError, match="n_group"):
        routing.group_limited(4, 60, 4, n_group=8, topk_group=2)
    with pytest.raises(ValueError, match="topk_group"):
        routing.group_limited(4, 64, 4, n_group=8, topk_group=9)
    with pytest.raises(ValueError, match="top_k=20"):
        routing.group_limited(4, 64, 20, n_group=8, topk_group=2)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_from_gate_matches_torch_topk(scoring, renormalize):
    logits = torch.randn(50, 32, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    ids, weights = routing.from_gate(logits, 4, scoring=scoring, renormalize=renormalize)
    scores = torch.softmax(logits.float(), -1) if scoring == "softmax" else torch.sigmoid(logits.float())
    expected = scores.topk(4, dim=-1)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    # Chosen scores must match; ids may differ only between exactly tied scores (bf16 logits do tie).
    torch.testing.assert_close(scores.gather(1, ids.long()), expected.values, rtol=0, atol=0)
    expected_weights = expected.values / expected.values.sum(-1, keepdim=True) if renormalize else expected.values
    torch.testing.assert_close(weights, expected_weights)


def test_from_gate_bad_input():
    with pytest.raises(ValueError, match="scoring"):
        routing.from_gate(torch.randn(4, 8), 2, scoring="relu")
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        routing.from_gate(torch.randn(8), 2)


def test_generate_uses_the_spec():
    spec = MoESpec.from_name("deepseek-v2-lite")
    ids, weights = routing.generate(spec, 100, routing="skewed", skew=2.0, layer=3, seed=1)
    expected_ids, _ = routing.skewed(100, spec.num_experts, spec.top_k, skew=2.0, layer=3, seed=1)
    assert torch.equal(ids, expected_ids)
    assert routing.generate(spec, 10)[0].shape == (10, spec.top_k)
    with pytest.raises(ValueError, match="routing"):
        routing.generate(spec, 10, routing="zipf")


# --------------------------------------------------------------------------------------------------------------------
# Trace files
# --------------------------------------------------------------------------------------------------------------------


def test_trace_round_trip(tmp_path):
    ids = torch.stack([routing.skewed(64, 32, 4, layer=layer)[0] for layer in range(3)])
    ids[1, 5, 2] = -1
    weights = torch.rand(ids.shape)
    routing.save_trace(tmp_path / "trace.npz", ids, weights)
    loaded_ids, loaded_weights = routing.load_trace(tmp_path / "trace.npz", num_experts=32)
    assert loaded_ids.dtype == torch.int32 and torch.equal(loaded_ids, ids)
    assert torch.equal(loaded_weights, weights)

    routing.save_trace(tmp_path / "ids_only.npz", ids.numpy().astype(np.int64))
    loaded_ids, loaded_weights = routing.load_trace(tmp_path / "ids_only.npz")
    assert torch.equal(loaded_ids, ids) and loaded_weights is None


def test_save_trace_rejects_bad_input(tmp_path):
    ids = torch.zeros(2, 3, 2, dtype=torch.int32)
    ids[..., 1] = 1
    with pytest.raises(ValueError, match="layers, tokens, top_k"):
        routing.save_trace(tmp_path / "t.npz", ids[0])
    with pytest.raises(ValueError, match="integers"):
        routing.save_trace(tmp_path / "t.npz", ids.float())
    with pytest.raises(ValueError, match="shape"):
        routing.save_trace(tmp_path / "t.npz", ids, torch.ones(2, 3, 3))
    bad = ids.clone()
    bad[1, 2] = torch.tensor([4, 4])
    with pytest.raises(ValueError, match="layer 1 token 2 repeats"):
        routing.save_trace(tmp_path / "t.npz", bad)
    bad[1, 2] = torch.tensor([-3, 4])
    with pytest.raises(ValueError, match="-3"):
        routing.save_trace(tmp_path / "t.npz", bad)


def test_load_trace_names_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        routing.load_trace(tmp_path / "missing.npz")
    np.savez(tmp_path / "no_ids.npz", expert_ids=np.zeros((1, 2, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="no 'topk_ids'"):
        routing.load_trace(tmp_path / "no_ids.npz")
    (tmp_path / "garbage.npz").write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match="garbage.npz"):
        routing.load_trace(tmp_path / "garbage.npz")
    routing.save_trace(tmp_path / "big_ids.npz", np.array([[[0, 40]]]))
    with pytest.raises(ValueError, match="num_experts=32"):
        routing.load_trace(tmp_path / "big_ids.npz", num_experts=32)
    np.savez(tmp_path / "flat.npz", topk_ids=np.zeros((4, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="layers, tokens, top_k"):
        routing.load_trace(tmp_path / "flat.npz")


# --------------------------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------------------------


def _brute_force(per_rank: list[list[list[int]]], num_experts: int, world_size: int, row_bytes: int):
    """Per-token Python loops: the obvious reading of the dedup rule, for small inputs only."""
    num_local_experts = num_experts // world_size
    rows = [[0] * world_size for _ in range(world_size)]
    pairs = [[0] * world_size for _ in range(world_size)]
    counts = [0] * num_experts
    for source, tokens in enumerate(per_rank):
        for experts in tokens:
            destinations = set()
            for expert in experts:
                if expert < 0:
                    continue
                counts[expert] += 1
                pairs[source][expert // num_local_experts] += 1
                destinations.add(expert // num_local_experts)
            for dest in destinations:
                rows[source][dest] += 1
    sent = [sum(rows[s][d] for d in range(world_size) if d != s) * row_bytes for s in range(world_size)]
    received = [sum(rows[s][d] for s in range(world_size) if s != d) * row_bytes for d in range(world_size)]
    return rows, pairs, counts, sent, received


@dataclass(frozen=True)
class StatsCase:
    world_size: int
    num_experts: int
    top_k: int
    tokens_per_rank: tuple[int, ...]

    def __str__(self) -> str:
        return f"EP{self.world_size}-E{self.num_experts}-k{self.top_k}-T{'_'.join(map(str, self.tokens_per_rank))}"


STATS_CASES = [
    StatsCase(1, 8, 2, (5,)),
    StatsCase(2, 8, 3, (6, 0)),
    StatsCase(4, 16, 4, (1, 9, 3, 7)),
    StatsCase(8, 32, 8, (11,) * 8),
    StatsCase(3, 12, 5, (4, 5, 6)),
]


@pytest.mark.parametrize("case", STATS_CASES, ids=str)
def test_stats_match_brute_force(case):
    per_rank = []
    for rank, num_tokens in enumerate(case.tokens_per_rank):
        ids, _ = routing.skewed(num_tokens, case.num_experts, case.top_k, skew=2.0, seed=rank, locality=1.0)
        ids[::3, -1] = -1  # some tokens with fewer experts
        per_rank.append(ids)
    hidden_size, dtype_bytes = 24, 2
    stats = routing.routing_stats(per_rank, case.num_experts, case.world_size, hidden_size=hidden_size,
                                  dtype_bytes=dtype_bytes)
    rows, pairs, counts, sent, received = _brute_force(
        [ids.tolist() for ids in per_rank], case.num_experts, case.world_size, hidden_size * dtype_bytes
    )
    assert stats.rows_matrix.tolist() == rows
    assert stats.pairs_matrix.tolist() == pairs
    assert stats.expert_counts.tolist() == counts
    assert stats.bytes_sent.tolist() == sent and stats.bytes_received.tolist() == received
    assert stats.rows_received.tolist() == [sum(col) for col in zip(*rows)]
    assert stats.pairs_received.tolist() == [sum(col) for col in zip(*pairs)]
    assert stats.tokens_per_rank.tolist() == list(case.tokens_per_rank)
    assert torch.equal(routing.rank_matrix(per_rank, case.num_experts), stats.rows_matrix)
    if sum(counts):
        assert stats.expert_imbalance == pytest.approx(max(counts) / (sum(counts) / case.num_experts))
        loads = stats.pairs_received.tolist()
        assert stats.rank_imbalance == pytest.approx(max(loads) / (sum(loads) / case.world_size))


def test_stats_hand_example():
    # E = 8 on EP = 2: rank 0 owns experts 0-3, rank 1 owns 4-7.
    rank0 = torch.tensor([[0, 1], [0, 5], [-1, -1]])  # 1 local row (2 pairs); 1 local + 1 remote row; nothing
    rank1 = torch.tensor([[4, 6], [2, 3]])  # 1 local row (2 pairs); 1 remote row (2 pairs)
    stats = routing.routing_stats([rank0, rank1], 8, 2, hidden_size=10, dtype_bytes=2)
    assert stats.rows_matrix.tolist() == [[2, 1], [1, 1]]
    assert stats.pairs_matrix.tolist() == [[3, 1], [2, 2]]
    assert stats.expert_counts.tolist() == [2, 1, 1, 1, 1, 1, 1, 0]
    assert stats.bytes_sent.tolist() == [20, 20] and stats.bytes_received.tolist() == [20, 20]
    assert stats.remote_rows_sent.tolist() == [1, 1] and stats.remote_pairs_sent.tolist() == [1, 2]
    assert stats.rank_imbalance == pytest.approx(5 / 4)


def test_stats_single_tensor_with_rank_of_token():
    ids, _ = routing.uniform(40, 16, 4, seed=9)
    rank_of_token = torch.arange(40) % 4
    split = routing.routing_stats(ids, 16, 4, rank_of_token=rank_of_token)
    listed = routing.routing_stats([ids[rank_of_token == r] for r in range(4)], 16, 4)
    assert torch.equal(split.rows_matrix, listed.rows_matrix) and torch.equal(split.pairs_matrix, listed.pairs_matrix)
    # Default placement: contiguous blocks.
    blocks = routing.routing_stats(ids, 16, 4)
    assert torch.equal(blocks.rows_matrix, routing.rank_matrix(list(ids.split(10)), 16))
    assert blocks.bytes_sent is None and blocks.row_bytes is None


def test_stats_ignore_minus_one_and_empty():
    stats = routing.routing_stats(torch.full((5, 3), -1), 8, 2)
    assert stats.expert_counts.sum() == 0 and stats.rows_matrix.sum() == 0
    assert stats.expert_imbalance == 0.0 and stats.rank_imbalance == 0.0
    stats = routing.routing_stats([torch.zeros(0, 2, dtype=torch.int32)] * 2, 8, 2, hidden_size=4)
    assert stats.bytes_sent.tolist() == [0, 0]


def test_stats_errors_name_the_problem():
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"E=10 .* EP=4"):
        routing.routing_stats(ids, 10, 4)
    with pytest.raises(ValueError, match=r"E=10 .* EP=4"):
        routing.rank_matrix([ids] * 4, 10)
    with pytest.raises(ValueError, match="num_experts=8"):
        routing.routing_stats(ids + 8, 8, 2)
    with pytest.raises(ValueError, match="world_size=2"):
        routing.routing_stats([ids] * 3, 8, 2)
    with pytest.raises(ValueError, match="rank_of_token"):
        routing.routing_stats(ids, 8, 2, rank_of_token=torch.tensor([0, 1, 2, 0]))


# --------------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------------


def test_cli_routing_stats(capsys):
    from weave_moe.cli import main

    code = main(["routing-stats", "--model", "qwen3-30b-a3b", "--tokens", "512", "--ep", "4", "--skew", "4",
                 "--layer", "2", "--seed", "1", "--top", "5"])
    out = capsys.readouterr().out
    assert code == 0
    assert "qwen3-30b-a3b" in out and "busiest 5 of 128 experts" in out and "dedup" in out


def test_cli_routing_stats_rejects_bad_ep(capsys):
    from weave_moe.cli import main

    assert main(["routing-stats", "--model", "deepseek-v2", "--tokens", "16", "--ep", "3"]) == 2
    assert "E=160" in capsys.readouterr().out
