"""`weave-moe demo`: one expert-parallel MoE layer on 2 ranks with skewed routing, checked against the reference.

On a CPU machine it spawns 2 gloo ranks; with 2+ CUDA GPUs it spawns one NCCL rank per GPU (the largest power of two
that divides E). Each rank runs the chosen backend and the reference backend on the same inputs; the command prints
the error, the per-rank and per-expert load, and exits 0 only if every rank matches.
"""

from __future__ import annotations

HELP = "run one MoE layer on 2 ranks (gloo on CPU, NCCL on GPUs) with skewed routing and check it against the reference"

#: The default CPU model: big enough to exercise every path, small enough to finish in seconds on 2 cores.
_SMALL = dict(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128)
_CPU_MAX_HIDDEN = 256  # registry models are scaled down to this width on the CPU (E and top-k are kept)


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="small",
                        help="'small' (E=16, top-4, H=256, I=128) or a registered name (see `weave-moe models`); "
                             "on the CPU a registered model keeps E and top-k but is scaled to H <= 256")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 256 on CPU, 4096 on GPU)")
    parser.add_argument("--skew", type=float, default=3.0, help="busiest expert / mean count (1 = uniform)")
    parser.add_argument("--backend", default=None, choices=["nccl", "weave"],
                        help="backend to check (default: weave with 2+ GPUs, nccl on the CPU)")
    parser.add_argument("--seed", type=int, default=0, help="seeds tokens, routing and weights")


