"""`weave-moe plan`: per-rank, per-layer plans of the cost model for a model, token count and EP size."""

from __future__ import annotations

HELP = "print the planner's c*, K*, n_steal and predicted latency per rank and layer"


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="registered model name (see `weave-moe models`)")
    parser.add_argument("--tokens", type=int, required=True, help="tokens per rank")
    parser.add_argument("--ep", type=int, required=True, help="expert-parallel world size")
    parser.add_argument("--skew", type=float, default=None,
                        help="busiest-expert / mean count of skewed routing (default: uniform routing)")
    parser.add_argument("--layers", type=int, default=1, help="layers to plan (skewed routing differs per layer)")
    parser.add_argument("--policy", default="weave", help="serial | spatial | static:<c>[,<K>] | per_iteration | weave")
    parser.add_argument("--profile", default=None, help="hardware profile JSON (default: the shipped H200 profile)")
    parser.add_argument("--seed", type=int, default=0, help="routing seed")
    parser.add_argument("--call", choices=CALLS, default="resident",
                        help="resident (default, the layer's default call): planned as a resident layer's device "
                             "planner plans, latency of the kernels; host: the host-driven call (resident=off), with "
                             "the profile's host call overhead")


#: the kinds of layer call `--call` names (KernelConfig.resident: on by default, off = the host-driven call)
CALLS = ("resident", "host")


def profile_for_call(profile, call: str):
    """The profile a layer making `call`s plans with, as `weave-moe plan` prints it. resident: serial plans priced as
    the grouped GEMMs that run them (`with_grouped_serial`, as the backend's device planner is built) and no host call
    overhead (`call_overhead_us` was fitted on the host-driven call, whose host work the GPU waits for; a resident
    call's fixed device work before the kernel is not in the model). host: the profile as it is."""
    from dataclasses import replace

    if call == "resident":
        return replace(profile.with_grouped_serial(), call_overhead_us=0.0)
    if call == "host":
        return profile
    raise ValueError(f"call must be one of {CALLS}, got {call!r}")


def layer_workloads(spec, num_tokens: int, world_size: int, *, skew=None, layer: int = 0, seed: int = 0,
                    chunk_counts=None):
    """Every rank's `Workload` for one layer of synthetic routing (rank r draws with seed 1000 * layer + r + seed).

    skew None or 1 gives `routing.uniform`; otherwise `routing.skewed` (hot experts depend on `layer`).
    """
    from weave_moe import routing
    from weave_moe.plan import Workload

    ids = []
    for rank in range(world_size):
        draw_seed = 1000 * layer + rank + seed
        if skew is None or skew <= 1.0:
            ids.append(routing.uniform(num_tokens, spec.num_experts, spec.top_k, seed=draw_seed)[0])
        else:
            ids.append(routing.skewed(num_tokens, spec.num_experts, spec.top_k, skew=skew, layer=layer,
                                      seed=draw_seed)[0])
    return [Workload.from_routing(spec, ids, rank, chunk_counts=chunk_counts) for rank in range(world_size)]


def describe_c(plan, num_sms: int) -> str:
    """The plan's comm CTAs for people: "serial (no comm SMs)" when every SM runs every phase (c = N), else c."""
    return str(plan.c) if not plan.is_serial(num_sms) else "serial (no comm SMs)"


def load_profile(path):
    from weave_moe.plan import HardwareProfile

    return HardwareProfile.default() if path is None else HardwareProfile.load(path)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from weave_moe.models import MoESpec
    from weave_moe.plan import STATIC_BASELINE_C, parse_policy, plan

    try:
        spec = MoESpec.from_name(args.model)
        parse_policy(args.policy)
        if spec.num_experts % args.ep:
            raise ValueError(f"num_experts={spec.num_experts} is not divisible by EP={args.ep}")
    except (KeyError, ValueError) as error:
        print(f"error: {error.args[0]}")
        return 2
    profile = profile_for_call(load_profile(args.profile), args.call)
    routing_name = "uniform" if args.skew is None or args.skew <= 1 else f"skewed x{args.skew:g}"
    table = Table(title=f"{spec.name}, {args.tokens} tokens/rank, EP={args.ep}, {routing_name} routing, "
                        f"policy {args.policy}, {args.call} call, profile {profile.name}")
    for column in ("layer", "rank", "sent", "recv", "pairs", "c*", "K*", "steal", "us",
                   f"c={STATIC_BASELINE_C} us", "gain"):
        table.add_column(column, justify="right", no_wrap=True)
    for layer in range(args.layers):
        for wl in layer_workloads(spec, args.tokens, args.ep, skew=args.skew, layer=layer, seed=args.seed):
            p = plan(wl, profile, args.policy)
            static = plan(wl, profile, f"static:{STATIC_BASELINE_C}")
            gain = 1.0 - p.predicted_us / static.predicted_us
            table.add_row(str(layer), str(wl.rank), str(wl.dispatch_send_rows), str(wl.dispatch_recv_rows),
                          str(wl.num_pairs), describe_c(p, profile.num_sms), str(p.K), str(p.n_steal),
                          f"{p.predicted_us:.0f}", f"{static.predicted_us:.0f}", f"{100 * gain:+.1f}%")
    Console(width=max(Console().width, 120)).print(table)
    print("sent / recv = remote dispatch rows after dedup; pairs = GEMM rows; us = predicted latency; "
          f"gain = 1 - us / (static c={STATIC_BASELINE_C}, K=1)")
    if args.call == "resident":
        print("resident call: planned as its device planner plans (serial plans run the grouped GEMMs); us = the "
              "kernels' predicted time, without the call's fixed device work before them (routing exchange, counts, "
              "plan, task tables), which the model does not hold; --call host for the host-driven call")
    else:
        print(f"host-driven call: us includes the profile's call overhead ({profile.call_overhead_us:.0f} us of host "
              "work per call that the GPU waits for)")
    print(f"profile: {profile.source}")
    return 0
