"""The weave backend: one persistent Triton megakernel per GPU runs a layer's dispatch, GEMMs and combine.

    backend.py    WeaveBackend: one call's host steps (exchange, counts, plan, tables, launch)
    config.py     KernelConfig (tile shapes, switches) and the wait deadline, with their environment variables
    exchange.py   the routing message and the counts vector (pack, unpack, count, parse: their one owner)
    layout.py     routing -> the megakernel's task tables (torch, static shapes, no host sync)
    graphs.py     CUDA-graph capture/replay and the torch.compile'd task tables
    launch.py     the megakernel's argument list (one source), launch, AOT PTX compile
    workspace.py  the symmetric-memory buffers peers write into, one workspace per process group for all layers
    kernels/      Triton: megakernel.py (persistent kernel), tiles.py (one task per function), sync.py (waits, flags),
                  planner.py (the cost model and plan() on the GPU; planner_mirror.py, its numpy twin),
                  grouped_gemm.py / grouped_tiles.py (the serial policy's grouped GEMMs, their tile tables, row gather),
                  gemm_configs.py (their configurations: GemmConfig, analytical defaults, tuned tables),
                  routing_exchange.py (the routing messages of every rank through the workspace, one launch),
                  counts.py (the counts vector and the resident call's verdict, one launch; optionally the plan),
                  tables.py (the resident call's task tables as three launches: tables_scan.py, tables_bases.py,
                  tables_emit.py)

Imports stay inside this package, plus weave_moe.models / plan / sim.measured / backends (raise_on_bad_ids,
coordination).
"""

from weave_moe.backends.weave.backend import WeaveBackend, WeaveError, WeaveTimeoutError
from weave_moe.backends.weave.config import KernelConfig

__all__ = ["WeaveBackend", "WeaveError", "WeaveTimeoutError", "KernelConfig"]
