import pytest

import weave_moe as wm
from weave_moe.models import PAPER_MODELS


@pytest.mark.parametrize(
    "name, shape",
    [
        ("deepseek-v3", (256, 8, 7168, 2048)),
        ("phi-3.5-moe", (16, 2, 4096, 6400)),
        ("qwen3-30b-a3b", (128, 8, 2048, 768)),
        ("qwen3.5-35b-a3b", (256, 8, 2048, 512)),
        ("deepseek-v2-lite", (64, 6, 2048, 1408)),
        ("deepseek-v2", (160, 6, 5120, 1536)),
        ("qwen3.5-397b-a17b", (512, 10, 4096, 1024)),
    ],
)
def test_registry_shapes(name, shape):
    spec = wm.MoESpec.from_name(name)
    assert (spec.num_experts, spec.top_k, spec.hidden_size, spec.intermediate_size) == shape


def test_registry_lists_every_model_once():
    names = [s.name for s in wm.list_models()]
    assert len(names) == len(set(names)) == 12
    assert set(PAPER_MODELS) <= set(names)


def test_unknown_model_names_the_known_ones():
    with pytest.raises(KeyError, match="deepseek-v3"):
        wm.MoESpec.from_name("gpt-5")


@pytest.mark.parametrize("field", ["num_experts", "top_k", "hidden_size", "intermediate_size"])
def test_bad_spec_fields_raise(field):
    kwargs = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
    kwargs[field] = 0
    with pytest.raises(ValueError, match=field):
        wm.MoESpec(**kwargs)


def test_top_k_above_experts_raises():
    with pytest.raises(ValueError, match="top_k"):
        wm.MoESpec(num_experts=4, top_k=5, hidden_size=64, intermediate_size=32)


def test_weave_moe_plan_is_the_module_in_any_import_order():
    """`weave_moe.plan` is the planner package however it was first reached (a fresh process per order)."""
    import subprocess
    import sys

    orders = ["from weave_moe import plan; import weave_moe.plan; import weave_moe as wm",
              "import weave_moe.plan; from weave_moe import plan; import weave_moe as wm",
              "import weave_moe as wm; plan = wm.plan; import weave_moe.plan"]
    for order in orders:
        code = (f"{order}\nimport types\nassert isinstance(plan, types.ModuleType) and plan is wm.plan, plan\n"
                "assert callable(plan.plan) and plan.HardwareProfile is wm.HardwareProfile\nprint('ok')")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and "ok" in result.stdout, (order, result.stderr[-2000:])
