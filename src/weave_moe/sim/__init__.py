"""Discrete-event simulator of the megakernel (one rank, one layer) and its timeline picture.

Imports `weave_moe.plan` only (numpy; matplotlib lazily in `plot_timeline`).
"""

from weave_moe.sim.simulator import SimResult, simulate
from weave_moe.sim.timeline import KINDS, Timeline, plot_timeline

__all__ = ["simulate", "SimResult", "Timeline", "plot_timeline", "KINDS"]
