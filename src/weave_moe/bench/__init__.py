"""weave_moe.bench: the benchmark harness behind `weave-moe bench` (see docs/benchmarking.md).

    floor.py     the physical floor of a layer (FLOPs at the GEMM peak vs deduplicated NVLink bytes)
    harness.py   ranks, inputs, the timed loop, the check against the reference
    report.py    JSON / CSV / markdown / pictures
    metadata.py  date, device, commit, command line of a run

Sits below the CLI and above `layer` in the import order; importing it does not import the layer, Triton or matplotlib.
"""
