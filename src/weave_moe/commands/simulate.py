"""`weave-moe simulate`: run one rank's layer through the megakernel simulator and draw its timeline."""

from __future__ import annotations

HELP = "simulate one rank's megakernel for a layer (latency, SM active, overlap) and draw the per-SM timeline"


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="registered model name (see `weave-moe models`)")
    parser.add_argument("--tokens", type=int, required=True, help="tokens per rank")
    parser.add_argument("--ep", type=int, required=True, help="expert-parallel world size")
    parser.add_argument("--policy", default="weave", help="serial | spatial | static:<c>[,<K>] | per_iteration | weave")
    parser.add_argument("--skew", type=float, default=None, help="skewed routing (busiest / mean); default uniform")
    parser.add_argument("--layer", type=int, default=0, help="layer index (changes the hot experts)")
    parser.add_argument("--rank", type=int, default=0, help="which rank to simulate")
    parser.add_argument("--timeline", default=None, help="write the per-SM timeline PNG here")
    parser.add_argument("--profile", default=None, help="hardware profile JSON (default: the shipped H200 profile)")
    parser.add_argument("--seed", type=int, default=0, help="routing seed")


def run(args) -> int:
    from weave_moe.commands.plan import describe_c, layer_workloads, load_profile
    from weave_moe.models import MoESpec
    from weave_moe.plan import MAX_CHUNKS, physical_floor_us, plan
    from weave_moe.sim import plot_timeline, simulate

    try:
        spec = MoESpec.from_name(args.model)
        if not 0 <= args.rank < args.ep:
            raise ValueError(f"--rank must lie in [0, {args.ep})")
        profile = load_profile(args.profile)
        workloads = layer_workloads(spec, args.tokens, args.ep, skew=args.skew, layer=args.layer, seed=args.seed,
                                    chunk_counts=range(1, MAX_CHUNKS + 1))
        wl = workloads[args.rank]
        p = plan(wl, profile, args.policy)
    except (KeyError, ValueError) as error:
        print(f"error: {error.args[0]}")
        return 2
    result = simulate(wl, profile, p)
    floor = physical_floor_us(wl, profile)
    print(f"{spec.name} EP={args.ep} rank {args.rank} layer {args.layer}: {args.tokens} tokens, "
          f"{wl.dispatch_send_rows} rows sent, {wl.dispatch_recv_rows} received, {wl.num_pairs} GEMM rows")
    # The simulator runs the kernel; the model's prediction also holds the profile's host call overhead.
    kernel_us = p.predicted_us - profile.call_overhead_us
    overhead = f" = kernel {kernel_us:.1f} + call overhead {profile.call_overhead_us:.1f}" if profile.call_overhead_us \
        else ""
    roles = f"c={p.c}" if not p.is_serial(profile.num_sms) else describe_c(p, profile.num_sms)
    print(f"plan ({args.policy}): {roles} K={p.K} n_steal={p.n_steal}, "
          f"predicted {p.predicted_us:.1f} us{overhead}")
    usage = result.utilisation
    error = 100 * (kernel_us / result.latency_us - 1)
    print(f"simulated kernel: {result.latency_us:.1f} us (model error {error:+.1f}%), "
          f"{100 * floor / result.latency_us:.0f}% of the physical floor's speed ({floor:.1f} us)")
    print(f"SM active {100 * usage.sm_active:.1f}% (work; waiting {100 * usage.waiting:.1f}%, idle "
          f"{100 * usage.idle:.1f}%), comm/GEMM overlap {100 * usage.overlap:.1f}% (docs/utilisation.md)")
    if args.timeline:
        plot_timeline(result, args.timeline)
        print(f"timeline: {args.timeline}")
    return 0
