"""`weave-moe` command line: one sub-command per module under `weave_moe.commands`.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`. Modules are imported
only when their command runs, so `weave-moe models` never pays for Triton or the simulator.
"""

from __future__ import annotations

import argparse
import importlib
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
}


def _load(name: str):
    return importlib.import_module(f"weave_moe.commands.{COMMANDS[name]}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weave-moe", description="Expert-parallel MoE with a routing-aware megakernel.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = _load(name)
        except ModuleNotFoundError as error:  # a command whose module has not landed yet
            if error.name and error.name.startswith("weave_moe.commands"):
                continue
            raise
        command_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_module", None) is None:
        parser.print_help()
        return 2
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
