"""graphs.capturing: the cyclic garbage collector is paused for exactly the capture (no GPU here: torch.cuda.graph is
replaced by a stand-in that records what the collector's state was inside it)."""

import contextlib
import gc

import pytest
import torch

from weave_moe.backends.weave import graphs


@pytest.fixture
def fake_capture(monkeypatch):
    seen = []

    @contextlib.contextmanager
    def graph(cuda_graph, **options):
        seen.append((cuda_graph, options, gc.isenabled()))
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    return seen


@pytest.mark.parametrize("enabled_before", [True, False])
def test_capturing_pauses_the_collector_and_restores_it(fake_capture, enabled_before):
    was = gc.isenabled()
    try:
        (gc.enable if enabled_before else gc.disable)()
        with graphs.capturing("graph", capture_error_mode="thread_local"):
            assert not gc.isenabled()
        assert gc.isenabled() == enabled_before
        with pytest.raises(RuntimeError, match="capture failed"):
            with graphs.capturing("graph"):
                raise RuntimeError("capture failed")
        assert gc.isenabled() == enabled_before, "restored after a failed capture too"
    finally:
        (gc.enable if was else gc.disable)()
    assert fake_capture == [("graph", {"capture_error_mode": "thread_local"}, False), ("graph", {}, False)]


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: counts replays."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


@pytest.mark.parametrize("in_capture", [None, False])
def test_graph_cache_captures_once_then_replays(fake_capture, monkeypatch, in_capture):
    """GraphCache.run's capture path end to end with stand-ins for the CUDA calls: the first run builds twice (the
    warm-up, then inside the capture) and returns the warm-up's result; later runs replay without building."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(contextlib.nullcontext, "wait_stream", lambda self, other: None, raising=False)
    cache = graphs.GraphCache(torch.device("cpu"), enabled=True)
    builds = []

    def build():
        builds.append(len(builds))
        return f"result {len(builds)}"

    assert cache.run("g", build, in_capture=in_capture) == "result 1"
    assert builds == [0, 1] and len(fake_capture) == 1, "a warm-up and one capture"
    graph, output = cache.graphs["g"]
    assert output == "result 2"
    assert cache.run("g", build, in_capture=in_capture) == "result 2" and graph.replays == 1 and len(builds) == 2
    # inside a caller's capture the work is recorded into the caller's graph: built, not replayed
    assert cache.run("g", build, in_capture=True) == "result 3" and graph.replays == 1
