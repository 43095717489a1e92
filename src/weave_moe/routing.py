"""Routing workloads: seeded synthetic generators with measured skew, trace files, and statistics.

Shape legend: L = layers, T = tokens (on one rank unless said otherwise), E = routed experts, k = top-k,
EP = expert-parallel world size, E_local = E / EP, H = hidden size.

Every generator returns `(topk_ids, topk_weights)`: `topk_ids` [T, k] int32 global expert ids in [0, E), never the same
expert twice within a token; `topk_weights` [T, k] float32, non-negative, summing to 1 per token. Columns are sorted
by router score, highest first, as `torch.topk` returns them. Consumers (layer, planner, statistics) also accept the
sentinel -1 in `topk_ids` ("no expert"); the generators never produce it.

Expert placement (docs/design.md): rank r owns global experts [r * E_local, (r + 1) * E_local).

Skew model. Real routers are unbalanced: published measurements show the busiest expert of a layer at up to ~7x the
mean token count, and the busiest GPU at 1.5-3.5x the mean GPU load. `skewed` gives every expert a popularity that
follows a Zipf law over a per-layer ranking, p[rank_i] ~ (i + 1) ** -alpha, and draws each token's k experts
without replacement with those popularities (Gumbel-top-k over log-popularity, i.e. the Plackett-Luce model a softmax
router with noisy logits follows). The
exponent alpha is solved so that the *expected* busiest-expert count is `skew` x the mean count; see
`expert_popularity` for the approximation used and its accuracy. Which experts are hot depends only on the layer
index, not on the seed, so ranks that draw their tokens with different seeds agree on the hot experts, as the ranks
of one real model do. `locality` places the popular experts next to each other in id space (so on few ranks),
which sets the per-rank imbalance without changing the per-expert one.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from weave_moe.models import MoESpec

__all__ = [
    "uniform",
    "skewed",
    "group_limited",
    "from_gate",
    "generate",
    "expert_popularity",
    "max_skew",
    "save_trace",
    "load_trace",
    "rank_matrix",
    "routing_stats",
    "RoutingStats",
]

# Score matrices are built in token chunks of at most this many elements (64 MiB of fp32), so T = 65536 tokens over
# E = 512 experts does not need a 128 MiB temporary at once.
_MAX_CHUNK_ELEMENTS = 1 << 24

# Seeds the per-layer ranking of expert popularity; kept apart from the token seed (see module docstring).
_LAYER_SEED_BASE = 0x5EED_0000

TRACE_FORMAT_VERSION = 1


# --------------------------------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------------------------------


def _check_sizes(num_tokens: int, num_experts: int, top_k: int) -> None:
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_experts <= 0:
        raise ValueError(f"num_experts must be > 0, got {num_experts}")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def _sample_top_k(
    popularity: torch.Tensor | None,
    num_tokens: int,
    top_k: int,
    seed: int,
    device,
    *,
    num_experts: int,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, k distinct experts drawn without replacement in proportion to `popularity` (None = uniform).

    Exponential race (equivalent to Gumbel-top-k over log-popularity): expert e rings at Exp(1) / p_e and the first
    k to ring win; that is sequential sampling without replacement, each draw proportional to p among the experts
    not yet taken. Computed as the top k of log(U) / p_e, U ~ Uniform(0, 1), which costs one uniform draw and one
    log per (token, expert). With `n_group > 1` the token first keeps its `topk_group` best groups (group score =
    best expert key inside the group) and picks its k experts there.

    The weights are p_e / Exp_e = -1 / key of the chosen experts, normalised: the softmax of the Gumbel-perturbed
    log-popularities a noisy softmax router would produce, decreasing along k.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    # Experts with p_e below float32 range (steep Zipf tails) get key -inf: chosen only as fillers, with weight 0.
    inverse = None if popularity is None else (1.0 / popularity).to(device=device, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    chunk = max(1, _MAX_CHUNK_ELEMENTS // num_experts)
    for start in range(0, num_tokens, chunk):
        rows = min(chunk, num_tokens - start)
        keys = torch.rand(rows, num_experts, generator=generator, device=device).log_()
        if inverse is not None:
            keys.mul_(inverse)
        if n_group > 1:
            group_best = keys.view(rows, n_group, num_experts // n_group).amax(dim=-1)
            kept_groups = group_best.topk(topk_group, dim=-1).indices
            group_mask = torch.ones(rows, n_group, dtype=torch.bool, device=device)
            group_mask.scatter_(1, kept_groups, False)
            keys.view(rows, n_group, -1).masked_fill_(group_mask.unsqueeze(-1), -math.inf)
        top = keys.topk(top_k, dim=-1)
        ratio = -1.0 / top.values
        ids[start : start + rows] = top.indices.to(torch.int32)
        weights[start : start + rows] = ratio / ratio.sum(dim=-1, keepdim=True)
    return ids, weights


def uniform(num_tokens: int, num_experts: int, top_k: int, *, seed: int = 0, device="cpu"):
    """Balanced routing: each token picks k distinct experts uniformly at random.

    Args:
        num_tokens: T (may be 0).
        num_experts: E.
        top_k: k, in [1, E].
        seed: seeds the draw; the same arguments give the same result on the same device.
        device: where the tensors are made.

    Returns:
        topk_ids [T, k] int32 in [0, E), topk_weights [T, k] float32 summing to 1 per token.
    """
    _check_sizes(num_tokens, num_experts, top_k)
    return _sample_top_k(None, num_tokens, top_k, seed, device, num_experts=num_experts)


def max_skew(num_experts: int, top_k: int) -> float:
    """The largest busiest-expert / mean ratio that routing without repeats can reach: E / k.

    An expert gets at most one pair per token, i.e. T pairs, while the mean is T * k / E.
    """
    return num_experts / top_k


def _inclusion_probabilities(popularity: np.ndarray, top_k: int) -> np.ndarray:
    """P(expert e is among a token's k picks) under Plackett-Luce sampling, approximately.

    Sampling without replacement by Gumbel-top-k is a race of exponential clocks Exp(p_e) where the first k to ring
    win. Approximation (Hajek's, for conditional Poisson designs): replace "the first k" by "those that ring before a
    fixed time tau", tau chosen so that the expected number of winners is k: pi_e = 1 - exp(-p_e * tau),
    sum_e pi_e = k. Against Monte Carlo on the registry's shapes it overestimates the busiest expert by 1-5 %.
    """
    low, high = 0.0, 1.0
    while (-np.expm1(-popularity * high)).sum() < top_k:
        high *= 2.0
    for _ in range(80):
        mid = 0.5 * (low + high)
        if (-np.expm1(-popularity * mid)).sum() < top_k:
            low = mid
        else:
            high = mid
    return -np.expm1(-popularity * high)


def _zipf(num_experts: int, exponent: float) -> np.ndarray:
    weights = np.arange(1, num_experts + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


@functools.lru_cache(maxsize=256)
def _zipf_exponent(num_experts: int, top_k: int, skew: float) -> float:
    """The Zipf exponent whose busiest expert expects `skew` x the mean count (bisection; skew already clamped)."""
    if skew <= 1.0 or top_k >= num_experts:
        return 0.0
    # Exponent 64 makes the top k experts take every pair (ratio E/k to within float precision); the ratio grows
    # monotonically with the exponent, so bisection between 0 and 64 converges.
    low, high = 0.0, 64.0
    for _ in range(60):
        mid = 0.5 * (low + high)
        ratio = _inclusion_probabilities(_zipf(num_experts, mid), top_k).max() * num_experts / top_k
        if ratio < skew:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def expert_popularity(
    num_experts: int, top_k: int, *, skew: float = 3.0, layer: int = 0, locality: float = 0.5
) -> torch.Tensor:
    """Per-expert popularity of one layer, calibrated so the busiest expert expects `skew` x the mean count.

    Zipf over a per-layer ranking of the experts: the i-th most popular gets weight (i + 1) ** -alpha, alpha solved
    by bisection with the inclusion-probability approximation of `_inclusion_probabilities` (the measured busiest /
    mean lands 0-5 % above the target on the registry's shapes). The ranking is seeded by `layer` only, so hot
    experts move from layer to layer but do not depend on the token seed.

    `locality` sets how the ranking is laid out over expert ids, and so how unbalanced the EP ranks are (rank r
    owns a contiguous block of ids): 0 ranks the experts in random order (rank loads average out: at EP = 8 the
    busiest rank sits near 1.1x the mean); 1 puts the popular experts next to each other around a per-layer centre,
    so one or two ranks get most of the hot experts, as in measured traces where the busiest GPU reaches 1.5-3.5x
    the mean. The ranking sorts `locality * distance_to_centre + (1 - locality) * noise`, which needs no EP. The
    default 0.5 gives a busiest rank of about 1.3x (skew 3) to 1.7x (skew 7) the mean at EP = 8 on 256 experts.

    Args:
        num_experts: E.
        top_k: k; the calibration depends on it because an expert can be picked at most once per token.
        skew: target busiest-expert / mean count, >= 1 (1 = uniform). Clamped to `max_skew(E, k)` = E / k, where the
            busiest expert is in (almost) every token.
        layer: layer index (any int), picks which experts are hot.
        locality: in [0, 1], how contiguous the hot experts are (see above).

    Returns:
        [E] float64 probabilities summing to 1 (on the CPU).
    """
    if not skew >= 1.0:
        raise ValueError(f"skew must be >= 1 (1 = uniform), got {skew}")
    if not 0.0 <= locality <= 1.0:
        raise ValueError(f"locality must be in [0, 1], got {locality}")
    _check_sizes(0, num_experts, top_k)
    skew = min(float(skew), max_skew(num_experts, top_k))
    by_rank = torch.from_numpy(_zipf(num_experts, _zipf_exponent(num_experts, top_k, skew)))
    generator = torch.Generator().manual_seed(_LAYER_SEED_BASE + int(layer))
    centre = torch.randint(num_experts, (1,), generator=generator)
    noise = torch.rand(num_experts, generator=generator, dtype=torch.float64)
    offset = (torch.arange(num_experts) - centre).remainder(num_experts)
    distance = torch.minimum(offset, num_experts - offset).double() / max(num_experts // 2, 1)
    order = torch.argsort(locality * distance + (1.0 - locality) * noise, stable=True)
    popularity = torch.empty_like(by_rank)
    popularity[order] = by_rank
    return popularity


def skewed(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    skew: float = 3.0,
    layer: int = 0,
    seed: int = 0,
    locality: float = 0.5,
    device="cpu",
):
    """Unbalanced routing: the busiest expert gets about `skew` x the mean count, hot experts depend on `layer`.

    Measured busiest / mean lands within a few percent of `skew` once T * k is large (>= 16k pairs); below that the
    sampling noise of the counts dominates. See `expert_popularity` for the popularity model and the clamp at E / k.

    Args:
        num_tokens: T (may be 0).
        num_experts: E.
        top_k: k, in [1, E].
        skew: target busiest-expert / mean count, >= 1; 1 gives uniform routing.
        layer: layer index; changes which experts are hot.
        seed: seeds the token draw (not the popularity).
        locality: in [0, 1], how contiguous the hot experts are, which sets the per-rank imbalance; see
            `expert_popularity`.
        device: where the tensors are made.

    Returns:
        topk_ids [T, k] int32 in [0, E), topk_weights [T, k] float32 summing to 1 per token.
    """
    _check_sizes(num_tokens, num_experts, top_k)
    popularity = expert_popularity(num_experts, top_k, skew=skew, layer=layer, locality=locality)
    return _sample_top_k(popularity, num_tokens, top_k, seed, device, num_experts=num_experts)


def group_limited(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    n_group: int,
    topk_group: int,
    seed: int = 0,
    skew: float = 1.0,
    layer: int = 0,
    locality: float = 0.5,
    device="cpu",
):
    """DeepSeek-style group-limited routing: each token keeps `topk_group` of `n_group` expert groups, then its k
    experts inside them.

    Group g holds the consecutive experts [g * E / n_group, (g + 1) * E / n_group); a group's score is the best
    (noisy) expert score inside it, as DeepSeek-V2 does. Expert popularity is that of `skewed` with the same
    `skew` and `layer`; the group limit flattens the resulting skew somewhat, so the measured ratio is not calibrated.

    Args:
        num_tokens: T (may be 0).
        num_experts: E, divisible by n_group.
        top_k: k, at most topk_group * E / n_group.
        n_group: number of expert groups (DeepSeek-V3: 8).
        topk_group: groups kept per token, in [1, n_group] (DeepSeek-V3: 4).
        seed: seeds the token draw.
        skew: popularity skew as in `skewed` (1 = uniform).
        layer: layer index for the popularity ranking.
        locality: layout of the popularity ranking, as in `skewed`.
        device: where the tensors are made.

    Returns:
        topk_ids [T, k] int32 in [0, E), topk_weights [T, k] float32 summing to 1 per token.
    """
    _check_sizes(num_tokens, num_experts, top_k)
    if n_group <= 0 or num_experts % n_group:
        raise ValueError(f"num_experts={num_experts} must be divisible by n_group={n_group} (n_group > 0)")
    if not 0 < topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(
            f"top_k={top_k} exceeds the {topk_group * (num_experts // n_group)} experts of topk_group={topk_group} "
            f"groups of {num_experts // n_group}"
        )
    popularity = expert_popularity(num_experts, top_k, skew=skew, layer=layer, locality=locality)
    return _sample_top_k(
        popularity, num_tokens, top_k, seed, device, num_experts=num_experts, n_group=n_group, topk_group=topk_group
    )


def from_gate(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True):
    """Routing from router logits: top-k over softmax or sigmoid scores.

    Args:
        logits: [T, E] router logits, any float dtype, any device.
        top_k: k, in [1, E].
        scoring: "softmax" (Mixtral, Qwen, DeepSeek-V2) or "sigmoid" (DeepSeek-V3).
        renormalize: divide the k chosen scores by their sum (weights then sum to 1 per token); otherwise the weights
            are the raw scores.

    Returns:
        topk_ids [T, k] int32, topk_weights [T, k] float32, columns sorted by score, highest first.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
    _check_sizes(logits.shape[0], logits.shape[1], top_k)
    if scoring == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits.float())
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    top = scores.topk(top_k, dim=-1)
    weights = top.values
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return top.indices.to(torch.int32), weights


def generate(
    spec: MoESpec,
    num_tokens: int,
    *,
    routing: str = "uniform",
    skew: float = 3.0,
    layer: int = 0,
    seed: int = 0,
    locality: float = 0.5,
    device="cpu",
):
    """`uniform` or `skewed` routing for the layer shape `spec` (E = spec.num_experts, k = spec.top_k).

    `skew`, `layer` and `locality` only matter for routing="skewed".
    Returns topk_ids [T, k] int32, topk_weights [T, k] float32.
    """
    if routing == "uniform":
        return uniform(num_tokens, spec.num_experts, spec.top_k, seed=seed, device=device)
    if routing == "skewed":
        return skewed(
            num_tokens, spec.num_experts, spec.top_k,
            skew=skew, layer=layer, seed=seed, locality=locality, device=device,
        )
    raise ValueError(f"routing must be 'uniform' or 'skewed', got {routing!r}")


# --------------------------------------------------------------------------------------------------------------------
# Trace files
# --------------------------------------------------------------------------------------------------------------------


def _as_numpy(array) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        return array.detach().cpu().numpy()
    return np.asarray(array)


def _check_trace(ids: np.ndarray, weights: np.ndarray | None, where: str, num_experts: int | None) -> None:
    if ids.ndim != 3:
        raise ValueError(f"{where}: topk_ids must be [layers, tokens, top_k], got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{where}: topk_ids must be integers, got dtype {ids.dtype}")
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < -1:
            raise ValueError(f"{where}: topk_ids has id {low} < -1 (-1 is the only allowed sentinel)")
        if num_experts is not None and high >= num_experts:
            raise ValueError(f"{where}: topk_ids has id {high} >= num_experts={num_experts}")
        ordered = np.sort(ids, axis=-1)
        repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
        if repeated.any():
            layer, token = np.argwhere(repeated.any(axis=-1))[0]
            raise ValueError(f"{where}: layer {layer} token {token} repeats an expert: {ids[layer, token].tolist()}")
    if weights is not None:
        if weights.shape != ids.shape:
            raise ValueError(f"{where}: topk_weights shape {weights.shape} differs from topk_ids shape {ids.shape}")
        if not np.issubdtype(weights.dtype, np.floating):
            raise ValueError(f"{where}: topk_weights must be floats, got dtype {weights.dtype}")
        if weights.size and not np.isfinite(weights).all():
            raise ValueError(f"{where}: topk_weights holds NaN or inf")


def save_trace(path, topk_ids, topk_weights=None) -> None:
    """Write a routing trace as a compressed .npz.

    Args:
        path: file to write (numpy adds ".npz" when the name lacks it).
        topk_ids: [L, T, k] integer expert ids (torch or numpy), -1 = no expert; stored as int32.
        topk_weights: optional [L, T, k] float weights; stored as float32.

    Raises:
        ValueError: wrong rank, dtype, ids below -1, an expert repeated within a token, or mismatched weights.
    """
    ids = _as_numpy(topk_ids)
    weights = None if topk_weights is None else _as_numpy(topk_weights)
    _check_trace(ids, weights, "save_trace", None)
    arrays = {"format_version": np.int32(TRACE_FORMAT_VERSION), "topk_ids": ids.astype(np.int32)}
    if weights is not None:
        arrays["topk_weights"] = weights.astype(np.float32)
    np.savez_compressed(path, **arrays)


def load_trace(path, *, num_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read a trace written by `save_trace` (or any .npz with a `topk_ids` [L, T, k] integer array).

    Args:
        path: the .npz file.
        num_experts: when given, ids must lie in [-1, num_experts).

    Returns:
        topk_ids [L, T, k] int32 (CPU), and topk_weights [L, T, k] float32 or None when the file has none.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not an .npz archive, missing `topk_ids`, unknown format version, or contents that break the rules
            of `save_trace` (the message names the file and the problem).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"routing trace {path!r} does not exist")
    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as error:
        raise ValueError(f"{path}: not a readable .npz routing trace ({error})") from error
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: expected an .npz archive with 'topk_ids', found a single array")
    with archive:
        if "topk_ids" not in archive.files:
            raise ValueError(f"{path}: no 'topk_ids' array (found {sorted(archive.files)})")
        version = int(archive["format_version"]) if "format_version" in archive.files else TRACE_FORMAT_VERSION
        if version > TRACE_FORMAT_VERSION:
            raise ValueError(
                f"{path}: trace format version {version} is newer than this reader ({TRACE_FORMAT_VERSION})"
            )
        ids = archive["topk_ids"]
        weights = archive["topk_weights"] if "topk_weights" in archive.files else None
    _check_trace(ids, weights, path, num_experts)
    ids_tensor = torch.from_numpy(ids.astype(np.int32))
    return ids_tensor, None if weights is None else torch.from_numpy(weights.astype(np.float32))


# --------------------------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------------------------


def _check_placement(num_experts: int, world_size: int) -> int:
    if world_size <= 0:
        raise ValueError(f"world_size must be > 0, got {world_size}")
    if num_experts % world_size:
        raise ValueError(f"num_experts E={num_experts} is not divisible by the EP size EP={world_size}")
    return num_experts // world_size


def _rank_hits(topk_ids: torch.Tensor, num_experts: int, world_size: int) -> torch.Tensor:
    """[T, EP] int64: how many of each token's experts live on each rank (0 where none; -1 ids count nowhere)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    ids = topk_ids.long()
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= num_experts):
        raise ValueError(
            f"topk_ids must lie in [-1, num_experts={num_experts}), got [{int(ids.min())}, {int(ids.max())}]"
        )
    num_local_experts = num_experts // world_size
    # Column EP collects the -1 sentinels and is dropped.
    dest = torch.where(ids >= 0, ids // num_local_experts, world_size)
    hits = torch.zeros(ids.shape[0], world_size + 1, dtype=torch.int64, device=ids.device)
    hits.scatter_add_(1, dest, torch.ones_like(dest))
    return hits[:, :world_size]


def _as_tensor(topk_ids) -> torch.Tensor:
    return topk_ids if isinstance(topk_ids, torch.Tensor) else torch.from_numpy(np.asarray(topk_ids))


def rank_matrix(topk_ids_per_rank: Sequence[torch.Tensor], num_experts: int) -> torch.Tensor:
    """Dispatch rows between ranks, with dedup.

    A token goes once to each rank that hosts any of its experts, however many of its experts live there.

    Args:
        topk_ids_per_rank: EP tensors (or arrays), the r-th [T_r, k] integer ids of rank r's tokens, -1 = no expert.
        num_experts: E, divisible by EP = len(topk_ids_per_rank).

    Returns:
        [EP, EP] int64 on the CPU: entry [src, dst] = rows rank src sends to rank dst (the diagonal is the rows that
        stay local).
    """
    world_size = len(topk_ids_per_rank)
    _check_placement(num_experts, world_size)
    matrix = torch.zeros(world_size, world_size, dtype=torch.int64)
    for source, ids in enumerate(topk_ids_per_rank):
        matrix[source] = (_rank_hits(_as_tensor(ids), num_experts, world_size) > 0).sum(dim=0).cpu()
    return matrix


@dataclass(frozen=True)
class RoutingStats:
    """Load of one MoE layer under expert parallelism. All tensors are int64 on the CPU.

    Attributes:
        num_experts: E.
        world_size: EP.
        tokens_per_rank: [EP] tokens each rank routes (its T_r).
        expert_counts: [E] (token, expert) pairs per expert; -1 ids ignored.
        rows_matrix: [EP, EP] dispatch rows src -> dst with dedup (a token goes once to each rank hosting any of its
            experts); the diagonal stays local.
        pairs_matrix: [EP, EP] the same without dedup: one row per (token, expert) pair.
        rows_received: [EP] rows each rank receives with dedup, local ones included (rows_matrix summed over src).
        pairs_received: [EP] rows received without dedup = (token, expert) pairs its experts compute: the GEMM load.
        row_bytes: bytes of one dispatched row (H * dtype_bytes), or None when hidden_size was not given.
        bytes_sent: [EP] dispatch bytes each rank sends to other ranks, with dedup; None without hidden_size.
            Combine moves the same rows back (src and dst swapped), so in the same dtype it costs the same bytes.
        bytes_received: [EP] dispatch bytes each rank receives from other ranks, with dedup; None without hidden_size.
        expert_imbalance: max / mean of expert_counts (1.0 = balanced; 0.0 when there are no pairs).
        rank_imbalance: max / mean of pairs_received, the per-rank GEMM load (0.0 when there are no pairs).
    """

    num_experts: int
    world_size: int
    tokens_per_rank: torch.Tensor
    expert_counts: torch.Tensor
    rows_matrix: torch.Tensor
    pairs_matrix: torch.Tensor
    rows_received: torch.Tensor
    pairs_received: torch.Tensor
    row_bytes: int | None
    bytes_sent: torch.Tensor | None
    bytes_received: torch.Tensor | None
    expert_imbalance: float
    rank_imbalance: float

    @property
    def remote_rows_sent(self) -> torch.Tensor:
        """[EP] rows each rank sends to other ranks, with dedup."""
        return self.rows_matrix.sum(dim=1) - self.rows_matrix.diagonal()

    @property
    def remote_pairs_sent(self) -> torch.Tensor:
        """[EP] rows each rank would send to other ranks without dedup."""
        return self.pairs_matrix.sum(dim=1) - self.pairs_matrix.diagonal()


def _max_over_mean(values: torch.Tensor) -> float:
    mean = values.double().mean().item() if values.numel() else 0.0
    return values.max().item() / mean if mean > 0 else 0.0


def routing_stats(
    topk_ids,
    num_experts: int,
    world_size: int,
    *,
    hidden_size: int | None = None,
    dtype_bytes: int = 2,
    rank_of_token: torch.Tensor | None = None,
) -> RoutingStats:
    """Expert and rank load of one layer.

    Args:
        topk_ids: either one [T, k] integer tensor for all tokens, or a list of EP per-rank [T_r, k] tensors (rank r's
            tokens); -1 = no expert.
        num_experts: E, divisible by world_size.
        world_size: EP; must equal len(topk_ids) when a list is given.
        hidden_size: H; when given, bytes_sent / bytes_received are filled in.
        dtype_bytes: bytes per element of a dispatched row (2 for bf16, 1 for fp8).
        rank_of_token: [T] int ranks owning each token, only for a single tensor. Default: the T tokens are split
            into EP contiguous blocks as evenly as possible (token t lives on rank t * EP // T).

    Returns:
        RoutingStats.

    Raises:
        ValueError: E % EP != 0, ids outside [-1, E), a list whose length is not world_size, a bad rank_of_token.
    """
    _check_placement(num_experts, world_size)
    if isinstance(topk_ids, (list, tuple)):
        if len(topk_ids) != world_size:
            raise ValueError(f"got {len(topk_ids)} per-rank topk_ids tensors for world_size={world_size}")
        if rank_of_token is not None:
            raise ValueError("rank_of_token only applies to a single topk_ids tensor, not a per-rank list")
        per_rank = [_as_tensor(ids) for ids in topk_ids]
    else:
        ids = _as_tensor(topk_ids)
        if ids.dim() != 2:
            raise ValueError(f"topk_ids must be [T, k], got shape {tuple(ids.shape)}")
        num_tokens = ids.shape[0]
        if rank_of_token is None:
            rank_of_token = torch.arange(num_tokens, device=ids.device) * world_size // max(num_tokens, 1)
        rank_of_token = _as_tensor(rank_of_token).to(ids.device).long()
        if rank_of_token.shape != (num_tokens,):
            raise ValueError(f"rank_of_token must be [T={num_tokens}], got shape {tuple(rank_of_token.shape)}")
        if num_tokens and (int(rank_of_token.min()) < 0 or int(rank_of_token.max()) >= world_size):
            raise ValueError(f"rank_of_token must lie in [0, world_size={world_size})")
        per_rank = [ids[rank_of_token == rank] for rank in range(world_size)]

    rows_matrix = torch.zeros(world_size, world_size, dtype=torch.int64)
    pairs_matrix = torch.zeros(world_size, world_size, dtype=torch.int64)
    expert_counts = torch.zeros(num_experts, dtype=torch.int64)
    for source, ids in enumerate(per_rank):
        hits = _rank_hits(ids, num_experts, world_size)
        rows_matrix[source] = (hits > 0).sum(dim=0).cpu()
        pairs_matrix[source] = hits.sum(dim=0).cpu()
        valid = ids[ids >= 0].long()
        expert_counts += torch.bincount(valid, minlength=num_experts).cpu()

    remote_rows = rows_matrix.clone()
    remote_rows.fill_diagonal_(0)
    row_bytes = None if hidden_size is None else int(hidden_size) * int(dtype_bytes)
    pairs_received = pairs_matrix.sum(dim=0)
    return RoutingStats(
        num_experts=num_experts,
        world_size=world_size,
        tokens_per_rank=torch.tensor([ids.shape[0] for ids in per_rank], dtype=torch.int64),
        expert_counts=expert_counts,
        rows_matrix=rows_matrix,
        pairs_matrix=pairs_matrix,
        rows_received=rows_matrix.sum(dim=0),
        pairs_received=pairs_received,
        row_bytes=row_bytes,
        bytes_sent=None if row_bytes is None else remote_rows.sum(dim=1) * row_bytes,
        bytes_received=None if row_bytes is None else remote_rows.sum(dim=0) * row_bytes,
        expert_imbalance=_max_over_mean(expert_counts),
        rank_imbalance=_max_over_mean(pairs_received),
    )
