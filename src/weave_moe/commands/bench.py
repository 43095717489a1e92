"""`weave-moe bench`: models x tokens per rank x routing x backends/policies, every variant in the same run."""

from __future__ import annotations

HELP = "benchmark nccl and weave (every policy) on real MoE shapes; JSON/CSV/markdown/plots with % of the floor"

_DEFAULT_VARIANTS = "nccl,weave:serial,weave:static:20,weave:per_iteration,weave:spatial,weave"


def add_arguments(parser) -> None:
    parser.add_argument("--models", default=None,
                        help="comma-separated registry names (default: the six paper models; see `weave-moe models`)")
    parser.add_argument("--model-dims", action="append", default=[], metavar="E,k,H,I",
                        help="a registry-free model: experts, top-k, hidden, intermediate (repeatable; alone it "
                             "replaces the default models)")
    parser.add_argument("--tokens", default="2048,4096,8192",
                        help="tokens per rank, comma-separated (decode sizes such as 128,512 allowed)")
    parser.add_argument("--routing", default="uniform,skewed", help="uniform and/or skewed")
    parser.add_argument("--skew", type=float, default=3.0, help="busiest expert / mean count of skewed routing")
    parser.add_argument("--variants", default=_DEFAULT_VARIANTS,
                        help="backend[:policy], comma-separated; policies may hold a colon (weave:static:20)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per configuration (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up calls (at least one per rotating input set)")
    parser.add_argument("--rotate", type=int, default=4, help="input sets cycled through (fresh routing each)")
    parser.add_argument("--check", action="store_true", help="compare every variant with the reference first")
    parser.add_argument("--check-rows", type=int, default=256, help="rows per rank compared by --check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None, help="result file name (default: bench-<date>-<device>)")
    parser.add_argument("--out", default="bench/results", help="result directory")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to spawn (default: every GPU if >= 2, else 2 gloo ranks on the CPU)")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--gemm-tflops", type=float, default=None, help="override the floor's GEMM peak")
    parser.add_argument("--peer-gbps", type=float, default=None, help="override the floor's NVLink GB/s per direction")
    parser.add_argument("--floor-from-profile", action="store_true",
                        help="take the floor's rates from HardwareProfile.default() where it has them")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may hang before failing")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="skip the untimed per-stage calls (dispatch / gemms / combine ms from the backend)")
    parser.add_argument("--attention", action="store_true",
                        help="also time each model's attention block and shared experts: end-to-end estimate table")
    parser.add_argument("--attention-seq-len", type=int, default=0,
                        help="tokens per causal sequence for --attention (0: a rank's tokens form one sequence)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--git-commit", default=None,
                        help="commit to record when the tree here is not a git checkout (e.g. a copy on a GPU box)")
    parser.add_argument("--replot", metavar="JSON", default=None,
                        help="only rewrite the CSV, markdown and pictures of an existing result JSON")
    parser.add_argument("--merge", metavar="JSON", nargs="+", default=None,
                        help="combine result JSONs (a suite split over several runs) into --out/--name; no run")


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _split_variants(text: str) -> list[str]:
    """'nccl,weave:static:20,4,weave' keeps 'static:20,4' together: a part that is only digits joins the one before."""
    parts: list[str] = []
    for part in _split(text):
        if parts and part.isdigit():
            parts[-1] += "," + part
        else:
            parts.append(part)
    return parts


def parse_models(models: str | None, model_dims: list[str]):
    from weave_moe.models import PAPER_MODELS, MoESpec

    specs = []
    names = _split(models) if models else ([] if model_dims else list(PAPER_MODELS))
    for name in names:
        specs.append(MoESpec.from_name(name))
    for dims in model_dims:
        values = _split(dims.replace("x", ","))
        if len(values) != 4:
            raise ValueError(f"--model-dims wants E,k,H,I, got {dims!r}")
        e, k, h, i = (int(v) for v in values)
        specs.append(MoESpec(e, k, h, i, name=f"custom-{e}x{k}x{h}x{i}"))
    return tuple(specs)


