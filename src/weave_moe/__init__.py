"""weave-moe: expert-parallel MoE inference with one persistent Triton megakernel per GPU.

Import rule (one way, top to bottom; a module never imports one below it in this list):
    models, routing  ->  reference  ->  plan  ->  kernels  ->  transport  ->  backends  ->  layer  ->  sim, bench  ->  cli

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
    "plan": "weave_moe.plan",
    "simulate": "weave_moe.sim",
    "routing": "weave_moe.routing",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'weave_moe' has no attribute {name!r}")
    module = importlib.import_module(_PUBLIC[name])
    # a function of the same name as its package (weave_moe.plan.plan) wins over the package itself
    value = getattr(module, name) if hasattr(module, name) else module
    globals()[name] = value
    return value


def __dir__():
    return __all__
