"""`weave-moe` command line: one sub-command per module under `weave_moe.commands`.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`. Modules are imported
only when their command runs, so `weave-moe models` never pays for Triton or the simulator.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

#: command name -> module under weave_moe.commands
COMMANDS = {
    "models": "models",
    "routing-stats": "routing_stats",
    "demo": "demo",
    "plan": "plan",
    "simulate": "simulate",
    "calibrate": "calibrate",
    "bench": "bench",
    "tune": "tune",
    "kernel-config": "kernel_config",
}


# Argparse %-formats every help string, so a literal "% of the floor" in a command's help raised `TypeError: %o
# format` whenever help was printed. This matches what argparse means by a placeholder (`%%`, `%(default)s`) first,
# then any other `%`, which `escape_percent` doubles.
_PERCENT = re.compile(r"%%|%\(\w+\)[-#0 +]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa]|%")


def escape_percent(text: str | None) -> str | None:
    """`text` with every literal `%` doubled, so argparse prints it as written; `%%` and `%(default)s` stay as they are."""
    if text is None:
        return None
    return _PERCENT.sub(lambda match: "%%" if match.group(0) == "%" else match.group(0), text)


class _HelpFormatter(argparse.HelpFormatter):
    """Argparse's formatter, except that a literal `%` in a help string is printed instead of crashing the help."""

    def _get_help_string(self, action):
        return escape_percent(action.help)


def _load(name: str):
    return importlib.import_module(f"weave_moe.commands.{COMMANDS[name]}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weave-moe", description="Expert-parallel MoE with a routing-aware megakernel.",
                                     formatter_class=_HelpFormatter)
    parser.set_defaults(_module=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = _load(name)
        # The description is only %-formatted when it holds "%(prog)"; the help goes through the formatter above.
        command_parser = sub.add_parser(name, help=module.HELP, description=module.HELP, formatter_class=_HelpFormatter)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `weave-moe` with `argv` (default: sys.argv[1:]); returns the exit status.

    No command prints the help and returns 2 (a usage error, as argparse exits on a bad argument); `--help` exits 0
    through argparse's SystemExit.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args._module is None:
        parser.print_help()
        return 2
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
