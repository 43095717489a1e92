"""The `weave-moe` command line as a new user first meets it: help never crashes, piped tables keep whole names.

Fast: only help texts and `models` run (no Triton, no ranks); one test starts the installed console script.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

from weave_moe import cli
from weave_moe.models import list_models

SRC = pathlib.Path(cli.__file__).resolve().parents[1]


def _exit_code(argv: list[str]) -> int:
    """`cli.main(argv)`'s exit status, whether it returns it or argparse raises SystemExit (as `--help` does)."""
    try:
        return cli.main(argv)
    except SystemExit as exit_:
        return 0 if exit_.code is None else exit_.code


@pytest.mark.parametrize("argv", [["--help"], ["-h"]] + [[name, "--help"] for name in cli.COMMANDS],
                         ids=lambda argv: " ".join(argv))
def test_help_prints_usage(argv, capsys):
    assert _exit_code(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: weave-moe")
    if argv[0] in cli.COMMANDS:
        assert f"weave-moe {argv[0]}" in out


def test_top_level_help_lists_every_command_and_keeps_literal_percent(capsys, monkeypatch):
    # a command help with a literal % (the bench help once raised `TypeError: %o format` this way)
    from weave_moe.commands import models

    monkeypatch.setattr(models, "HELP", "registered shapes, 100% of the floor")
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out
    assert "100% of the floor" in " ".join(out.split())


def test_no_command_prints_help_without_a_traceback(capsys):
    assert _exit_code([]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("usage: weave-moe")
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("text, expected", [
    ("50% of the floor", "50%% of the floor"),
    ("% of", "%% of"),
    ("already %% escaped", "already %% escaped"),
    ("default %(default)s, 5%", "default %(default)s, 5%%"),
    ("%(prog)s %", "%(prog)s %%"),
    (None, None),
])
def test_escape_percent(text, expected):
    assert cli.escape_percent(text) == expected


def test_models_piped_shows_whole_names(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # what `weave-moe models | cat` gets
    assert _exit_code(["models"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    cells = {cell.strip() for line in out.splitlines() for cell in line.split("│")}
    for spec in list_models():
        assert spec.name in cells, f"{spec.name} is not a whole cell of the piped table:\n{out}"


def test_models_json_names(capsys):
    assert _exit_code(["models", "--json"]) == 0
    out = capsys.readouterr().out
    for spec in list_models():
        assert f'"{spec.name}"' in out


def test_console_script_help():
    """The installed `weave-moe` script (running this checkout's code) prints help; no arguments is a usage error."""
    script = shutil.which("weave-moe")
    if script is None:
        pytest.skip("the weave-moe console script is not installed (pip install -e .)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([script, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: weave-moe")
    bare = subprocess.run([script], capture_output=True, text=True, env=env, timeout=120)
    assert bare.returncode == 2 and "Traceback" not in bare.stderr, bare.stderr
    assert bare.stdout.startswith("usage: weave-moe")


def test_every_kernel_setting_is_documented():
    """`KernelConfig.field_docs` (what `weave-moe kernel-config` prints) has a description for every field: a new
    setting without one in the class docstring fails here."""
    import dataclasses

    from weave_moe.backends.weave.config import KernelConfig

    docs = KernelConfig.field_docs()
    fields = [field.name for field in dataclasses.fields(KernelConfig)]
    assert sorted(docs) == sorted(fields)
    assert all(len(docs[name]) > 10 for name in fields), {name: docs[name] for name in fields}
    assert docs["block_k1"] == docs["block_k"] and docs["block_k"].startswith("K step of GEMM0")   # one line, two keys
    assert "Off until measured" in docs["early_scan"]   # continuation lines joined


def test_kernel_config_lists_every_setting_with_its_environment_value(capsys, monkeypatch):
    import dataclasses
    import json

    from weave_moe.backends.weave.config import KERNEL_CONFIG_ENV, KernelConfig

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv(KERNEL_CONFIG_ENV, "early_scan=on,block_h=256")
    assert _exit_code(["kernel-config"]) == 0
    out = capsys.readouterr().out
    for field in dataclasses.fields(KernelConfig):
        assert field.name in out
    assert _exit_code(["kernel-config", "--json"]) == 0
    rows = {row["key"]: row for row in json.loads(capsys.readouterr().out)}
    assert (rows["early_scan"]["default"], rows["early_scan"]["value"]) == (False, True)
    assert (rows["block_h"]["default"], rows["block_h"]["value"]) == (512, 256)
    assert rows["tma"]["value"] is True and rows["tma"]["description"].startswith("expert weights")
    assert _exit_code(["kernel-config", "early_scan"]) == 0
    assert capsys.readouterr().out.startswith("early_scan (bool, default off, here on):")


@pytest.mark.parametrize("argv, env, message", [
    (["kernel-config", "early_scn"], "", "no setting early_scn"),
    (["kernel-config"], "early_scan=maybe", "WEAVE_MOE_KERNEL_CONFIG: early_scan='maybe'"),
])
def test_kernel_config_refuses_unknown_keys_and_bad_settings(argv, env, message, capsys, monkeypatch):
    monkeypatch.setenv("WEAVE_MOE_KERNEL_CONFIG", env)
    assert _exit_code(argv) == 2
    assert message in capsys.readouterr().err
