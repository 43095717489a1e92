"""CUDA-graph and torch.compile plumbing of the weave backend's host path.

The host-driven call's counts (one Triton launch, kernels/counts.py) and task tables (a chain of small torch ops) run
on static buffers with static shapes. Launched one by one, torch ops cost ~30 us of host time each on the H200
machine; replayed from a captured CUDA graph, a chain costs one launch. `GraphCache` captures each chain once per name
and replays it; `LayoutBuilder` builds the task tables through torch.compile (fewer, fused kernels inside the graph)
with an eager fallback.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings

import torch

from weave_moe.backends.weave.layout import build_layout

__all__ = ["GraphCache", "LayoutBuilder", "LAYOUT_COMPILE_LIMIT", "capturing"]

#: Layer shapes (and ranks) one process may compile the task tables for before falling back to eager tables. Dynamo
#: keeps one cache per code object with a limit of 8 entries by default, and fullgraph=True turns hitting it into an
#: error: a process with more than 8 layer shapes (the validation suite) failed that way on the H200 pair (bb8bd82).
LAYOUT_COMPILE_LIMIT = 64

@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, **options):
    """`torch.cuda.graph(graph, **options)` with Python's cyclic garbage collector paused for the capture.

    torch's capture no longer collects garbage first (unless `torch.compiler.config.force_cudagraph_gc`), so a dead
    reference cycle that holds CUDA graphs (a dropped layer's backend and its GraphCache) can be collected in the
    middle of a capture. Destroying a graph is not permitted while this thread's stream is capturing: the CUDA call
    fails ("operation not permitted when stream is capturing (function reset)", once per destroyed graph) and the
    capture is invalidated, so the next launch in it fails ("operation failed due to a previous error during
    capture"). That sequence is in the logs of two of three host-driven validation runs on the H200 at ab19908 (six
    such warnings, then the task tables' launch failing inside the capture; that layer then ran eagerly for good);
    not yet re-run with this pause. Paused, such cycles are collected after the capture.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, **options):
            yield
    finally:
        if enabled:
            gc.enable()


@functools.cache
def compiled_build_layout():
    """`build_layout` through torch.compile (one compile per layer shape; static shapes, no graph breaks), made
    once."""
    return torch.compile(build_layout, fullgraph=True, dynamic=False)


class LayoutBuilder:
    """`build_layout` through torch.compile (Inductor fuses its elementwise ops into a few kernels: fewer nodes in the
    call's graph), or eagerly once compiling failed (e.g. past LAYOUT_COMPILE_LIMIT shapes, with a warning). Both give
    the same integers bit for bit (tests/test_layout.py)."""

    def __init__(self, compile_layout: bool):
        self.compiled = compile_layout

    def __call__(self, *args, **kwargs):
        if not self.compiled:
            return build_layout(*args, **kwargs)
        import torch._dynamo.config as dynamo_config

        try:
            with dynamo_config.patch(recompile_limit=LAYOUT_COMPILE_LIMIT):
                return compiled_build_layout()(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - any compile failure: the eager result is the same
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise  # the capture failed, not the compiler: GraphCache falls back (the compiled tables stay)
            warnings.warn(f"weave: torch.compile of the task tables failed ({type(error).__name__}: "
                          f"{str(error)[:200]}); building them eagerly for this layer")
            self.compiled = False
            return build_layout(*args, **kwargs)


class GraphCache:
    """Runs named builders (torch ops on static buffers, static shapes) as captured CUDA graphs.

    The first call of a name runs `build` eagerly (the warm-up) and returns that run's result; the capture that
    follows records without executing. `build` need not be idempotent: the counts graph masks bad expert ids in
    place, so running it twice on one call's routing would count them once and report zero the second time. Falls
    back to eager execution, with a warning, if a capture fails (and for good once one has failed).

    Under a caller's stream capture (`torch.cuda.graph`), `run` calls `build` directly, so its ops become part of
    the caller's graph.

    `wait_for(is_done)`, when given, bounds the wait before a capture: the warm-up may sit behind a collective that a
    peer never joins (the routing all-gather), and `torch.cuda.synchronize` alone would wait for it forever.
    """

    def __init__(self, device: torch.device, enabled: bool, wait_for=None):
        self.device, self.enabled = device, enabled
        self.wait_for = wait_for
        self.graphs: dict[str, tuple[torch.cuda.CUDAGraph, object]] = {}

    def drop(self, prefix: str) -> None:
        """Forget the graphs whose name starts with `prefix` (they captured pointers that are no longer valid)."""
        for name in [n for n in self.graphs if n.startswith(prefix)]:
            del self.graphs[name]

    def run(self, name: str, build, in_capture: bool | None = None):
        """Replay graph `name` (captured from `build` at its first use) and return what `build` returned then.
        `in_capture`: whether the current stream is capturing, when the caller knows (None: asked here)."""
        # inside a caller's capture the ops are recorded into the caller's graph (a graph launch is not replayed
        # inside another capture)
        if in_capture is None:
            in_capture = torch.cuda.is_current_stream_capturing()
        if not self.enabled or in_capture:
            return build()
        if name in self.graphs:
            graph, output = self.graphs[name]
            graph.replay()
            return output
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            # this call's result, and the warm-up of the capture (allocator, lazy inits). Its tensors come from the
            # side stream's pool and the kernel reads them on the current stream; the synchronize below orders that
            # read after they are written, and a block freed later can only be reused by another warm-up on a side
            # stream, which first waits for the current stream (the wait_stream above), so after the kernel.
            first = build()
        # Capture with nothing in flight and in thread-local mode: the NCCL watchdog thread polls events of
        # pending collectives, and in the default ("global") mode such a call from another thread during the
        # capture invalidates it and errors in the watchdog (suspected cause of a hang seen once on the H200
        # pair when the counts graph was captured right behind the routing all-gather).
        if self.wait_for is not None:
            warmed_up = torch.cuda.Event()
            warmed_up.record(side)
            self.wait_for(warmed_up.query)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with capturing(graph, capture_error_mode="thread_local"):
                output = build()
        except RuntimeError as error:  # an op that synchronises cannot be captured
            warnings.warn(f"weave: CUDA graph capture of {name} failed ({error}); running it eagerly")
            self.enabled = False
            return first
        self.graphs[name] = (graph, output)
        return first
