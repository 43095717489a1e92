"""Discrete-event simulator of the megakernel (one rank, one layer), timelines (simulated or measured inside the
kernel), their utilisation figures and their picture.

Imports `weave_moe.plan` only (numpy; matplotlib lazily in `plot_timeline`).
"""

from weave_moe.sim.measured import Event, events_from_buffer
from weave_moe.sim.simulator import SimResult, simulate
from weave_moe.sim.timeline import KINDS, Timeline, Utilisation, measured_result, plot_timeline, utilisation

__all__ = ["simulate", "SimResult", "Timeline", "plot_timeline", "KINDS", "Utilisation", "utilisation", "Event",
           "events_from_buffer", "measured_result"]
