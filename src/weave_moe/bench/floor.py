"""The physical floor of one EP MoE layer: the time no kernel can beat on the measured hardware.

A rank must (a) run its GEMMs, (b) move its bytes over NVLink and (c) read the weights of every local expert that
receives a row. With perfect overlap the rank takes the longest of the three, at the best measured rate of each; the
layer waits for its slowest rank:

    compute_s[r] = flops[r] / gemm_peak            flops[r] = pairs[r] * 6 * H * I
    comm_s[r]    = max(sent[r], received[r]) / peer_bandwidth
    weights_s[r] = experts_hit[r] * 3 * H * I * 2 B / hbm_read_bandwidth
    floor_s      = max over r of max(compute_s[r], comm_s[r], weights_s[r])

where
    pairs[r]       = (token, expert) pairs of ALL ranks whose expert lives on r (its own tokens included): every pair
                     costs one row of GEMM0 (2 * H * 2I FLOPs) and one row of GEMM1 (2 * I * H).
    sent[r]        = bytes r puts on NVLink: dispatch rows it sends + combine rows it sends back, times H * 2 B (bf16).
    received[r]    = the same for bytes arriving at r.
    experts_hit[r] = local experts of r with at least one pair: each one's w13 [2I, H] and w2 [H, I] must come from
                     HBM at least once per call (3 * H * I bf16 values); experts with no row need not be read.

Dedup: a token is dispatched ONCE to each other rank hosting any of its experts (however many of its k experts live
there), and that rank returns ONE combined row (the weighted sum over its local experts). So dispatch rows
r -> p = tokens of r with >= 1 expert on p, and combine rows p -> r are the same count. Rows for a token's own rank
never cross NVLink. Assumptions, stated once: the metadata (top-k ids and weights, ~k * 8 B per row) is ignored
(< 1% of a row of H >= 2048 bf16); a rank's sends to several peers share one outbound rate (NVSwitch: one link set per
GPU); NVLink is full duplex, so sending and receiving overlap; GEMMs, copies and weight reads do not slow each other;
the activations' HBM traffic is left out of the weights term (it is smaller than the weights at decode sizes, where
that term binds, and overlaps the GEMMs at prefill sizes).

The weights term binds at decode sizes: DeepSeek-V3 at EP=2 reads ~11 GB of expert weights per rank per call, 2.7 ms
at 4.24 TB/s, while its GEMMs at 128 tokens per rank need 0.11 ms at the GEMM peak.

The floor does not depend on the backend: an all-to-all that does not dedup moves more bytes than the floor counts,
which is part of what the floor exposes.

Shape legend: T = tokens on a rank, E = routed experts, E_local = E / EP, k = top-k, H = hidden, I = intermediate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from weave_moe.models import BYTES_PER_ELEMENT

__all__ = ["FloorConstants", "RankTraffic", "LayerFloor", "rank_traffic", "layer_floor", "FLOOR_TERMS"]

#: The floor's terms, in the order a tie is resolved.
FLOOR_TERMS = ("compute", "comm", "weights")


@dataclass(frozen=True)
class FloorConstants:
    """Hardware rates the floor uses, with where they came from.

    Defaults are the best figures measured on H200 SXM GPUs: the floor must be a lower bound, so it takes the fastest
    rate measured for each resource, not the rate a particular kernel reaches.

    Attributes:
        gemm_tflops: bf16 GEMM peak, TFLOP/s. 791 = dense torch bf16 GEMM 8192^3 (2 x H200, 2026-11-29;
            torch._grouped_mm measured 674 on MoE-like shapes, a persistent TMA Triton GEMM ~800 at 8192^3).
        peer_gbps: NVLink peer bandwidth per direction, GB/s (1e9 B/s), with both ranks writing to each other at the
            same time. 388 = copy-engine peer copy (2 x H200, 2026-11-29; a Triton peer-write kernel saturates at
            ~320-357).
        hbm_gbps: HBM read bandwidth, GB/s, for the weights term. 4240 = `torch.sum` over an 8 GiB bf16 tensor, median,
            one H200, 2026-12-01 (the specified 4.8 TB/s is not reached by any read we measured);
            `weave-moe calibrate --hbm` measures it on the machine at hand.
        source: where the numbers came from (written into every result file).
    """

    gemm_tflops: float = 791.0
    peer_gbps: float = 388.0
    source: str = (
        "measured on H200 SXM: gemm = dense torch bf16 GEMM 8192^3 (791 TFLOP/s, 2 x H200, 2026-11-29); "
        "peer = copy-engine peer copy, both directions at once (388 GB/s per direction, 2026-11-29); "
        "hbm = torch.sum over 8 GiB bf16 (4240 GB/s, one H200, 2026-12-01)"
    )
    hbm_gbps: float = 4240.0

    def __post_init__(self) -> None:
        if self.gemm_tflops <= 0 or self.peer_gbps <= 0 or self.hbm_gbps <= 0:
            raise ValueError(f"FloorConstants rates must be > 0, got {self.gemm_tflops} TFLOP/s, "
                             f"{self.peer_gbps} GB/s, {self.hbm_gbps} GB/s HBM")

    @classmethod
    def from_profile(cls, profile) -> "FloorConstants":
        """The rates of a `HardwareProfile`: the peaks of its GEMM and NVLink curves (its own kernels at their best,
        so a looser floor than the defaults when those kernels trail torch) and its measured HBM read bandwidth (the
        default where the profile predates that field, `hbm_read_gbps` = 0)."""
        default = cls()
        hbm = profile.hbm_read_gbps or default.hbm_gbps
        hbm_source = (f"hbm from profile {profile.name}" if profile.hbm_read_gbps
                      else f"hbm {default.hbm_gbps} GB/s default (profile {profile.name} has none)")
        return cls(gemm_tflops=float(profile.gemm_peak_tflops), peer_gbps=float(profile.peer_bandwidth_gbps),
                   hbm_gbps=float(hbm),
                   source=f"gemm and peer peaks of profile {profile.name}; {hbm_source}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RankTraffic:
    """What one layer asks of each rank, after dedup. Every array is [EP] int64, indexed by rank.

    Attributes:
        pairs: (token, expert) pairs computed on the rank (its experts' rows, all source ranks).
        experts_hit: local experts of the rank with at least one pair (their weights must be read).
        dispatch_sent / dispatch_received: token rows the rank sends to / receives from other ranks in dispatch.
        combine_sent / combine_received: combined rows it sends back / receives in combine (the transpose of dispatch).
    """

    pairs: np.ndarray
    dispatch_sent: np.ndarray
    dispatch_received: np.ndarray
    combine_sent: np.ndarray
    combine_received: np.ndarray
    experts_hit: np.ndarray | None = None

    @property
    def world_size(self) -> int:
        return int(self.pairs.shape[0])

    def bytes_sent(self, hidden_size: int) -> np.ndarray:
        return (self.dispatch_sent + self.combine_sent) * hidden_size * BYTES_PER_ELEMENT

    def bytes_received(self, hidden_size: int) -> np.ndarray:
        return (self.dispatch_received + self.combine_received) * hidden_size * BYTES_PER_ELEMENT


def rank_traffic(topk_ids_per_rank, num_experts: int) -> RankTraffic:
    """Per-rank GEMM rows and deduplicated NVLink rows of one layer.

    Args:
        topk_ids_per_rank: EP arrays/tensors, entry r = rank r's [T_r, k] global expert ids (-1 = no expert).
        num_experts: E; rank r owns experts [r * E / EP, (r + 1) * E / EP).
    """
    world_size = len(topk_ids_per_rank)
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by EP={world_size}")
    num_local_experts = num_experts // world_size
    expert_pairs = np.zeros(num_experts, dtype=np.int64)
    # rows[src, dst] = tokens of src with >= 1 expert on dst
    rows = np.zeros((world_size, world_size), dtype=np.int64)
    for src, ids in enumerate(topk_ids_per_rank):
        ids = _as_numpy(ids)
        valid = ids >= 0
        owner = np.where(valid, ids // num_local_experts, world_size)  # world_size = "no expert" bucket
        expert_pairs += np.bincount(ids[valid], minlength=num_experts)[:num_experts]
        if ids.shape[0] == 0:
            continue
        hits = np.zeros((ids.shape[0], world_size + 1), dtype=bool)
        np.put_along_axis(hits, owner, True, axis=1)
        rows[src] = hits[:, :world_size].sum(axis=0)
    remote = rows.copy()
    np.fill_diagonal(remote, 0)
    per_rank = expert_pairs.reshape(world_size, num_local_experts)
    return RankTraffic(
        pairs=per_rank.sum(axis=1),
        dispatch_sent=remote.sum(axis=1),
        dispatch_received=remote.sum(axis=0),
        combine_sent=remote.sum(axis=0),
        combine_received=remote.sum(axis=1),
        experts_hit=(per_rank > 0).sum(axis=1),
    )


def _as_numpy(ids) -> np.ndarray:
    if hasattr(ids, "detach"):
        ids = ids.detach().cpu().numpy()
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {ids.shape}")
    return ids.astype(np.int64, copy=False)


@dataclass(frozen=True)
class LayerFloor:
    """The floor of one layer and the per-rank terms behind it (seconds, FLOPs, bytes; lists indexed by rank)."""

    floor_s: float
    bound: str  # "compute", "comm" or "weights": which term set the floor on the slowest rank (first one on a tie)
    slowest_rank: int
    compute_s: list = field(default_factory=list)
    comm_s: list = field(default_factory=list)
    flops: list = field(default_factory=list)
    bytes_sent: list = field(default_factory=list)
    bytes_received: list = field(default_factory=list)
    weights_s: list = field(default_factory=list)  # per rank: expert weights it must read once, at HBM bandwidth

    @property
    def weights_floor_s(self) -> float:
        """The largest weights term over ranks (0 when unknown); see the module docstring."""
        return float(max(self.weights_s)) if self.weights_s else 0.0

    @property
    def total_flops(self) -> float:
        return float(sum(self.flops))

    @property
    def total_bytes_sent(self) -> float:
        return float(sum(self.bytes_sent))

    def to_dict(self) -> dict:
        return asdict(self)


def layer_floor(traffic: RankTraffic, hidden_size: int, intermediate_size: int,
                constants: FloorConstants = FloorConstants()) -> LayerFloor:
    """max over ranks of max(FLOPs / GEMM peak, max(bytes sent, received) / peer bandwidth, weights / HBM read)."""
    flops = traffic.pairs.astype(np.float64) * 6.0 * hidden_size * intermediate_size
    sent = traffic.bytes_sent(hidden_size).astype(np.float64)
    received = traffic.bytes_received(hidden_size).astype(np.float64)
    compute_s = flops / (constants.gemm_tflops * 1e12)
    comm_s = np.maximum(sent, received) / (constants.peer_gbps * 1e9)
    weights_s = np.zeros_like(compute_s)
    if traffic.experts_hit is not None:
        bytes_per_expert = 3.0 * hidden_size * intermediate_size * BYTES_PER_ELEMENT  # w13 [2I, H] + w2 [H, I]
        weight_bytes = traffic.experts_hit.astype(np.float64) * bytes_per_expert
        weights_s = weight_bytes / (constants.hbm_gbps * 1e9)
    terms = np.stack([compute_s, comm_s, weights_s])  # [3, EP]: the order of FLOOR_TERMS
    per_rank = terms.max(axis=0)
    slowest = int(np.argmax(per_rank)) if per_rank.size else 0
    return LayerFloor(
        floor_s=float(per_rank.max()) if per_rank.size else 0.0,
        bound=FLOOR_TERMS[int(np.argmax(terms[:, slowest]))] if per_rank.size else "compute",
        slowest_rank=slowest,
        compute_s=compute_s.tolist(),
        comm_s=comm_s.tolist(),
        flops=flops.tolist(),
        bytes_sent=sent.tolist(),
        bytes_received=received.tolist(),
        weights_s=weights_s.tolist(),
    )
