"""scripts/device_run.sh, checked on the CPU before device time is spent on it: the shell parses, every script a stage
runs exists and parses its arguments, every variant list a stage benches is one the bench accepts, and every
KernelConfig a stage sets is one the layer accepts. (A typo found on the GPU costs a device call.)"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_run.sh"
TEXT = SCRIPT.read_text()


def _defaults(option_text: str) -> list[str]:
    """The literal values an option takes in the script: plain words, or the default of "${NAME:-default}"."""
    values = []
    for value in option_text:
        value = value.strip('"')
        match = re.fullmatch(r"\$\{[A-Z0-9_]+:-(.*)\}", value)
        if match:
            values.append(match.group(1))
        elif "$" not in value:
            values.append(value)
    return values


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.parametrize("script", sorted(set(re.findall(r"python3 (scripts/[a-z_0-9]+\.py)", TEXT))))
def test_every_script_a_stage_runs_exists_and_parses_its_arguments(script):
    assert (ROOT / script).is_file(), script
    result = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_variant_list_is_one_the_bench_accepts():
    from weave_moe.bench.variants import parse_variants

    lists = _defaults(re.findall(r"--variants (\"[^\"]*\"|[^ ]+)", TEXT))
    # the lists a stage hands to another through the environment (pair-tokens' PT_VARIANTS, resident-profile's)
    handed = _defaults(re.findall(r"\b(?:PT|RP)_VARIANTS=(\"[^\"]*\"|[^ ]+)", TEXT))
    assert any("pair_programs" in text for text in handed), handed
    lists += handed
    sweep = re.search(r'SWEEP_VARIANTS="([^"]*)"', TEXT).group(1)
    lists.append(sweep + ",weave:static:8,1")   # the loop appends static splits like this one
    assert len(lists) >= 15
    for text in lists:
        assert parse_variants(text), text


def test_every_kernel_config_a_stage_sets_is_one_the_layer_accepts():
    from weave_moe.backends.weave.config import KernelConfig

    settings = _defaults(re.findall(r"WEAVE_MOE_KERNEL_CONFIG=(\"[^\"]*\"|[^ ]+)", TEXT))
    # the A/B stages' config lists ("none": the defaults)
    for listed in re.findall(r"\$\{(?:AB|KA|KP)_CONFIGS:-([^}]*)\}", TEXT):
        settings += [config for config in listed.split() if config != "none"]
    assert any("resident=" in s for s in settings) and any("tma=0" in s for s in settings)
    for text in settings:
        KernelConfig.from_text(text, "device_run.sh")
