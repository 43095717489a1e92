"""`weave-moe kernel-config`: the weave backend's kernel settings (KernelConfig), their defaults, the values that
WEAVE_MOE_KERNEL_CONFIG sets, and what each one does."""

from __future__ import annotations

HELP = "list the weave backend's kernel settings (KernelConfig): defaults, WEAVE_MOE_KERNEL_CONFIG's values, meaning"

#: characters of a description shown in the table (its first sentence, cut here); `KEY` or --json gives it whole
SUMMARY_CHARS = 100


def add_arguments(parser) -> None:
    parser.add_argument("keys", nargs="*", metavar="KEY", help="print these settings' whole descriptions")
    parser.add_argument("--json", action="store_true", help="print JSON (every setting, whole descriptions)")


def summary(text: str, limit: int = SUMMARY_CHARS) -> str:
    """The first sentence of `text`, cut to `limit` characters."""
    end = text.find(". ")
    sentence = text if end < 0 else text[:end + 1]
    return sentence if len(sentence) <= limit else sentence[:limit - 3].rstrip() + "..."


def settings() -> list[dict]:
    """One dict per KernelConfig field: key, type, default, value (this environment's), description."""
    import dataclasses

    from weave_moe.backends.weave.config import KernelConfig

    default, current, docs = KernelConfig(), KernelConfig.from_env(), KernelConfig.field_docs()
    return [dict(key=field.name, type=field.type, default=getattr(default, field.name),
                 value=getattr(current, field.name), description=docs[field.name])
            for field in dataclasses.fields(KernelConfig)]


def run(args) -> int:
    import json
    import os
    import sys

    from rich.table import Table

    from weave_moe.backends.weave.config import KERNEL_CONFIG_ENV
    from weave_moe.commands import print_table

    try:
        rows = settings()
    except ValueError as error:   # a malformed WEAVE_MOE_KERNEL_CONFIG: its message names the variable and the key
        print(f"weave-moe kernel-config: {error}", file=sys.stderr)
        return 2
    known = {row["key"] for row in rows}
    unknown = [key for key in args.keys if key not in known]
    if unknown:
        print(f"weave-moe kernel-config: no setting {', '.join(unknown)}; the settings are {', '.join(sorted(known))}",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if args.keys:
        for row in rows:
            if row["key"] in args.keys:
                print(f"{row['key']} ({row['type']}, default {_text(row['default'])}, here {_text(row['value'])}):\n"
                      f"  {row['description']}\n")
        return 0
    env = os.environ.get(KERNEL_CONFIG_ENV, "")
    table = Table(title=f"KernelConfig: set with {KERNEL_CONFIG_ENV}=\"key=value,...\" (here {env!r}) or a bench "
                        f"variant weave@key=value", pad_edge=False)
    table.add_column("key", no_wrap=True, min_width=max(len(row["key"]) for row in rows))
    table.add_column("default", no_wrap=True)
    table.add_column("here", no_wrap=True)
    table.add_column("what (weave-moe kernel-config KEY: all of it)")
    for row in rows:
        here = _text(row["value"]) if row["value"] != row["default"] else ""
        table.add_row(row["key"], _text(row["default"]), here, summary(row["description"]))
    print_table(table)
    return 0


def _text(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)
