"""`weave-moe models`: the registered MoE shapes."""

from __future__ import annotations

HELP = "list the registered MoE model shapes"


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    import json

    from rich.table import Table

    from weave_moe.commands import print_table
    from weave_moe.models import PAPER_MODELS, list_models

    specs = list_models()
    if args.json:
        print(json.dumps([s.to_dict() for s in specs], indent=2))
        return 0
    # Sized to fit 80 columns whole. The name is what users type (--model NAME): never shortened, and the paper mark
    # has its own column so that a copied name has no trailing '*'.
    table = Table(title="registered MoE shapes (paper: in the paper's evaluation; shared: experts x I)",
                  pad_edge=False)
    table.add_column("name", no_wrap=True, min_width=max(len(s.name) for s in specs))
    for column in ("paper", "E", "top-k", "H", "I", "shared", "GFLOP/tok"):
        table.add_column(column, justify="center" if column == "paper" else "right", no_wrap=True)
    for s in specs:
        shared = f"{s.num_shared_experts} x {s.shared_intermediate_size}" if s.num_shared_experts else "-"
        table.add_row(
            s.name, "*" if s.name in PAPER_MODELS else "", str(s.num_experts), str(s.top_k), str(s.hidden_size),
            str(s.intermediate_size), shared, f"{s.flops_per_pair() * s.top_k / 1e9:.3f}",
        )
    print_table(table)
    return 0
