"""`weave-moe routing-stats`: per-rank and per-expert load of one layer under synthetic routing."""

from __future__ import annotations

HELP = "per-rank and per-expert load of one MoE layer under synthetic (skewed) routing"


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="registered model name (see `weave-moe models`)")
    parser.add_argument("--tokens", type=int, required=True, help="tokens per rank (T)")
    parser.add_argument("--ep", type=int, required=True, help="expert-parallel world size (EP)")
    parser.add_argument("--skew", type=float, default=3.0, help="busiest expert / mean count, >= 1 (1 = uniform)")
    parser.add_argument("--layer", type=int, default=0, help="layer index: picks which experts are hot")
    parser.add_argument(
        "--locality", type=float, default=0.5, help="0-1: how contiguous hot experts are (raises per-rank imbalance)"
    )
    parser.add_argument("--seed", type=int, default=0, help="rank r draws its tokens with seed + r")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes per dispatched element (2 = bf16, 1 = fp8)")
    parser.add_argument("--top", type=int, default=10, help="busiest experts to list")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f}"


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from weave_moe import routing
    from weave_moe.commands import print_table
    from weave_moe.models import MoESpec

    console = Console()
    try:
        spec = MoESpec.from_name(args.model)
    except KeyError as error:
        console.print(f"[red]error:[/red] {error.args[0]}")
        return 2
    if args.tokens < 0 or args.ep <= 0 or args.skew < 1 or not 0 <= args.locality <= 1 or spec.num_experts % args.ep:
        console.print(
            f"[red]error:[/red] need --tokens >= 0, --ep > 0 dividing E={spec.num_experts}, --skew >= 1, "
            f"--locality in [0, 1] (got tokens={args.tokens}, ep={args.ep}, skew={args.skew}, locality={args.locality})"
        )
        return 2

    skew = min(args.skew, routing.max_skew(spec.num_experts, spec.top_k))
    per_rank = [
        routing.skewed(
            args.tokens, spec.num_experts, spec.top_k,
            skew=skew, layer=args.layer, seed=args.seed + rank, locality=args.locality,
        )[0]
        for rank in range(args.ep)
    ]
    stats = routing.routing_stats(
        per_rank, spec.num_experts, args.ep, hidden_size=spec.hidden_size, dtype_bytes=args.dtype_bytes
    )
    num_local_experts = spec.num_experts // args.ep

    title = (
        f"{spec.name}: E={spec.num_experts} top-{spec.top_k} H={spec.hidden_size}, EP={args.ep}, "
        f"T={args.tokens}/rank, skew target {skew:g}, layer {args.layer}, locality {args.locality:g}"
    )
    rank_table = Table(title=title)
    for column in ("rank", "experts", "tokens", "rows recv (dedup)", "rows recv (no dedup)", "MiB sent", "MiB recv",
                   "load / mean"):
        rank_table.add_column(column, justify="right")
    mean_load = stats.pairs_received.double().mean().item()
    for rank in range(args.ep):
        load = stats.pairs_received[rank].item()
        rank_table.add_row(
            str(rank),
            f"{rank * num_local_experts}-{(rank + 1) * num_local_experts - 1}",
            str(stats.tokens_per_rank[rank].item()),
            str(stats.rows_received[rank].item()),
            str(load),
            _mib(stats.bytes_sent[rank].item()),
            _mib(stats.bytes_received[rank].item()),
            f"{load / mean_load:.2f}" if mean_load else "-",
        )
    print_table(rank_table, console)

    expert_table = Table(title=f"busiest {min(args.top, spec.num_experts)} of {spec.num_experts} experts")
    for column in ("expert", "rank", "pairs", "x mean"):
        expert_table.add_column(column, justify="right")
    mean_count = stats.expert_counts.double().mean().item()
    counts, experts = stats.expert_counts.sort(descending=True)
    for count, expert in zip(counts[: args.top].tolist(), experts[: args.top].tolist()):
        expert_table.add_row(
            str(expert), str(expert // num_local_experts), str(count), f"{count / mean_count:.2f}" if mean_count else "-"
        )
    print_table(expert_table, console)

    remote_dedup = stats.remote_rows_sent.sum().item()
    remote_pairs = stats.remote_pairs_sent.sum().item()
    console.print(
        f"expert max/mean {stats.expert_imbalance:.2f}, rank max/mean {stats.rank_imbalance:.2f}; "
        f"remote dispatch rows {remote_dedup} with dedup vs {remote_pairs} without"
        + (f" ({remote_pairs / remote_dedup:.2f}x fewer)" if remote_dedup else "")
    )
    return 0
