"""The physical floor of one EP MoE layer: the time no kernel can beat on the measured hardware.

A rank must (a) run its GEMMs and (b) move its bytes over NVLink. With perfect overlap the rank takes the longer of
the two, at the best measured rate of each; the layer waits for its slowest rank:

    compute_s[r] = flops[r] / gemm_peak            flops[r] = pairs[r] * 6 * H * I
    comm_s[r]    = max(sent[r], received[r]) / peer_bandwidth
    floor_s      = max over r of max(compute_s[r], comm_s[r])

where
    pairs[r]     = (token, expert) pairs of ALL ranks whose expert lives on r (its own tokens included): every pair
                   costs one row of GEMM0 (2 * H * 2I FLOPs) and one row of GEMM1 (2 * I * H).
    sent[r]      = bytes r puts on NVLink: dispatch rows it sends + combine rows it sends back, times H * 2 B (bf16).
    received[r]  = the same for bytes arriving at r.

Dedup: a token is dispatched ONCE to each other rank hosting any of its experts (however many of its k experts live
there), and that rank returns ONE combined row (the weighted sum over its local experts). So dispatch rows
r -> p = tokens of r with >= 1 expert on p, and combine rows p -> r are the same count. Rows for a token's own rank
never cross NVLink. Assumptions, stated once: the metadata (top-k ids and weights, ~k * 8 B per row) is ignored
(< 1% of a row of H >= 2048 bf16); a rank's sends to several peers share one outbound rate (NVSwitch: one link set per
GPU); NVLink is full duplex, so sending and receiving overlap; GEMMs and copies do not slow each other.

The floor does not depend on the backend: an all-to-all that does not dedup moves more bytes than the floor counts,
which is part of what the floor exposes.

A third bound, reported beside the floor (`weights_floor_s`, the bench's `floor_weights_ms`) and not part of it:
every local expert that receives at least one row must have its weights read from HBM at least once,

    weights_s[r] = experts_hit[r] * 3 * H * I * 2 B / hbm_bandwidth

At decode sizes this dominates (DeepSeek-V3 at EP=2 reads ~11 GB of expert weights per rank per call, ~2.3 ms at the
H200's 4.8 TB/s), so the two-term floor alone is far below what any kernel can reach there.

Shape legend: T = tokens on a rank, E = routed experts, E_local = E / EP, k = top-k, H = hidden, I = intermediate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = ["FloorConstants", "RankTraffic", "LayerFloor", "rank_traffic", "layer_floor"]

#: bf16 bytes per element of a hidden row.
BYTES_PER_ELEMENT = 2


@dataclass(frozen=True)
class FloorConstants:
    """Hardware rates the floor uses, with where they came from.

    Defaults are the best measured H200 figures in shared/PLATFORM.md (2 x H200 SXM, measured 2026-11-29): the floor
    must be a lower bound, so it takes the fastest rate measured for each resource, not the rate a particular kernel
    reaches.

    Attributes:
        gemm_tflops: bf16 GEMM peak, TFLOP/s. 791 = dense torch bf16 GEMM 8192^3 (torch._grouped_mm measured 674 on
            MoE-like shapes; a persistent TMA Triton GEMM ~800 at 8192^3, 690 at 4096^3).
        peer_gbps: NVLink peer bandwidth per direction, GB/s (1e9 B/s), with both ranks writing to each other at the
            same time. 388 = copy-engine peer copy (a Triton peer-write kernel saturates at ~320-357).
        source: where the two numbers came from (written into every result file).
    """

    gemm_tflops: float = 791.0
    peer_gbps: float = 388.0
    source: str = (
        "shared/PLATFORM.md 2026-11-29, 2 x H200 SXM: gemm = dense torch bf16 GEMM 8192^3 (791 TFLOP/s); "
        "peer = copy-engine peer copy, both directions at once (388 GB/s per direction)"
    )
    #: HBM read bandwidth for the weights bound, GB/s: the H200's specified 4.8 TB/s (not measured here; no kernel
    #: reads faster, so the bound stays a lower bound).
    hbm_gbps: float = 4800.0

    def __post_init__(self) -> None:
        if self.gemm_tflops <= 0 or self.peer_gbps <= 0 or self.hbm_gbps <= 0:
            raise ValueError(f"FloorConstants rates must be > 0, got {self.gemm_tflops} TFLOP/s, {self.peer_gbps} GB/s, "
                             f"{self.hbm_gbps} GB/s HBM")

    @classmethod
    def from_profile(cls, profile) -> "FloorConstants":
        """Rates from a `HardwareProfile` when it carries them; the PLATFORM.md defaults for whatever it lacks.

        Accepted attribute names (first found wins): GEMM peak `gemm_peak_tflops`, `peak_tflops`, `gemm_tflops`;
        peer bandwidth `peer_bandwidth_gbps`, `nvlink_gbps`, `peer_gbps`, `comm_peak_gbps`, `comm_gbps`. A curve
        (HardwareProfile's `gemm_tflops` / `comm_gbps` against SM count) contributes its largest point: the profile's
        own kernels at their best, so this floor is looser than the PLATFORM.md one when those kernels trail torch.
        """
        default = cls()
        gemm = _first_attribute(profile, ("gemm_peak_tflops", "peak_tflops", "gemm_tflops"))
        peer = _first_attribute(profile, ("peer_bandwidth_gbps", "nvlink_gbps", "peer_gbps", "comm_peak_gbps",
                                          "comm_gbps"))
        if gemm is None and peer is None:
            return default
        name = getattr(profile, "name", type(profile).__name__)
        parts = [
            f"gemm from profile {name}" if gemm is not None else "gemm from PLATFORM.md default",
            f"peer from profile {name}" if peer is not None else "peer from PLATFORM.md default",
        ]
        return cls(
            gemm_tflops=float(gemm if gemm is not None else default.gemm_tflops),
            peer_gbps=float(peer if peer is not None else default.peer_gbps),
            source="; ".join(parts),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def _first_attribute(obj, names):
    """The first positive number among `names`; a curve (tuple of numbers, e.g. rate vs SM count) gives its peak."""
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, (int, float)) for v in value):
            value = max(value)
        if isinstance(value, (int, float)) and value > 0:
            return value
    return None


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
    bound: str  # "compute" or "comm": which term set the floor on the slowest rank
    slowest_rank: int
    compute_s: list = field(default_factory=list)
    comm_s: list = field(default_factory=list)
    flops: list = field(default_factory=list)
    bytes_sent: list = field(default_factory=list)
    bytes_received: list = field(default_factory=list)
    weights_s: list = field(default_factory=list)  # per rank: expert weights it must read once, at HBM bandwidth

    @property
    def weights_floor_s(self) -> float:
        """The weights bound of the slowest rank (0 when unknown); see the module docstring."""
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
    """max over ranks of max(FLOPs / GEMM peak, max(bytes sent, bytes received) / peer bandwidth)."""
    flops = traffic.pairs.astype(np.float64) * 6.0 * hidden_size * intermediate_size
    sent = traffic.bytes_sent(hidden_size).astype(np.float64)
    received = traffic.bytes_received(hidden_size).astype(np.float64)
    compute_s = flops / (constants.gemm_tflops * 1e12)
    comm_s = np.maximum(sent, received) / (constants.peer_gbps * 1e9)
    per_rank = np.maximum(compute_s, comm_s)
    weights_s = []
    if traffic.experts_hit is not None:
        weight_bytes = traffic.experts_hit.astype(np.float64) * 3.0 * hidden_size * intermediate_size * BYTES_PER_ELEMENT
        weights_s = (weight_bytes / (constants.hbm_gbps * 1e9)).tolist()
    slowest = int(np.argmax(per_rank)) if per_rank.size else 0
    return LayerFloor(
        floor_s=float(per_rank.max()) if per_rank.size else 0.0,
        bound="compute" if per_rank.size == 0 or compute_s[slowest] >= comm_s[slowest] else "comm",
        slowest_rank=slowest,
        compute_s=compute_s.tolist(),
        comm_s=comm_s.tolist(),
        flops=flops.tolist(),
        bytes_sent=sent.tolist(),
        bytes_received=received.tolist(),
        weights_s=weights_s,
    )
