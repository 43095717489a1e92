"""What one layer asks of one rank, known as soon as routing is: rows to send and receive, rows per local expert.

Shape legend: T = tokens on a rank, E = routed experts, E_local = E / EP, k = top-k, H = hidden, I = intermediate,
K = chunk count (1..MAX_CHUNKS).

Conventions the megakernel shares (change both or neither):
- Expert placement: rank r owns global experts [r * E_local, (r + 1) * E_local).
- Dedup: a token is dispatched ONCE to each rank that hosts any of its experts, however many of its k experts live
  there; the rank's own rows are copied locally (HBM), never over NVLink. Combine returns ONE row per (token, rank)
  pair (the weighted sum over that rank's experts), so combine traffic is dispatch traffic transposed.
- Chunks: each source rank's T_r tokens are split into K contiguous parts, part j = tokens
  [j * T_r // K, (j + 1) * T_r // K); chunk j of a receiving rank = part j of every source. Rows of expert e in chunk
  j are the (token, e) pairs whose token lies in part j of its source. Without per-token data (`from_counts`) every
  count n is split the same way: chunk j gets (j + 1) * n // K - j * n // K.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from weave_moe.models import BYTES_PER_ELEMENT, MoESpec

__all__ = ["Workload", "ChunkSplit", "MAX_CHUNKS"]

#: Largest chunk count K the planner and the kernel consider.
MAX_CHUNKS = 8


@dataclass(frozen=True)
class ChunkSplit:
    """The rows of one rank split into K chunks.

    Attributes:
        expert_rows: [K, E_local] int64, (token, expert) pairs of each local expert in each chunk (GEMM rows).
        send_remote_rows: [K] int64, dispatch rows this rank sends to other ranks, by the chunk of its own tokens.
        recv_remote_rows: [K] int64, dispatch rows this rank receives from other ranks, by chunk.
        local_rows: [K] int64, this rank's own tokens with an expert on this rank (copied locally), by chunk.
        exact: True when counted from per-token routing, False when split evenly from totals.
    """

    expert_rows: np.ndarray
    send_remote_rows: np.ndarray
    recv_remote_rows: np.ndarray
    local_rows: np.ndarray
    exact: bool

    @property
    def num_chunks(self) -> int:
        return int(self.expert_rows.shape[0])


def even_split(counts, num_chunks: int) -> np.ndarray:
    """Split integer counts [...] into [num_chunks, ...] parts the way chunks split tokens: (j+1)*n//K - j*n//K."""
    counts = np.asarray(counts, dtype=np.int64)
    j = np.arange(num_chunks + 1, dtype=np.int64).reshape((-1,) + (1,) * counts.ndim)
    bounds = j * counts // num_chunks
    return np.diff(bounds, axis=0)


