"""weave-moe: expert-parallel MoE inference with one persistent Triton megakernel per GPU.

Import rule (one way, top to bottom; a module never imports one below it in this list):
    models, routing  ->  reference  ->  plan  ->  sim  ->  backends (weave/ holds its kernels)  ->  layer
        ->  testing, bench, validate  ->  commands, cli

Public names are resolved lazily, so `import weave_moe` stays cheap (no Triton, no matplotlib) until they are used.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "MoESpec": "weave_moe.models",
    "list_models": "weave_moe.models",
    "PAPER_MODELS": "weave_moe.models",
    "ExpertParallelMoE": "weave_moe.layer",
    "moe_forward": "weave_moe.layer",
    "reference_moe": "weave_moe.reference",
    "Plan": "weave_moe.plan",
    "HardwareProfile": "weave_moe.plan",
    "Workload": "weave_moe.plan",
    "simulate": "weave_moe.sim",
}
#: Submodules offered as attributes: `weave_moe.plan` is the package (its planner is `weave_moe.plan.plan`) in any
#: import order, because importing a submodule binds the same name on this package.
_SUBMODULES = ("plan", "routing")

__all__ = sorted(_PUBLIC) + list(_SUBMODULES) + ["__version__"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"weave_moe.{name}")
    if name not in _PUBLIC:
        raise AttributeError(f"module 'weave_moe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
