"""GPU time of the task tables' argsorts with 64- and 32-bit keys (layout._argsort), at the sizes a layer sorts.

    python scripts/sort_probe.py --out sort-probe.json

Keys are random in [0, bound] like the layout's (unique valid keys plus a tail of equal padding keys); each size is
timed as the median of 200 CUDA-event-timed sorts after 20 warm-up sorts, stable and not, for both dtypes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def time_sort(key: torch.Tensor, stable: bool, reps: int = 200) -> float:
    for _ in range(20):
        torch.argsort(key, stable=stable)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.argsort(key, stable=stable)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    rows = []
    # (what it is, entries, key bound): Qwen3-30B at 2048 / 8192 tokens per rank, EP=2 (pairs: EP*T*min(k, E_local))
    for what, size, bound in [("combine rows, 2048 tok", 4096, 8 * 4096), ("pairs, 2048 tok", 32768, 8 * 64 * 4096),
                              ("combine rows, 8192 tok", 16384, 8 * 16384),
                              ("pairs, 8192 tok", 131072, 8 * 64 * 16384), ("gemm tiles", 2400, 41 * 700 * 16)]:
        valid = size * 3 // 4
        key = torch.randperm(bound, generator=gen, device=device)[:size].sort().values  # unique keys
        key = key[torch.randperm(size, generator=gen, device=device)]
        key[valid:] = bound                                                           # padding sorts last
        for stable in (False, True):
            row = dict(what=what, entries=size, bound=bound, stable=stable,
                       int64_us=round(time_sort(key.long(), stable), 2),
                       int32_us=round(time_sort(key.int(), stable), 2))
            rows.append(row)
            print(row)
    record = dict(date=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), device=torch.cuda.get_device_name(0),
                  commit=os.environ.get("WEAVE_MOE_GIT_COMMIT", "unknown"),
                  command="python scripts/sort_probe.py --out " + args.out, torch=torch.__version__, rows=rows)
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
