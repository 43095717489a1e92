"""The planner: workload of one rank's layer, hardware profile, cost model, and `plan()`.

Imports only `weave_moe.models` (and numpy): the weave backend calls it on the host per layer and per rank.

    wl = Workload.from_routing(spec, topk_ids_per_rank, rank)     # or Workload.from_counts(...)
    p = plan(wl, HardwareProfile.default(), policy="weave")       # Plan(c, K, n_steal, predicted_us, policy)
"""

from weave_moe.plan.cost_model import (
    POLICIES,
    STATIC_BASELINE_C,
    Plan,
    parse_policy,
    physical_floor_us,
    plan,
    plans_serial,
    predict,
    predict_grid,
)
from weave_moe.plan.profile import HardwareProfile
from weave_moe.plan.workload import MAX_CHUNKS, ChunkSplit, Workload

__all__ = [
    "Workload",
    "ChunkSplit",
    "MAX_CHUNKS",
    "HardwareProfile",
    "Plan",
    "plan",
    "plans_serial",
    "predict",
    "predict_grid",
    "physical_floor_us",
    "parse_policy",
    "POLICIES",
    "STATIC_BASELINE_C",
]
