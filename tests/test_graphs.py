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
