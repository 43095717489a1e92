"""`weave-moe bench`: models x tokens per rank x routing x backends/policies, every variant in the same run.

Exit status: 0 when every configuration ran (skipped backends allowed) and passed its check; 1 when any configuration
failed or failed its check; 2 when the run was refused before starting (the message says what to do instead).
"""

from __future__ import annotations

# No percent sign in any help text: argparse %-formats them.
HELP = ("benchmark every baseline and weave policy on real MoE shapes, ranked against the best baseline and the "
        "physical floor; JSON/CSV/markdown/plots")


def add_arguments(parser) -> None:
    parser.add_argument("--models", default=None,
                        help="comma-separated registry names (default: the six paper models; see `weave-moe models`)")
    parser.add_argument("--model-dims", action="append", default=[], metavar="E,k,H,I",
                        help="a registry-free model: experts, top-k, hidden, intermediate (repeatable; alone it "
                             "replaces the default models)")
    parser.add_argument("--tokens", default="2048,4096,8192",
                        help="tokens per rank, comma-separated (decode sizes such as 128,512 allowed)")
    parser.add_argument("--max-tokens-per-rank", type=int, default=0, metavar="T_MAX",
                        help="the layers' max_tokens_per_rank (their buffers' size), at least the largest of --tokens; "
                             "0: that largest. Serving engines size it for their largest batch and decode 1-token "
                             "batches in it: e.g. --tokens 1,8,32 --max-tokens-per-rank 8192")
    parser.add_argument("--graph", action="store_true",
                        help="time each capturable variant (weave's device-resident call; nccl at EP=1) as replays "
                             "of its call captured in a CUDA graph, as serving engines run decode (no host time per "
                             "call); the others eagerly; rows say which (timing)")
    parser.add_argument("--routing", default="uniform,skewed", help="uniform and/or skewed")
    parser.add_argument("--skew", type=float, default=3.0, help="busiest expert / mean count of skewed routing")
    parser.add_argument("--variants", default=None,
                        help="backend[:policy], comma-separated; policies may hold a colon and a comma "
                             "(weave:static:20,4). Default: every registered baseline (nccl, symm, deepep), then "
                             "weave:serial, weave:static:20, weave:per_iteration, weave:spatial, weave")
    parser.add_argument("--emulate-ep", type=int, default=1, metavar="N",
                        help="one GPU: run every backend at EP=1 on the per-rank work of EP=N (E/N local experts, "
                             "T*k pairs per rank, no communication); results and report title say so")
    parser.add_argument("--own-process", default="symm", metavar="BACKENDS",
                        help="backends whose variants run in ranks of their own, spawned after the others by this "
                             "command (NVSHMEM beside CUDA IPC); '' runs everything in one set of ranks")
    parser.add_argument("--no-anchor", action="store_true",
                        help="skip the library compute anchor (lib_compute_ms: torch._grouped_mm alone on the same "
                             "groups)")
    parser.add_argument("--cpu-limit-mib", type=float, default=1024.0,
                        help="without CUDA, refuse models whose estimated memory per rank exceeds this (0: no limit)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per configuration (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up calls (at least one per rotating input set)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="N > 1: keep every variant's layer and time each configuration in N interleaved rounds "
                             "of ~iters/N calls, the variants' order changing each round (A/Bs of a few percent); "
                             "1: each variant in one block")
    parser.add_argument("--rotate", type=int, default=4, help="input sets cycled through (fresh routing each)")
    parser.add_argument("--check", action="store_true", help="compare every variant with the reference first")
    parser.add_argument("--check-rows", type=int, default=256, help="rows per rank compared by --check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None,
                        help="result file name (default: bench-<date>-<device>); -2, -3, ... is appended when files "
                             "of that name exist, so a rerun never overwrites results")
    parser.add_argument("--out", default="bench/results", help="result directory")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to spawn (default: every GPU if >= 2, else one; 2 gloo ranks on the CPU; one with "
                             "--emulate-ep)")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--gemm-tflops", type=float, default=None, help="override the floor's GEMM peak")
    parser.add_argument("--peer-gbps", type=float, default=None, help="override the floor's NVLink GB/s per direction")
    parser.add_argument("--hbm-gbps", type=float, default=None, help="override the floor's HBM read GB/s")
    parser.add_argument("--floor-from-profile", action="store_true",
                        help="take the floor's rates from HardwareProfile.default() (its curves' peaks, its HBM read)")
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


class _ArgumentError(ValueError):
    """A command-line value that cannot be used (its message names it and what is allowed)."""


def build_config(args, argv: list[str] | None = None):
    """A BenchConfig from parsed arguments (metadata included); _ArgumentError for a value that cannot be used."""
    try:
        return _build_config(args, argv)
    except (ValueError, KeyError) as error:
        raise _ArgumentError(error.args[0] if error.args else str(error)) from error


