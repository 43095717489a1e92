"""`weave-moe calibrate`: fit a HardwareProfile to in-kernel timelines (CPU), or record them first (--measure, GPU);
measure the GPU's HBM read bandwidth into the profile (--hbm, one GPU; --measure does it too)."""

from __future__ import annotations

HELP = ("fit a hardware profile to measured megakernel timelines (--from-timelines) or record them (--measure, "
        "2 GPUs); measure the HBM read bandwidth (--hbm, one GPU)")

DEFAULT_GRID = (12, 20, 32, 54, 96)


def add_arguments(parser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--from-timelines", nargs="+", metavar="FILE",
                        help="timeline JSON files (scripts/timeline_stats.py format); CPU only")
    source.add_argument("--measure", action="store_true",
                        help="record timelines on 2 GPUs (weave:serial and weave:static:<c> for c in --grid), then fit")
    parser.add_argument("--hbm", action="store_true",
                        help="measure this GPU's HBM read bandwidth (torch.sum over --hbm-gib GiB of bf16, median) "
                             "into the profile's hbm_read_gbps; alone it copies --base with that one field changed")
    parser.add_argument("--hbm-gib", type=float, default=8.0, help="--hbm: size of the tensor read, GiB")
    parser.add_argument("--out", default="h200_measured.json", help="where to write the fitted profile JSON")
    parser.add_argument("--name", default="h200-measured", help="profile name")
    parser.add_argument("--base", default=None, help="profile JSON whose unfitted fields are kept (default: shipped)")
    parser.add_argument("--tile-means", action="store_true",
                        help="also use BRIEF_TILE_MEANS (per-task means of the current KernelConfig, 2 x H200)")
    parser.add_argument("--report", default=None, help="write the fit report (JSON) here")
    parser.add_argument("--models", default="deepseek-v3,qwen3-30b-a3b", help="--measure: models, comma-separated")
    parser.add_argument("--tokens", type=int, default=None,
                        help="--measure: tokens per rank (default 4096 for deepseek-v3, 8192 otherwise)")
    parser.add_argument("--grid", default=",".join(map(str, DEFAULT_GRID)),
                        help="--measure: comm CTA counts c of weave:static:<c>")
    parser.add_argument("--timeline-dir", default=".", help="--measure: where the recorded timeline JSON files go")


def run(args) -> int:
    from pathlib import Path

    from weave_moe.plan.profile import HardwareProfile

    if not (args.from_timelines or args.measure or args.hbm):
        print("weave-moe calibrate: say what to do: --from-timelines FILE... (CPU), --measure (2 GPUs) and/or --hbm "
              "(one GPU)")
        return 2
    base = HardwareProfile.load(args.base) if args.base else HardwareProfile.default()
    files = None
    if args.measure:
        try:
            files = measure(args)
        except RuntimeError as error:
            print(f"weave-moe calibrate --measure: {error}")
            return 2
    elif args.from_timelines:
        files = [Path(f) for f in args.from_timelines]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            print(f"weave-moe calibrate: no such timeline file(s): {', '.join(missing)}")
            return 2
    if args.hbm or args.measure:
        try:
            base = _with_hbm(base, args.hbm_gib)
        except RuntimeError as error:
            print(f"weave-moe calibrate --hbm: {error}")
            return 2
    if files is None:
        base.save(args.out)
        print(f"wrote {args.out}: '{base.name}' with hbm_read_gbps = {base.hbm_read_gbps:g}")
        return 0
    return _fit_and_write(files, base, args)


def _with_hbm(base, gib: float):
    """`base` with `hbm_read_gbps` measured on this GPU now (and a line in its notes saying so)."""
    import dataclasses
    import datetime

    from weave_moe.plan.calibrate import measure_hbm_read_gbps

    gbps = measure_hbm_read_gbps(gib=gib)
    print(f"HBM read: {gbps:.0f} GB/s (torch.sum over {gib:g} GiB bf16, median)")
    note = (f"hbm_read_gbps: {gbps:.0f} GB/s measured {datetime.date.today().isoformat()} by `weave-moe calibrate "
            f"--hbm` (torch.sum over {gib:g} GiB bf16, median).")
    return dataclasses.replace(base, hbm_read_gbps=round(gbps, 1), notes=f"{note} {base.notes}".strip())


