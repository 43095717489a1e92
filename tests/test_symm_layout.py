"""The symm backend's host code (bucketing, packing, in-place expert stage, final weighted sum) on the CPU, at EP = 2
and 4 over gloo, with PyTorch's NVSHMEM ops stood in for by a gloo emulation of their documented semantics:

  all_to_all_vdev_2d(send, recv, in_splits [EP*B], out_splits_offsets [2, EP*B]): send holds chunks ordered by
    (destination rank, bucket) at the prefix sums of in_splits; recv gets them ordered by (bucket, source rank), with
    the received splits and their exclusive-prefix offsets (major_align=1) in out_splits_offsets.
  all_to_all_vdev_2d_offset(send, recv, in_splits_offsets, out_splits_offsets): the reverse; send's chunk (bucket b,
    rank s) at in_splits_offsets[:, b*EP + s] goes back to rank s, which stores its chunks ordered by (source rank,
    bucket) at exclusive prefix offsets.

So these tests check this backend's layout math against the reference, not NVSHMEM (tests/test_gpu_baselines.py runs
the real ops). Buffers are poisoned (NaN bytes) first, so a row read before being written shows up as NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from weave_moe import routing
from weave_moe.backends.symm import SymmBackend
from weave_moe.models import MoESpec
from weave_moe.reference import DEFAULT_TOLERANCE, reference_moe
from weave_moe.testing import make_experts, run_distributed


class _StubSymmetricMemory:
    """Plain tensors for symm_mem.empty; rendezvous and group setup do nothing."""

    @staticmethod
    def empty(*size, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    @staticmethod
    def rendezvous(tensor, group_name):
        return None

    @staticmethod
    def enable_symm_mem_for_group(group_name):
        return None


class EmulatedSymm(SymmBackend):
    """SymmBackend with NVSHMEM replaced by gloo all-to-alls (host syncs: a test stand-in, not a baseline)."""

    def _symmetric_memory(self, device):
        return _StubSymmetricMemory

    def _exchange_rows(self, chunks_for_rank: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """chunks_for_rank[r] = row chunks for rank r -> received[s] = the chunks rank s sent here."""
        world_size = self.world_size
        counts = torch.tensor([[len(chunk) for chunk in chunks] for chunks in chunks_for_rank], dtype=torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send = torch.cat([chunk for chunks in chunks_for_rank for chunk in chunks])
        recv = send.new_empty(int(recv_counts.sum()), send.shape[1])
        dist.all_to_all_single(recv, send, output_split_sizes=recv_counts.sum(1).tolist(),
                               input_split_sizes=counts.sum(1).tolist(), group=self.group)
        received, start = [], 0
        for source in range(world_size):
            received.append([])
            for count in recv_counts[source].tolist():
                received[source].append(recv[start : start + count])
                start += count
        return received

    def _all_to_all_2d(self, send, recv, in_splits, out_splits_offsets) -> None:
        world_size, buckets = self.world_size, self.num_buckets
        splits = in_splits.tolist()
        starts = [sum(splits[:i]) for i in range(len(splits))]
        chunks = [[send[starts[r * buckets + b] : starts[r * buckets + b] + splits[r * buckets + b]]
                   for b in range(buckets)] for r in range(world_size)]
        received = self._exchange_rows(chunks)
        offset = 0
        for b in range(buckets):
            bucket_start = offset
            for source in range(world_size):
                chunk = received[source][b]
                recv[offset : offset + len(chunk)] = chunk
                out_splits_offsets[0, b * world_size + source] = len(chunk)
                out_splits_offsets[1, b * world_size + source] = offset
                offset += len(chunk)
            if offset == bucket_start:  # the op gives an empty bucket one row (max(aligned length, major_align))
                recv[offset] = torch.randint(0, 256, (recv.shape[1],), dtype=torch.uint8)  # stale bytes
                offset += 1

    def _all_to_all_2d_offset(self, send, recv, in_splits_offsets, out_splits_offsets) -> None:
        world_size, buckets = self.world_size, self.num_buckets
        splits, offsets = in_splits_offsets.tolist()
        chunks = [[send[offsets[b * world_size + r] : offsets[b * world_size + r] + splits[b * world_size + r]]
                   for b in range(buckets)] for r in range(world_size)]
        received = self._exchange_rows(chunks)
        offset = 0
        for source in range(world_size):
            for b in range(buckets):
                chunk = received[source][b]
                recv[offset : offset + len(chunk)] = chunk
                out_splits_offsets[0, source * buckets + b] = len(chunk)
                out_splits_offsets[1, source * buckets + b] = offset
                offset += len(chunk)


@dataclass(frozen=True)
class Case:
    name: str
    world_size: int
    tokens: tuple[int, ...]
    num_experts: int
    top_k: int
    routing: str = "uniform"  # uniform | skewed | holes

    @property
    def spec(self) -> MoESpec:
        return MoESpec(self.num_experts, self.top_k, 64, 32)


CASES = [
    Case("ep2-8-local", 2, (40, 33), 16, 4),  # E_local = 8 <= 16: one expert per bucket
    Case("ep2-40-local-buckets", 2, (48, 21), 80, 6, "skewed"),  # E_local = 40 > 16: 16 buckets of 2-3 experts
    Case("ep2-holes-empty-rank", 2, (25, 0), 64, 4, "holes"),
    Case("ep2-empty-buckets", 2, (3, 2), 64, 2),  # few pairs: most buckets empty
    Case("ep4-32-local", 4, (16, 9, 1, 20), 128, 8, "holes"),
]


def _inputs(case: Case, rank: int):
    spec, num_tokens = case.spec, case.tokens[rank]
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(num_tokens, spec.hidden_size, generator=generator).to(torch.bfloat16)
    if case.routing == "skewed":
        ids, weights = routing.skewed(num_tokens, spec.num_experts, spec.top_k, skew=2.0, seed=rank)
    else:
        ids, weights = routing.uniform(num_tokens, spec.num_experts, spec.top_k, seed=rank)
    ids = ids.to(torch.int32)
    if case.routing == "holes" and num_tokens:
        ids = torch.where(torch.rand(ids.shape, generator=generator) < 0.3, -1, ids)
        ids[0] = -1
    return x, ids, weights


def _run(rank: int, world_size: int, cases: list[Case]) -> dict:
    results = {}
    for case in cases:
        spec = case.spec
        local = spec.num_experts // world_size
        x, ids, weights = _inputs(case, rank)
        w13_all, w2_all = make_experts(spec)
        backend = EmulatedSymm(spec, dist.group.WORLD, rank, world_size, max(case.tokens), torch.device("cpu"))
        backend.load_experts(w13_all[rank * local : (rank + 1) * local], w2_all[rank * local : (rank + 1) * local])
        for buffer in (backend._send, backend._recv, *backend.experts.buffers()):
            buffer.fill_(0xFF if buffer.dtype == torch.uint8 else -1)  # NaN bytes / -1
        out = backend.forward(x, ids, weights)
        again = backend.forward(x, ids, weights)
        ref = reference_moe(x, ids, weights, w13_all, w2_all)
        diff = (out.float() - ref.float()).norm().item()
        results[case.name] = {
            "buckets": backend.num_buckets,
            "nan": bool(torch.isnan(out.float()).any()),
            "rel_fro": diff / max(ref.float().norm().item(), 1e-12) if out.numel() else 0.0,
            "repeat_bitwise": torch.equal(out, again),
        }
    return results


_RESULTS: dict[int, list[dict]] = {}


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_symm_layout_matches_reference(case: Case):
    if case.world_size not in _RESULTS:
        _RESULTS[case.world_size] = run_distributed(
            _run, case.world_size, [c for c in CASES if c.world_size == case.world_size], timeout_s=180)
    for rank, per_case in enumerate(_RESULTS[case.world_size]):
        result = per_case[case.name]
        where = f"{case.name} rank {rank}: {result}"
        assert result["buckets"] == min(case.num_experts // case.world_size, 16), where
        assert not result["nan"], where
        assert result["rel_fro"] <= DEFAULT_TOLERANCE, where
        assert result["repeat_bitwise"], where
