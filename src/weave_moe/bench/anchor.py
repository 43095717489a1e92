"""The library compute anchor: what the expert math of one rank costs with PyTorch's own grouped GEMM, nothing else.

Per configuration each rank times, on the (token, expert) pairs its local experts receive from all ranks (rows
already grouped by expert, no routing, no communication, no permutation):

    gate_up = torch._grouped_mm(x_sorted, w13^T, offs)       [P, 2I]  GEMM0
    h       = silu(gate_up[:, :I]) * gate_up[:, I:]          [P, I]   bf16 (two elementwise kernels)
    y       = torch._grouped_mm(h, w2^T, offs)               [P, H]   GEMM1

captured once in a CUDA graph and replayed (no launch gaps, no host work), each replay bracketed by CUDA events; the
row's `lib_compute_ms` is the median over replays, max over ranks. With the bench's rounds (`--rounds` > 1) the
anchor is timed in every round, between the variants, so that a drift of the GPU's clocks over a configuration
reaches it as it reaches them (bench/harness.py). A well-built baseline spends at least this on its
experts; a backend whose call is close to it has little communication or glue left to hide.

Shape legend: P = pairs on this rank, E_local = local experts, H = hidden, I = intermediate.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

from weave_moe.backends.weave.graphs import capturing

__all__ = ["local_group_sizes", "grouped_expert_compute", "time_library_compute", "library_compute_times",
           "grouped_mm_usable"]


def local_group_sizes(topk_ids_all: torch.Tensor, num_experts: int, world_size: int, rank: int) -> list[int]:
    """Pairs per local expert of `rank`: [E_local] ints.

    Args:
        topk_ids_all: [EP * T, k] int global expert ids of every rank's tokens (-1 = no expert).
        num_experts: E; rank r owns experts [r * E_local, (r + 1) * E_local).
    """
    ids = torch.as_tensor(topk_ids_all).reshape(-1).long()
    counts = torch.bincount(ids[ids >= 0], minlength=num_experts)[:num_experts]
    num_local_experts = num_experts // world_size
    return counts[rank * num_local_experts:(rank + 1) * num_local_experts].tolist()


def grouped_mm_usable(device: torch.device, hidden_size: int, intermediate_size: int) -> str | None:
    """None when torch._grouped_mm runs these shapes on `device`, else why not (16-byte aligned strides; CUDA sm90+;
    the CPU where this torch implements it)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if hidden_size % 8 or intermediate_size % 8:
        return f"torch._grouped_mm needs H and I multiples of 8, got H={hidden_size}, I={intermediate_size}"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return "torch._grouped_mm needs sm90+"
    return None


def grouped_expert_compute(x_sorted: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor,
                           w2: torch.Tensor) -> torch.Tensor:
    """GEMM0 + SiLU-mul + GEMM1 on rows grouped by expert.

    Args:
        x_sorted: [P, H] bf16, rows of expert 0 first, then expert 1, ...
        offsets: [E_local] int32, end row of each expert's group (cumulative group sizes; the last one = P).
        w13: [E_local, 2I, H] bf16 (gate rows, then up rows); w2: [E_local, H, I] bf16.

    Returns:
        [P, H] bf16, row p = expert(p)'s output for x_sorted[p] (unweighted).
    """
    intermediate = w2.shape[2]
    gate_up = torch._grouped_mm(x_sorted, w13.transpose(1, 2), offs=offsets)
    h = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    return torch._grouped_mm(h, w2.transpose(1, 2), offs=offsets)


def time_library_compute(group_sizes_per_set: list[list[int]], w13: torch.Tensor, w2: torch.Tensor,
                         iters: int, seed: int = 0) -> float:
    """Median ms of `grouped_expert_compute` over replays, cycling through the input sets' groups
    (`library_compute_times`' median)."""
    return statistics.median(library_compute_times(group_sizes_per_set, w13, w2, iters, seed))


def library_compute_times(group_sizes_per_set: list[list[int]], w13: torch.Tensor, w2: torch.Tensor,
                          iters: int, seed: int = 0) -> list[float]:
    """ms of each replay of `grouped_expert_compute`, cycling through the input sets' groups.

    Args:
        group_sizes_per_set: per input set, this rank's [E_local] pairs per local expert.
        w13, w2: this rank's experts (as in `grouped_expert_compute`), on the device timed.
        iters: timed replays in all, spread evenly over the sets (at least 2 per set).

    On CUDA each set's call is captured in a CUDA graph after one eager warm-up call and replayed, each replay
    between two CUDA events; on the CPU it is called eagerly and timed with perf_counter (only the arithmetic of this
    path is meaningful there). A set with no pairs takes 0 ms.
    """
    device = w13.device
    hidden = w13.shape[2]
    per_set = max(2, math.ceil(iters / max(1, len(group_sizes_per_set))))
    times: list[float] = []
    generator = torch.Generator(device=device).manual_seed(seed)
    for sizes in group_sizes_per_set:
        num_pairs = int(sum(sizes))
        if num_pairs == 0:
            times += [0.0] * per_set
            continue
        x_sorted = torch.randn(num_pairs, hidden, generator=generator, device=device).to(torch.bfloat16)
        offsets = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
        if device.type == "cuda":
            times += _time_graph(x_sorted, offsets, w13, w2, per_set)
        else:
            for _ in range(per_set):
                start = time.perf_counter()
                grouped_expert_compute(x_sorted, offsets, w13, w2)
                times.append((time.perf_counter() - start) * 1e3)
        del x_sorted, offsets
    return times


def _time_graph(x_sorted, offsets, w13, w2, replays: int) -> list[float]:
    return graph_replay_ms(lambda: grouped_expert_compute(x_sorted, offsets, w13, w2), replays, x_sorted.device)


def captured_graph(fn, device=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, fn's output in it) of `fn` captured in a CUDA graph, replayed once (the first replay uploads it).

    `fn` runs once eagerly on a side stream first (kernels compiled, library workspaces made, off the capture)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):  # the cyclic GC paused: a dead layer's graphs must not die inside this capture
        out = fn()
    graph.replay()
    return graph, out


def graph_replay_ms(fn, replays: int, device=None) -> list[float]:
    """ms of each of `replays` replays of `fn` captured in a CUDA graph (`captured_graph`), each between two CUDA
    events."""
    graph, out = captured_graph(fn, device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(device)
    times = [start.elapsed_time(end) for start, end in zip(starts, ends)]
    del graph, out
    return times