def _fit_and_write(files, base, args) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from weave_moe.plan.calibrate import BRIEF_TILE_MEANS, fit_profile, format_fit_table

    profile, report = fit_profile(files, base, tile_means=BRIEF_TILE_MEANS if args.tile_means else (),
                                  name=args.name)
    profile.save(args.out)
    if args.report:
        with open(args.report, "w") as handle:
            json.dump(report, handle, indent=1, default=str)
    table = Table(title=f"fitted profile '{profile.name}' vs '{base.name}' (written to {args.out})")
    for column in ("quantity", base.name, profile.name):
        table.add_column(column, justify="left" if column == "quantity" else "right")
    for row in format_fit_table(profile, base):
        table.add_row(*row)
    console = Console()
    console.print(table)
    for point in report["gemm_points"]:
        console.print(f"  GEMM{point['stage']} {point['model']:14s} {point['file']:36s} rank {point['rank']}: "
                      f"{point['time_us']:7.1f} us per target tile{' (FLOP-scaled)' if point['scaled'] else ''}, "
                      f"fit residual {point.get('fit_residual_pct', 0):+.1f} %")
    console.print("UNVALIDATED: no GPU run has planned with the fitted profile; it is not the default.")
    return 0


# ---- --measure (GPU; untested on GPU) -----------------------------------------------------------------------------
def record_timelines(rank, world_size, spec, tokens, variants, calls: int = 3):
    """One rank (under weave_moe.testing.run_distributed, or rank 0 of 1): build each weave variant's layer with
    timeline=True, run it `calls` times on uniform routing (seed = rank), keep the last call's plan and events.

    Args:
        spec: a MoESpec, or a registered model name.
    Returns:
        {variant: {"plan", "events", "num_sms", "device"}, "_meta": the kernel's tile shape}. Also used by
        scripts/timeline_stats.py.
    """
    import torch

    from weave_moe import routing
    from weave_moe.layer import ExpertParallelMoE
    from weave_moe.models import MoESpec
    from weave_moe.testing import make_experts

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    spec = spec if isinstance(spec, MoESpec) else MoESpec.from_name(spec)
    local = spec.num_experts // world_size
    w13, w2 = make_experts(spec, local, first_expert=rank * local, seed=1, device=device)
    ids, weights = routing.uniform(tokens, spec.num_experts, spec.top_k, seed=rank)
    ids, weights = ids.to(device), weights.to(device)
    x = torch.randn(tokens, spec.hidden_size, generator=torch.Generator().manual_seed(rank)).to(device, torch.bfloat16)
    out = {}
    for variant in variants:
        _, _, policy = variant.partition(":")
        layer = ExpertParallelMoE(spec, backend="weave", policy=policy or "weave", device=device,
                                  max_tokens_per_rank=tokens, check_expert_ids=False, timeline=True)
        layer.load_experts(w13, w2)
        for _ in range(calls):  # the first call compiles and builds the task tables
            layer(x, ids, weights)
        layer.synchronize()
        plan = layer.last_plan
        out[variant] = dict(plan=dict(c=plan.c, K=plan.K, n_steal=plan.n_steal, predicted_us=plan.predicted_us,
                                      policy=plan.policy),
                            events=[list(event) for event in layer.backend.last_timeline()],
                            num_sms=layer.backend.num_sms, device=torch.cuda.get_device_name(device))
        config = layer.backend.config
        out["_meta"] = dict(block_m=config.block_m, block_n0=config.block_n0, block_n1=config.block_n1,
                            dispatch_rows=config.dispatch_rows)
        del layer
        torch.cuda.empty_cache()
    return out


def measure(args) -> list:
    """Record one timeline file per model (2 NCCL ranks) and return their paths. RuntimeError without 2 GPUs."""
    import json
    from pathlib import Path

    try:
        import torch
    except ImportError as error:  # pragma: no cover
        raise RuntimeError(f"needs torch with CUDA ({error})") from None
    if not torch.cuda.is_available():
        raise RuntimeError("needs CUDA: no GPU is visible (torch.cuda.is_available() is False). "
                           "Use --from-timelines FILE... to fit recorded timelines on the CPU.")
    if torch.cuda.device_count() < 2:
        raise RuntimeError(f"needs 2 GPUs (EP=2, one NCCL rank each); {torch.cuda.device_count()} visible")
    from weave_moe.testing import run_distributed

    grid = [int(c) for c in args.grid.split(",") if c.strip()]
    variants = ["weave:serial"] + [f"weave:static:{c}" for c in grid]
    out_dir = Path(args.timeline_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for model in [m for m in args.models.split(",") if m]:
        tokens = args.tokens or (4096 if model == "deepseek-v3" else 8192)
        results = run_distributed(record_timelines, 2, model, tokens, variants, backend="nccl", timeout_s=600)
        meta = dict(results[0].pop("_meta"), model=model, tokens=tokens)
        for per_rank in results[1:]:
            per_rank.pop("_meta", None)
        path = out_dir / f"calib-{model}-{tokens}.json"
        path.write_text(json.dumps(results))
        (out_dir / (path.name + ".meta.json")).write_text(json.dumps(meta))
        files.append(path)
        print(f"recorded {path} ({', '.join(variants)})")
    return files
