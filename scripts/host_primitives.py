"""Host time of the primitives a device-resident call is made of (one GPU): medians of many, each timed alone.

python scripts/host_primitives.py [--out host_primitives.json]

What a call's host path could be built from, to choose between them by measurement: torch.empty, the capture query,
current_stream, event record / query, the status read (tolist vs a numpy view of pinned memory), a graph replay, a
Triton launch three ways (the JIT, the compiled kernel's [grid], its `run` with everything but the arguments bound
once), and a write into pinned host memory that a kernel inside a CUDA graph reads through its device address
(checked: the graph's output must follow what the host wrote before each replay).
"""

import argparse
import json

import numpy as np
import torch
import triton
import triton.language as tl

import host_cost  # scripts/host_cost.py: this script runs from scripts/, which Python puts on sys.path


@triton.jit(do_not_specialize=["src_ptr", "dst_ptr", "n"])
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n, other=0), mask=offs < n)


def median_us(fn, calls=400, drain=True):
    return host_cost.median_us(fn, calls, drain, digits=2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    row = {}
    stream = torch.cuda.current_stream(device)
    row["torch_empty_1x2048_bf16"] = median_us(lambda: torch.empty(1, 2048, dtype=torch.bfloat16, device=device))
    row["is_current_stream_capturing"] = median_us(torch.cuda.is_current_stream_capturing)
    row["current_stream"] = median_us(lambda: torch.cuda.current_stream(device))
    event = torch.cuda.Event()
    row["event_record_current"] = median_us(lambda: event.record(torch.cuda.current_stream(device)))
    row["event_record_cached_stream"] = median_us(lambda: event.record(stream))
    event.record(stream)
    torch.cuda.synchronize()
    row["event_query_done"] = median_us(event.query)
    status = torch.zeros(16, dtype=torch.int32, device=device)
    pinned = torch.zeros(16, dtype=torch.int32, pin_memory=True)
    view = pinned.numpy()
    row["pinned_tolist_8"] = median_us(lambda: pinned[:8].tolist())
    row["pinned_numpy_any"] = median_us(lambda: bool(view[0] | view[8]))
    row["status_copy_d2h"] = median_us(lambda: pinned.copy_(status, non_blocking=True))
    src = torch.arange(64, dtype=torch.int64, device=device)
    dst = torch.zeros(64, dtype=torch.int64, device=device)
    _copy_kernel[(1,)](src, dst, 8, BLOCK=64)
    row["triton_jit_launch"] = median_us(lambda: _copy_kernel[(1,)](src, dst, 8, BLOCK=64))
    compiled = _copy_kernel[(1,)](src, dst, 8, BLOCK=64)
    row["triton_compiled_getitem"] = median_us(lambda: compiled[(1, 1, 1)](src, dst, 8, 64))
    # the launcher with everything but the arguments bound once
    compiled._init_handles()
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    raw = torch.cuda.current_stream(device).cuda_stream
    row["triton_run_direct"] = median_us(
        lambda: run(1, 1, 1, raw, function, metadata, None, None, None, src, dst, 8, 64))
    row["triton_run_direct_ints"] = median_us(
        lambda: run(1, 1, 1, raw, function, metadata, None, None, None, src.data_ptr(), dst.data_ptr(), 8, 64))
    # pinned host memory read by a kernel captured in a graph: the host writes, the replay reads what was written
    host_words = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    host_view = host_words.numpy()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        _copy_kernel[(1,)](host_words, dst, 8, BLOCK=64)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        _copy_kernel[(1,)](host_words, dst, 8, BLOCK=64)
    ok = True
    for trial in range(200):
        host_view[:8] = np.arange(8) + trial * 1000
        graph.replay()
        torch.cuda.synchronize()
        ok &= dst[:8].cpu().tolist() == [trial * 1000 + i for i in range(8)]
    row["pinned_read_in_graph_correct"] = bool(ok)
    row["graph_replay_1_kernel"] = median_us(graph.replay)
    row["pinned_numpy_write_4"] = median_us(lambda: host_view.__setitem__(slice(0, 4), (1, 2, 3, 4)))
    row["data_ptr_x2"] = median_us(lambda: (src.data_ptr(), dst.data_ptr()))
    # a graph launch queued behind others (no drain): the steady state of a serving loop
    row["graph_replay_1_kernel_queued"] = median_us(graph.replay, drain=False)
    row["device"] = torch.cuda.get_device_name(device)
    row["torch"], row["triton"] = torch.__version__, triton.__version__
    print(json.dumps(row, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