def _spec(model: str, on_gpu: bool):
    from weave_moe.models import MoESpec

    if model == "small":
        return MoESpec(**_SMALL, name="small")
    spec = MoESpec.from_name(model)
    if on_gpu or spec.hidden_size <= _CPU_MAX_HIDDEN:
        return spec
    scale = -(-spec.hidden_size // _CPU_MAX_HIDDEN)
    return MoESpec(spec.num_experts, spec.top_k, spec.hidden_size // scale, max(8, spec.intermediate_size // scale),
                   name=f"{spec.name}/{scale}")


def _rank_main(rank: int, world_size: int, spec, num_tokens: int, skew: float, backend: str, seed: int) -> dict:
    import torch

    from weave_moe import routing
    from weave_moe.layer import ExpertParallelMoE
    from weave_moe.testing import make_experts

    device = torch.device("cuda", rank) if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl" \
        else torch.device("cpu")
    skew = min(skew, routing.max_skew(spec.num_experts, spec.top_k))
    ids, weights = routing.skewed(num_tokens, spec.num_experts, spec.top_k, skew=skew, seed=seed * 1000 + rank,
                                  device=device)
    generator = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    x = torch.randn(num_tokens, spec.hidden_size, generator=generator, device=device).to(torch.bfloat16)
    num_local_experts = spec.num_experts // world_size
    w13, w2 = make_experts(spec, num_local_experts, first_expert=rank * num_local_experts, seed=seed, device=device)

    layer = ExpertParallelMoE(spec, backend=backend, max_tokens_per_rank=max(num_tokens, 1), device=device)
    layer.load_experts(w13, w2)
    out = layer(x, ids, weights)
    milliseconds = None
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(10)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(10)]
        for start, end in zip(starts, ends):
            start.record()
            layer(x, ids, weights)
            end.record()
        torch.cuda.synchronize()
        milliseconds = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[len(starts) // 2]

    reference = ExpertParallelMoE(spec, backend="reference", max_tokens_per_rank=max(num_tokens, 1), device=device)
    reference.load_experts(w13, w2)
    ref = reference(x, ids, weights)
    diff = (out.float() - ref.float())
    return {
        "ids": ids.cpu(),
        "diff_sq": diff.square().sum().item(),
        "ref_sq": ref.float().square().sum().item(),
        "max_abs": diff.abs().max().item() if diff.numel() else 0.0,
        "nan": bool(torch.isnan(out.float()).any()),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "milliseconds": milliseconds,
    }


def _world_size(num_experts: int) -> tuple[int, str]:
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus < 2:
        return 2, "gloo"
    world_size = 1
    while world_size * 2 <= num_gpus and num_experts % (world_size * 2) == 0:
        world_size *= 2
    return world_size, "nccl"


def run(args) -> int:
    import time

    from rich.console import Console
    from rich.table import Table

    from weave_moe import routing
    from weave_moe.commands import print_table
    from weave_moe.reference import DEFAULT_TOLERANCE
    from weave_moe.testing import run_distributed

    console = Console()
    began = time.monotonic()
    import torch

    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    try:
        spec = _spec(args.model, on_gpu)
    except KeyError as error:
        console.print(f"[red]error:[/red] {error.args[0]}")
        return 2
    num_tokens = args.tokens if args.tokens is not None else (4096 if on_gpu else 256)
    if num_tokens < 0 or args.skew < 1:
        console.print("[red]error:[/red] need --tokens >= 0 and --skew >= 1")
        return 2
    world_size, dist_backend = _world_size(spec.num_experts)
    unsupported = "the weave backend needs CUDA GPUs; use --backend nccl on the CPU"
    if dist_backend == "nccl":   # GPUs: the weave backend unless they are older than it needs
        from weave_moe.backends.weave.config import unsupported_device

        unsupported = unsupported_device(torch.device("cuda", 0))
    if args.backend is None:
        args.backend = "weave" if unsupported is None else "nccl"
    if args.backend == "weave" and unsupported is not None:
        console.print(f"[red]error:[/red] {unsupported}")
        return 2
    if spec.num_experts % world_size:
        console.print(f"[red]error:[/red] E={spec.num_experts} is not divisible by EP={world_size}")
        return 2
    console.print(f"{spec.name}: E={spec.num_experts} top-{spec.top_k} H={spec.hidden_size} I={spec.intermediate_size}; "
                  f"EP={world_size} ranks on {dist_backend}, T={num_tokens}/rank, skew {args.skew:g}, "
                  f"backend {args.backend}")
    results = run_distributed(_rank_main, world_size, spec, num_tokens, args.skew, args.backend, args.seed,
                              backend=dist_backend, timeout_s=300)

    stats = routing.routing_stats([r["ids"] for r in results], spec.num_experts, world_size,
                                  hidden_size=spec.hidden_size)
    num_local_experts = spec.num_experts // world_size
    rank_table = Table(title="per-rank load and error")
    for column in ("rank", "device", "experts", "rows recv (dedup)", "pairs recv", "load / mean", "rel. error",
                   "ms (median of 10)"):
        rank_table.add_column(column, justify="right")
    mean_load = stats.pairs_received.double().mean().item()
    for rank, result in enumerate(results):
        rel = (result["diff_sq"] / result["ref_sq"]) ** 0.5 if result["ref_sq"] else 0.0
        load = stats.pairs_received[rank].item()
        rank_table.add_row(
            str(rank), result["device"], f"{rank * num_local_experts}-{(rank + 1) * num_local_experts - 1}",
            str(stats.rows_received[rank].item()), str(load), f"{load / mean_load:.2f}" if mean_load else "-",
            "NaN" if result["nan"] else f"{rel:.2e}",
            "-" if result["milliseconds"] is None else f"{result['milliseconds']:.3f}",
        )
    print_table(rank_table, console)

    top = min(8, spec.num_experts)
    expert_table = Table(title=f"busiest {top} of {spec.num_experts} experts")
    for column in ("expert", "rank", "pairs", "x mean"):
        expert_table.add_column(column, justify="right")
    mean_count = stats.expert_counts.double().mean().item()
    counts, experts = stats.expert_counts.sort(descending=True)
    for count, expert in zip(counts[:top].tolist(), experts[:top].tolist()):
        expert_table.add_row(str(expert), str(expert // num_local_experts), str(count),
                             f"{count / mean_count:.2f}" if mean_count else "-")
    print_table(expert_table, console)

    total_ref = sum(r["ref_sq"] for r in results)
    rel_fro = (sum(r["diff_sq"] for r in results) / total_ref) ** 0.5 if total_ref else 0.0
    has_nan = any(r["nan"] for r in results)
    ok = not has_nan and rel_fro <= DEFAULT_TOLERANCE
    verdict = "[green]MATCH[/green]" if ok else "[red]MISMATCH[/red]"
    console.print(f"{verdict}: {args.backend} vs reference, relative Frobenius error {rel_fro:.2e} "
                  f"(tolerance {DEFAULT_TOLERANCE:g}){', NaN in the output' if has_nan else ''}; "
                  f"expert max/mean {stats.expert_imbalance:.2f}, rank max/mean {stats.rank_imbalance:.2f}; "
                  f"{time.monotonic() - began:.1f} s")
    return 0 if ok else 1
