"""`weave-moe models`: the registered MoE shapes."""

from __future__ import annotations

HELP = "list the registered MoE model shapes"


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from weave_moe.models import PAPER_MODELS, list_models

    specs = list_models()
    if args.json:
        print(json.dumps([s.to_dict() for s in specs], indent=2))
        return 0
    table = Table(title="weave-moe models (* = in the paper's evaluation)")
    for column in ("name", "E", "top-k", "H", "I", "shared", "shared I", "GFLOP/token"):
        table.add_column(column, justify="left" if column == "name" else "right")
    for s in specs:
        star = "*" if s.name in PAPER_MODELS else ""
        table.add_row(
            s.name + star, str(s.num_experts), str(s.top_k), str(s.hidden_size), str(s.intermediate_size),
            str(s.num_shared_experts), str(s.shared_intermediate_size), f"{s.flops_per_pair() * s.top_k / 1e9:.3f}",
        )
    Console().print(table)
    return 0
