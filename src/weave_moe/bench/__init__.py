"""weave_moe.bench: the benchmark harness behind `weave-moe bench` (see docs/benchmarking.md).

    variants.py  the one parser of variant names ("nccl", "weave:static:20,4"), shared with weave_moe.validate
    config.py    BenchConfig (what a run measures) and the --emulate-ep shape
    floor.py     the physical floor of a layer: max(FLOPs at the GEMM peak, deduplicated NVLink bytes, hit experts'
                 weights read once from HBM)
    anchor.py    the library compute anchor: torch._grouped_mm on the same per-rank groups, no communication
    harness.py   ranks, inputs, the timed loop, the check against the reference, skipped and own-process backends
    report.py    JSON / CSV / markdown / pictures, the ranking against the best baseline
    metadata.py  date, device, commit, command line of a run
    attention.py attention and shared-expert timing for the end-to-end estimate

Imports run one way: variants, floor -> config -> report -> harness (harness imports report, never the reverse).
Sits below the CLI and above `layer` in the import order; importing it does not import the layer, Triton or
matplotlib. `python -m weave_moe.bench ARGS` is `weave-moe bench ARGS`.
"""
