"""The counts kernel (kernels/counts.py) on one GPU: bit for bit against `CountsFormat.build` + `verdict`, and its time
against the torch ops it replaced.

    python3 scripts/counts_check.py --out $OUT/counts_check.json

1. Equality, on the GPU: random, -1-holed and skewed routing with bad ids, failed and other-call headers, a status
   word already set, EP 1..8, k 1..16, E up to 512, T_max 1..16384; every rank's verdict and the host-driven mode;
   three launches back to back (the scratch must come back zero every time), and the same launch replayed from a
   CUDA graph on new messages.
2. Time per call, each variant captured in a CUDA graph and replayed 200 times (median, `bench.anchor.graph_replay_ms`):
   the kernel with the verdict (the resident call), without it (the host-driven call), `build` + `verdict` through
   torch.compile (the resident call before), `build` eagerly (the host-driven call before).
Writes one JSON; prints a summary. Exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from weave_moe.backends.coordination import HEADER_WORDS
from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage
from weave_moe.backends.weave.kernels.counts import DeviceCounts
from weave_moe.bench.anchor import graph_replay_ms

HEADER = [7, 1, 5, 0]


def gathered(ep, E, k, T_max, tokens, mode, generator, device, bad=0, headers=None):
    """[EP, words] int32 messages on `device` (RoutingMessage.pack of each rank's ids, then stacked)."""
    message = RoutingMessage(T_max, k)
    rows = []
    for r, n in enumerate(tokens):
        if mode == "holes":
            ids = torch.randint(-1, E, (n, k), generator=generator, dtype=torch.int32)
        elif mode == "skewed":
            ids = torch.full((n, k), E - 1, dtype=torch.int32)
        else:
            ids = torch.rand(n, E, generator=generator).argsort(dim=1)[:, :k].int()
        if bad and n:
            flat = ids.view(-1)
            where = torch.randperm(flat.numel(), generator=generator)[:bad]
            flat[where] = torch.tensor([-2, E, -(2 ** 31), 2 ** 31 - 1] * bad, dtype=torch.int32)[:where.numel()]
        out = torch.empty(message.words, dtype=torch.int32)
        header = torch.tensor(HEADER if headers is None else headers[r], dtype=torch.int32)
        message.pack(out, ids, torch.rand(n, k, generator=generator), message.pad(),
                     torch.arange(T_max + 1, dtype=torch.int32), header)
        rows.append(out)
    return message, torch.stack(rows).to(device)


def reference(fmt, message, messages, status, rank, verdict):
    messages, status = messages.clone(), status.clone()
    counts = fmt.build(messages, message, status)
    if verdict:
        fmt.verdict(counts, rank, status)
    return counts, messages, status


EQUALITY_CASES = [  # ep, E, k, T_max, tokens, mode, bad, headers, status
    (1, 128, 8, 1, (1,), "uniform", 0, None, None),
    (1, 128, 8, 2048, (2048,), "uniform", 3, None, None),
    (2, 16, 1, 16384, (16384, 0), "holes", 5, None, None),
    (4, 256, 6, 4096, (4096, 17, 0, 4000), "skewed", 0, None, None),
    (8, 256, 8, 4096, (4096,) * 8, "uniform", 0, None, None),
    (8, 512, 16, 16384, (16384, 1, 0, 9000, 16384, 3, 2, 1), "holes", 7, None, None),
    (3, 12, 4, 30, (30, 0, 22), "holes", 2, [HEADER, [7, 1, 6, 0], [7, 1, 5, 2]], None),
    (2, 8, 3, 40, (40, 37), "holes", 4, None, [1, 3, 4, 9]),
]


def replayed_equal(kernel, fmt, message, messages, other, status, device) -> bool:
    """One launch captured in a CUDA graph on `messages`, replayed on `other` copied into the captured buffer: equal
    to the reference on `other`."""
    buffer, graph_status = messages.clone(), status.clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        kernel.build(buffer, graph_status, 0, verdict=True)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel.build(buffer, graph_status, 0, verdict=True)
    buffer.copy_(other)
    graph_status.copy_(status)
    graph.replay()
    want = reference(fmt, message, other, status, 0, True)
    return all(torch.equal(a, b) for a, b in zip((out, buffer, graph_status), want))


def check_equality(device) -> list[dict]:
    rows = []
    for i, (ep, E, k, T_max, tokens, mode, bad, headers, status_words) in enumerate(EQUALITY_CASES):
        generator = torch.Generator().manual_seed(i)
        message, messages = gathered(ep, E, k, T_max, tokens, mode, generator, device, bad, headers)
        fmt = CountsFormat(ep, E, 4)
        kernel = DeviceCounts(fmt, message, device)
        status = torch.tensor(status_words or [0, 0, 0, 0], dtype=torch.int32, device=device)
        failures = []
        for rank in range(ep):
            for verdict in (True, False):
                want = reference(fmt, message, messages, status, rank, verdict)
                for launch in range(3):
                    got_messages, got_status = messages.clone(), status.clone()
                    got = kernel.build(got_messages, got_status, rank, verdict=verdict).clone()
                    if launch == 2:  # a second launch on the cleaned messages: as `build` again
                        again = reference(fmt, message, got_messages, got_status, rank, verdict)
                        second = kernel.build(got_messages, got_status, rank, verdict=verdict)
                        if not (torch.equal(second, again[0]) and torch.equal(got_status, again[2])):
                            failures.append(dict(rank=rank, verdict=verdict, what="second launch"))
                        continue
                    for name, a, b in zip(("counts", "messages", "status"), (got, got_messages, got_status), want):
                        if not torch.equal(a, b):
                            failures.append(dict(rank=rank, verdict=verdict, launch=launch, what=name))
                    if kernel.scratch.any():
                        failures.append(dict(rank=rank, verdict=verdict, launch=launch, what="scratch not zero"))
        _, other = gathered(ep, E, k, T_max, tokens, "holes", torch.Generator().manual_seed(100 + i), device, bad + 1)
        if not replayed_equal(kernel, fmt, message, messages, other, status, device):
            failures.append(dict(what="graph replay"))
        rows.append(dict(ep=ep, experts=E, top_k=k, max_tokens=T_max, tokens=list(tokens), mode=mode, bad=bad,
                         grid=kernel.grid[0], block_t=kernel.constants["BLOCK_T"], failures=failures,
                         ok=not failures))
    return rows


TIMING_CASES = [  # ep, E, k, T_max, tokens per rank
    (1, 128, 8, 2048, 1), (1, 128, 8, 2048, 2048), (1, 128, 8, 16384, 16384), (8, 256, 8, 4096, 4096),
    (8, 512, 16, 16384, 16384), (2, 128, 8, 8192, 8192),
]


def time_variants(device, replays: int) -> list[dict]:
    rows = []
    for i, (ep, E, k, T_max, n) in enumerate(TIMING_CASES):
        message, messages = gathered(ep, E, k, T_max, (n,) * ep, "uniform", torch.Generator().manual_seed(i), device)
        fmt = CountsFormat(ep, E, 4)
        kernel = DeviceCounts(fmt, message, device)
        status = torch.zeros(4, dtype=torch.int32, device=device)

        def build_and_verdict():
            counts = fmt.build(messages, message, status)
            fmt.verdict(counts, 0, status)
            return counts

        compiled = torch.compile(build_and_verdict, fullgraph=True, dynamic=False)
        variants = dict(
            kernel_verdict=lambda: kernel.build(messages, status, 0, verdict=True),
            kernel=lambda: kernel.build(messages, status, 0, verdict=False),
            torch_compiled_build_verdict=compiled,
            torch_eager_build=lambda: fmt.build(messages, message, status))
        row = dict(ep=ep, experts=E, top_k=k, max_tokens=T_max, tokens=n, grid=kernel.grid[0],
                   ids=ep * T_max * k)
        for name, fn in variants.items():
            times = graph_replay_ms(fn, replays, device)
            row[f"{name}_us"] = statistics.median(times) * 1e3
        rows.append(row)
        torch._dynamo.reset()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="counts_check.json")
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    equality = check_equality(device)
    timing = time_variants(device, args.replays)
    ok = all(row["ok"] for row in equality)
    result = dict(ok=ok, header_words=HEADER_WORDS, device=torch.cuda.get_device_name(device), equality=equality,
                  timing=timing)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    for row in equality:
        print(f"equal  EP {row['ep']} E {row['experts']} k {row['top_k']} T_max {row['max_tokens']} {row['mode']}: "
              f"{'ok' if row['ok'] else row['failures'][:3]}")
    for row in timing:
        print(f"time   EP {row['ep']} E {row['experts']} k {row['top_k']} T {row['tokens']}/{row['max_tokens']} "
              f"grid {row['grid']}: kernel+verdict {row['kernel_verdict_us']:.1f} us, kernel {row['kernel_us']:.1f} "
              f"us, compiled torch {row['torch_compiled_build_verdict_us']:.1f} us, eager torch build "
              f"{row['torch_eager_build_us']:.1f} us")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