def _build_config(args, argv: list[str] | None):
    import datetime

    from weave_moe.bench.config import BenchConfig
    from weave_moe.bench.floor import FloorConstants
    from weave_moe.bench.metadata import collect_metadata
    from weave_moe.bench.report import unique_name
    from weave_moe.bench.variants import default_variants, parse_variants

    floor = FloorConstants()
    if args.floor_from_profile:
        from weave_moe.plan import HardwareProfile

        floor = FloorConstants.from_profile(HardwareProfile.default())
    if args.gemm_tflops or args.peer_gbps or args.hbm_gbps:
        overrides = (("gemm", args.gemm_tflops), ("peer", args.peer_gbps), ("hbm", args.hbm_gbps))
        floor = FloorConstants(
            gemm_tflops=args.gemm_tflops or floor.gemm_tflops, peer_gbps=args.peer_gbps or floor.peer_gbps,
            hbm_gbps=args.hbm_gbps or floor.hbm_gbps,
            source=floor.source + "; overridden on the command line: "
            + ", ".join(f"{k}={v}" for k, v in overrides if v),
        )
    metadata = collect_metadata(args.device, argv)
    if args.git_commit:
        metadata["git_commit"] = args.git_commit + ("" if metadata["git_commit"] == "unknown" else
                                                    f" (checkout here: {metadata['git_commit']})")
    name = unique_name(args.out, args.name or f"bench-{datetime.date.today().isoformat()}-{metadata['device_short']}")
    metadata["name"] = name
    return BenchConfig(
        models=parse_models(args.models, args.model_dims),
        tokens=tuple(int(t) for t in _split(args.tokens)),
        routings=tuple(_split(args.routing)),
        skew=args.skew,
        variants=tuple(parse_variants(args.variants or default_variants())),
        iters=args.iters, warmup=args.warmup, rounds=args.rounds, rotate=args.rotate, check=args.check, check_rows=args.check_rows,
        seed=args.seed, floor=floor, out_dir=args.out, name=name, metadata=metadata, timeout_s=args.timeout,
        show_progress=not args.no_progress, breakdown=not args.no_breakdown, attention=args.attention,
        attention_seq_len=args.attention_seq_len, anchor=not args.no_anchor, emulate_ep=args.emulate_ep,
        own_process=tuple(b.strip() for b in args.own_process.split(",") if b.strip()),
        cpu_limit_mib=args.cpu_limit_mib, max_tokens_per_rank=args.max_tokens_per_rank, graph=args.graph,
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

    from weave_moe.bench.harness import BenchRefused, launch

    try:  # bad arguments (unknown model or variant, ...) and refusals end here, before any rank starts
        config = build_config(args, sys.argv if "bench" in sys.argv[1:2] else _equivalent_argv(args))
        rows = launch(config, nproc=args.nproc, device=args.device)
    except (BenchRefused, _ArgumentError) as error:
        print(f"weave-moe bench: {error.args[0] if error.args else error}", file=sys.stderr)
        return 2
    if not rows:  # a torchrun rank other than 0
        return 0
    _print_summary(rows, report.result_paths(config))
    failed = report.failed_rows(rows)
    if failed:
        print(f"weave-moe bench: {len(failed)} of {len(rows)} configurations failed or failed their check "
              f"(see 'Errors' / 'Failed checks' in {report.result_paths(config)['md']})", file=sys.stderr)
    return 1 if failed else 0


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
    import os

    from rich.console import Console
    from rich.table import Table

    from weave_moe.bench import report
    from weave_moe.bench.variants import BASELINES

    console = Console(width=max(Console().width, 120))  # captured logs default to 80 columns and would cut names
    baselines = [b for b in BASELINES if any(r.get(f"x_{b}") is not None for r in rows)]
    for entry_band in dict.fromkeys(s["tokens"] for s in report.summary(rows)):
        table = Table(title=f"{entry_band} tokens per rank: geomean of median ratios (< 1 = faster)")
        columns = ["variant", "configs", "failed", "skipped", "checks", "x best baseline",
                   *(f"x {b}" for b in baselines), "x floor"]
        for column in columns:
            table.add_column(column, justify="left" if column == "variant" else "right", no_wrap=True)
        for s in report.summary(rows):
            if s["tokens"] != entry_band:
                continue
            table.add_row(s["variant"], str(s["configs"]), str(s["failed"]), str(s["skipped"]), s["checks"],
                          report._fmt(s["x_best_baseline"]), *(report._fmt(s[f"x_{b}"]) for b in baselines),
                          report._fmt(s["x_floor"]))
        console.print(table)
    for s in report.library_standing(rows):
        model, tokens, routing, ratio = s["worst"]
        console.print(f"{s['tokens']} tokens per rank, fastest weave variant / lib compute: at or under in "
                      f"{s['at_or_under']} of {s['configs']}, geomean {report._fmt(s['geomean'], '.3f')}, worst "
                      f"{model} {tokens} {routing} {ratio:.3f}", highlight=False)
    skipped = dict.fromkeys((r["variant"], r["skipped"]) for r in rows if r.get("skipped"))
    for variant, reason in skipped:
        console.print(f"skipped {variant}: {reason}", highlight=False)
    console.print("results: " + ", ".join(p for p in paths.values() if os.path.exists(p)), highlight=False)