def build_config(args, argv: list[str] | None = None):
    """A BenchConfig from parsed arguments (metadata included)."""
    import datetime

    from weave_moe.bench.floor import FloorConstants
    from weave_moe.bench.harness import BenchConfig, parse_variant
    from weave_moe.bench.metadata import collect_metadata

    floor = FloorConstants()
    if args.floor_from_profile:
        from weave_moe.plan import HardwareProfile

        floor = FloorConstants.from_profile(HardwareProfile.default())
    if args.gemm_tflops or args.peer_gbps:
        floor = FloorConstants(
            gemm_tflops=args.gemm_tflops or floor.gemm_tflops, peer_gbps=args.peer_gbps or floor.peer_gbps,
            source=floor.source + "; overridden on the command line: "
            + ", ".join(f"{k}={v}" for k, v in (("gemm", args.gemm_tflops), ("peer", args.peer_gbps)) if v),
        )
    metadata = collect_metadata(args.device, argv)
    if args.git_commit:
        metadata["git_commit"] = args.git_commit + ("" if metadata["git_commit"] == "unknown" else
                                                    f" (checkout here: {metadata['git_commit']})")
    name = args.name or f"bench-{datetime.date.today().isoformat()}-{metadata['device_short']}"
    metadata["name"] = name
    return BenchConfig(
        models=parse_models(args.models, args.model_dims),
        tokens=tuple(int(t) for t in _split(args.tokens)),
        routings=tuple(_split(args.routing)),
        skew=args.skew,
        variants=tuple(parse_variant(v) for v in _split_variants(args.variants)),
        iters=args.iters, warmup=args.warmup, rotate=args.rotate, check=args.check, check_rows=args.check_rows,
        seed=args.seed, floor=floor, out_dir=args.out, name=name, metadata=metadata, timeout_s=args.timeout,
        show_progress=not args.no_progress, breakdown=not args.no_breakdown, attention=args.attention,
        attention_seq_len=args.attention_seq_len,
    )


def run(args) -> int:
    import sys

    from weave_moe.bench import report

    if args.replot:
        paths = report.rewrite(args.replot)
        print(f"rewrote {paths['csv']}, {paths['md']} and the pictures")
        return 0
    if args.merge:
        if not args.name:
            raise SystemExit("--merge needs --name for the merged result")
        paths = report.merge(args.merge, args.out, args.name)
        print(f"merged {len(args.merge)} runs into {paths['json']} (+ CSV, markdown, pictures)")
        return 0

    from weave_moe.bench.harness import launch

    config = build_config(args, sys.argv if "bench" in sys.argv[1:2] else _equivalent_argv(args))
    rows = launch(config, nproc=args.nproc, device=args.device)
    if not rows:  # a torchrun rank other than 0
        return 0
    _print_summary(rows, report.result_paths(config))
    failed_checks = [r for r in rows if r.get("check_passed") is False]
    return 1 if failed_checks else 0


def _equivalent_argv(args) -> list[str]:
    """A command line equivalent to `args`, every option spelled out (for runs started from Python, not a shell)."""
    argv = ["weave-moe", "bench"]
    for key, value in sorted(vars(args).items()):
        if key.startswith("_") or key == "command" or value is None or value is False or value == []:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def _print_summary(rows, paths) -> None:
    from rich.console import Console
    from rich.table import Table

    from weave_moe.bench import report

    table = Table(title="geomean over configurations")
    for column in ("variant", "configs", "failed", "checks", "vs nccl", "uniform", "skewed", "median / floor"):
        table.add_column(column, justify="left" if column == "variant" else "right", no_wrap=True)
    for s in report.summary(rows):
        table.add_row(s["variant"], str(s["configs"]), str(s["failed"]), s["checks"],
                      *(report._fmt(s[k]) for k in ("speedup", "speedup_uniform", "speedup_skewed", "x_floor")))
    import os

    console = Console(width=max(Console().width, 120))  # captured logs default to 80 columns and would cut names
    console.print(table)
    console.print("results: " + ", ".join(p for p in paths.values() if os.path.exists(p)))