@dataclass(frozen=True, eq=False)
class Workload:
    """One rank's share of one MoE layer (see the module docstring for the dedup and chunk conventions).

    Build it with `from_routing` (every rank's top-k ids) or `from_counts` (counts computed elsewhere, e.g. on the
    GPU). Arrays are read-only int64.

    Attributes:
        spec: the layer shape.
        world_size: EP.
        rank: the rank this workload belongs to.
        num_tokens: T of this rank (rows of its output).
        send_rows: [EP] dedup token rows this rank sends to each rank (entry `rank` = its local rows).
        recv_rows: [EP] dedup token rows this rank receives from each rank (entry `rank` = its local rows).
        expert_rows: [E_local] (token, expert) pairs per local expert, all sources: the GEMM rows.
        chunks: exact `ChunkSplit` per K, for the K values counted from routing (others are split evenly).
    """

    spec: MoESpec
    world_size: int
    rank: int
    num_tokens: int
    send_rows: np.ndarray
    recv_rows: np.ndarray
    expert_rows: np.ndarray
    chunks: dict = field(default_factory=dict, repr=False)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_counts(
        cls,
        spec: MoESpec,
        world_size: int,
        rank: int,
        send_rows: Sequence[int],
        recv_rows: Sequence[int],
        expert_rows: Sequence[int],
        num_tokens: int | None = None,
    ) -> "Workload":
        """A workload from counts (the cheap path: the GPU counts, the host plans).

        Args:
            spec: layer shape; E must be divisible by `world_size`.
            world_size: EP.
            rank: this rank, in [0, EP).
            send_rows: [EP] dedup rows this rank sends to each rank, itself included.
            recv_rows: [EP] dedup rows this rank receives from each rank, itself included (recv_rows[rank] ==
                send_rows[rank]).
            expert_rows: [E_local] pairs per local expert.
            num_tokens: T of this rank; defaults to max(send_rows), a lower bound.
        """
        _check_world(spec, world_size, rank)
        send = _as_counts(send_rows, world_size, "send_rows")
        recv = _as_counts(recv_rows, world_size, "recv_rows")
        experts = _as_counts(expert_rows, spec.num_experts // world_size, "expert_rows")
        if send[rank] != recv[rank]:
            raise ValueError(f"send_rows[{rank}]={send[rank]} and recv_rows[{rank}]={recv[rank]} must be equal "
                             "(both count this rank's own tokens with a local expert)")
        num_pairs, num_recv = int(experts.sum()), int(recv.sum())
        if not num_recv <= num_pairs <= spec.top_k * num_recv:
            raise ValueError(f"sum(expert_rows)={num_pairs} must lie in [sum(recv_rows), top_k * sum(recv_rows)] = "
                             f"[{num_recv}, {spec.top_k * num_recv}]")
        if num_tokens is None:
            num_tokens = int(send.max()) if send.size else 0
        if num_tokens < int(send.max(initial=0)):
            raise ValueError(f"num_tokens={num_tokens} is smaller than max(send_rows)={int(send.max())}")
        return cls(spec, world_size, rank, int(num_tokens), send, recv, experts)

    @classmethod
    def from_routing(
        cls,
        spec: MoESpec,
        topk_ids_per_rank: Sequence,
        rank: int,
        chunk_counts: Iterable[int] | None = None,
    ) -> "Workload":
        """A workload counted from every rank's routing (each rank knows all counts after the counts exchange).

        Args:
            spec: layer shape; E must be divisible by EP = len(topk_ids_per_rank).
            topk_ids_per_rank: EP entries, entry r = rank r's topk_ids [T_r, k] (torch tensor on any device, or
                numpy), global expert ids in [0, E), -1 = no expert.
            rank: the rank whose workload to build.
            chunk_counts: K values (each in 1..MAX_CHUNKS) for which per-chunk rows are counted exactly from the
                token order; other K fall back to an even split of the totals.
        """
        world_size = len(topk_ids_per_rank)
        _check_world(spec, world_size, rank)
        num_local_experts = spec.num_experts // world_size
        ks = sorted({int(k) for k in (chunk_counts or ())})
        if any(not 1 <= k <= MAX_CHUNKS for k in ks):
            raise ValueError(f"chunk_counts must lie in 1..{MAX_CHUNKS}, got {ks}")

        send = np.zeros(world_size, dtype=np.int64)
        recv = np.zeros(world_size, dtype=np.int64)
        experts = np.zeros(num_local_experts, dtype=np.int64)
        per_k = {k: _ChunkCounter(k, num_local_experts) for k in ks}
        num_tokens = 0
        for source, ids in enumerate(topk_ids_per_rank):
            ids = _as_ids(ids, spec)
            tokens = ids.shape[0]
            if source == rank:
                num_tokens = tokens
            dest = np.where(ids >= 0, ids // num_local_experts, -1)
            hits = np.zeros((tokens, world_size), dtype=bool)
            rows_idx, cols_idx = np.nonzero(dest >= 0)
            hits[rows_idx, dest[rows_idx, cols_idx]] = True
            if source == rank:
                send[:] = hits.sum(axis=0)
            recv[source] = int(hits[:, rank].sum())
            local_mask = dest == rank
            local_expert = ids[local_mask] - rank * num_local_experts
            experts += np.bincount(local_expert, minlength=num_local_experts)
            for k, counter in per_k.items():
                counter.add(source, rank, tokens, hits, local_mask, local_expert)
        workload = cls(spec, world_size, rank, num_tokens, _frozen(send), _frozen(recv), _frozen(experts))
        for k, counter in per_k.items():
            workload.chunks[k] = counter.result()
        return workload

    # ---- totals -------------------------------------------------------------------------------------------------
    @property
    def num_local_experts(self) -> int:
        return self.spec.num_experts // self.world_size

    @property
    def row_bytes(self) -> int:
        """Bytes of one hidden row (bf16)."""
        return self.spec.hidden_size * BYTES_PER_ELEMENT

    @property
    def _totals(self) -> tuple[int, int, int, int]:
        """(local rows, sum(send_rows), sum(recv_rows), sum(expert_rows)) as Python ints, computed once."""
        totals = self._cache.get("totals")
        if totals is None:
            totals = (int(self.send_rows[self.rank]), int(self.send_rows.sum()), int(self.recv_rows.sum()),
                      int(self.expert_rows.sum()))
            self._cache["totals"] = totals
        return totals

    @property
    def local_rows(self) -> int:
        """This rank's own tokens with an expert here: copied in HBM, not sent."""
        return self._totals[0]

    @property
    def dispatch_send_rows(self) -> int:
        """Remote rows sent in dispatch (dedup)."""
        return self._totals[1] - self._totals[0]

    @property
    def dispatch_recv_rows(self) -> int:
        """Remote rows received in dispatch (dedup)."""
        return self._totals[2] - self._totals[0]

    @property
    def dispatch_send_bytes(self) -> int:
        return self.dispatch_send_rows * self.row_bytes

    @property
    def dispatch_recv_bytes(self) -> int:
        return self.dispatch_recv_rows * self.row_bytes

    @property
    def combine_send_bytes(self) -> int:
        """Combine sends one row back per received remote token: dispatch received, transposed."""
        return self.dispatch_recv_bytes

    @property
    def combine_recv_bytes(self) -> int:
        return self.dispatch_send_bytes

    @property
    def num_pairs(self) -> int:
        """GEMM rows on this rank: (token, local expert) pairs from every source."""
        return self._totals[3]

    @property
    def flops(self) -> int:
        """Useful GEMM FLOPs (no tile padding): pairs * (2*H*2I + 2*I*H)."""
        return self.num_pairs * self.spec.flops_per_pair()

    @property
    def reduce_rows(self) -> int:
        """Rows the final reduce reads: one per (own token, rank hosting one of its experts), itself included."""
        return self._totals[1]

    # ---- chunks and tiles ---------------------------------------------------------------------------------------
    def chunk_split(self, num_chunks: int) -> ChunkSplit:
        """Rows split into `num_chunks` chunks: exact if counted from routing, else an even split of the totals."""
        if not 1 <= num_chunks <= MAX_CHUNKS:
            raise ValueError(f"num_chunks must lie in 1..{MAX_CHUNKS}, got {num_chunks}")
        if num_chunks in self.chunks:
            return self.chunks[num_chunks]
        key = ("split", num_chunks)
        if key not in self._cache:
            self._cache[key] = ChunkSplit(
                expert_rows=even_split(self.expert_rows, num_chunks),
                send_remote_rows=even_split(self.dispatch_send_rows, num_chunks),
                recv_remote_rows=even_split(self.dispatch_recv_rows, num_chunks),
                local_rows=even_split(self.local_rows, num_chunks),
                exact=False,
            )
        return self._cache[key]

    def m_tiles(self, block_m: int) -> np.ndarray:
        """[MAX_CHUNKS] float64: entry K-1 = sum over chunks and experts of ceil(rows / BLOCK_M) for K chunks.

        Partial M tiles count as whole ones (the kernel pads them), which is what makes large K cost more. Computed
        for every K at once (the planner's hot path); exact chunk counts replace the even split where present.
        """
        key = ("m_tiles", block_m)
        if key not in self._cache:
            # float floor is exact here: n * j / K is correctly rounded and n * K < 2**40 (see even_split)
            rows = self.expert_rows.astype(np.float64)
            chunk_rows = np.floor(rows * _SPLIT_HI_OVER_K) - np.floor(rows * _SPLIT_LO_OVER_K)  # [sum(1..8), E_local]
            tiles = np.ceil(chunk_rows * (1.0 / block_m)).sum(axis=1)
            out = np.add.reduceat(tiles, _SPLIT_OFFSETS)
            for k, split in self.chunks.items():
                out[k - 1] = float(((split.expert_rows + block_m - 1) // block_m).sum())
            out.flags.writeable = False
            self._cache[key] = out
        return self._cache[key]

    def gemm_tiles(self, num_chunks: int, profile) -> tuple[int, int]:
        """(GEMM0 tiles, GEMM1 tiles) for `num_chunks` chunks and the profile's tile shape."""
        m = int(self.m_tiles(profile.block_m)[num_chunks - 1])
        n0 = -(-self.spec.intermediate_size // profile.block_n0)
        n1 = -(-self.spec.hidden_size // profile.block_n1)
        return m * n0, m * n1

    def summary(self) -> dict:
        return {
            "rank": self.rank, "world_size": self.world_size, "num_tokens": self.num_tokens,
            "dispatch_send_rows": self.dispatch_send_rows, "dispatch_recv_rows": self.dispatch_recv_rows,
            "local_rows": self.local_rows, "num_pairs": self.num_pairs,
            "max_expert_rows": int(self.expert_rows.max(initial=0)),
        }


# Every (K, j) pair with j < K, K = 1..MAX_CHUNKS, as columns: chunk j of K holds rows [n*j//K, n*(j+1)//K).
_SPLIT_K = np.array([k for k in range(1, MAX_CHUNKS + 1) for _ in range(k)], dtype=np.int64)[:, None]
_SPLIT_LO = np.array([j for k in range(1, MAX_CHUNKS + 1) for j in range(k)], dtype=np.int64)[:, None]
_SPLIT_HI = _SPLIT_LO + 1
_SPLIT_HI_OVER_K = _SPLIT_HI / _SPLIT_K
_SPLIT_LO_OVER_K = _SPLIT_LO / _SPLIT_K
_SPLIT_OFFSETS = np.array([k * (k - 1) // 2 for k in range(1, MAX_CHUNKS + 1)], dtype=np.int64)


class _ChunkCounter:
    """Accumulates exact per-chunk counts for one K while `from_routing` walks the source ranks."""

    def __init__(self, num_chunks: int, num_local_experts: int) -> None:
        self.num_chunks = num_chunks
        self.num_local_experts = num_local_experts
        self.expert_rows = np.zeros((num_chunks, num_local_experts), dtype=np.int64)
        self.send_remote = np.zeros(num_chunks, dtype=np.int64)
        self.recv_remote = np.zeros(num_chunks, dtype=np.int64)
        self.local = np.zeros(num_chunks, dtype=np.int64)

    def add(self, source, rank, tokens, hits, local_mask, local_expert) -> None:
        bounds = np.arange(self.num_chunks + 1, dtype=np.int64) * tokens // self.num_chunks
        # chunk of each token: the last part whose start is <= t (empty parts are skipped over)
        chunk_of_token = np.searchsorted(bounds, np.arange(tokens), side="right") - 1
        pair_chunk = np.broadcast_to(chunk_of_token[:, None], local_mask.shape)[local_mask]
        flat = pair_chunk * self.num_local_experts + local_expert
        self.expert_rows += np.bincount(flat, minlength=self.num_chunks * self.num_local_experts).reshape(
            self.num_chunks, self.num_local_experts)
        hit_here = np.bincount(chunk_of_token[hits[:, rank]], minlength=self.num_chunks)
        if source == rank:
            self.local += hit_here
            remote_hits = hits.sum(axis=1) - hits[:, rank]
            self.send_remote += np.bincount(chunk_of_token, weights=remote_hits, minlength=self.num_chunks).astype(
                np.int64)
        else:
            self.recv_remote += hit_here

    def result(self) -> ChunkSplit:
        return ChunkSplit(_frozen(self.expert_rows), _frozen(self.send_remote), _frozen(self.recv_remote),
                          _frozen(self.local), exact=True)


def _check_world(spec: MoESpec, world_size: int, rank: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if spec.num_experts % world_size:
        raise ValueError(f"num_experts={spec.num_experts} is not divisible by EP={world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, {world_size})")


def _as_counts(values, length: int, name: str) -> np.ndarray:
    array = np.asarray(values.cpu() if hasattr(values, "cpu") else values, dtype=np.int64).reshape(-1)
    if array.shape != (length,):
        raise ValueError(f"{name} must have {length} entries, got shape {array.shape}")
    if (array < 0).any():
        raise ValueError(f"{name} must be >= 0, got {array.tolist()}")
    return _frozen(array)


def _as_ids(ids, spec: MoESpec) -> np.ndarray:
    if hasattr(ids, "detach"):
        ids = ids.detach().cpu().numpy()
    ids = np.asarray(ids).astype(np.int64, copy=False)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {ids.shape}")
    if ids.size and (ids.min() < -1 or ids.max() >= spec.num_experts):
        raise ValueError(f"topk_ids must lie in [-1, {spec.num_experts}), got [{ids.min()}, {ids.max()}]")
    return ids


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array, dtype=np.int64)
    array.flags.writeable = False
    return array
