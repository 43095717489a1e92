"""Profile one layer call per variant on 2 GPUs (torch.profiler, rank 0): where does the time go?

python scripts/profile_layer.py --model qwen3-30b-a3b --tokens 2048 --variants nccl,weave,weave:serial
python scripts/profile_layer.py --nproc 1 --emulate-ep 2 ...     (one GPU: the per-rank work of EP=2)

Per variant: host-return and synchronised milliseconds of 10 single calls, the per-step milliseconds the backend
reports through `layer(..., timings=)` (mean of 10 more calls; for weave the host steps), torch.profiler's CUDA
and CPU tables of 3 more calls, and the GPU timeline of one more call (`kernel_timeline`: each kernel's start and
duration from the GPU's own timestamps, the call's span, and how long after its first kernel the first grouped GEMM
starts). The `profile` stage of scripts/device_run.sh runs it.
"""

import argparse
import time

import torch

from weave_moe.testing import make_experts, run_distributed

#: kernels that start a call's GEMMs (the grouped GEMM0 of serial plans; a one-launch plan's first GEMM tile is inside
#: the megakernel and not seen here)
GEMM_KERNELS = ("_gemm0_kernel",)


def kernel_timeline(events) -> dict:
    """One profiled call's GPU work from torch.profiler's events (`prof.events()`): `kernels` [(name, start_us,
    duration_us)] in start order, relative to the first one's start (with programmatic dependent launch a kernel's
    span includes the time its CTAs waited for the one before: spans overlap); `span_us`: last end - first start,
    the call's GPU time; `before_gemm_us`: when the first GEMM kernel (`GEMM_KERNELS`) can start its work, None
    without one: its own start or, if later, the last end of the kernels that started before it (every one of them
    precedes it in the call's graph, and with PDL a kernel's CTAs start early but wait at `griddepcontrol.wait` until
    its predecessor has ended, so the start alone would under-count the work before the GEMM)."""
    from torch.autograd import DeviceType

    work = sorted(((e.name, e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA), key=lambda item: item[1])
    if not work:
        return dict(kernels=[], span_us=0.0, before_gemm_us=None)
    origin = work[0][1]
    first = next((i for i, (name, _, _) in enumerate(work) if any(k in name for k in GEMM_KERNELS)), None)
    before = None
    if first is not None:
        before = max([work[first][1]] + [end for _, _, end in work[:first]]) - origin
    return dict(kernels=[(name, start - origin, end - start) for name, start, end in work],
                span_us=max(end for _, _, end in work) - origin, before_gemm_us=before)


def worker(rank, world_size, model, tokens, variants, rows, emulate_ep=1, skew=0.0):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from weave_moe import routing
    from weave_moe.layer import ExpertParallelMoE
    from weave_moe.bench.config import emulated_spec
    from weave_moe.bench.variants import parse_variant
    from weave_moe.models import MoESpec

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    spec = emulated_spec(MoESpec.from_name(model), emulate_ep)
    local = spec.num_experts // world_size
    w13, w2 = make_experts(spec, local, first_expert=rank * local, seed=1, device=device)
    if skew:   # as the bench draws skewed routing (busiest expert / mean count)
        ids, w = routing.skewed(tokens, spec.num_experts, spec.top_k, skew=skew, seed=rank)
    else:
        ids, w = routing.uniform(tokens, spec.num_experts, spec.top_k, seed=rank)
    ids, w = ids.to(device), w.to(device)
    x = torch.randn(tokens, spec.hidden_size, device=device).to(torch.bfloat16)
    report = []
    for variant in variants:
        # as `weave-moe bench` makes it (under --emulate-ep a weave layer plans as a rank of that EP would)
        parsed = parse_variant(variant)
        layer = ExpertParallelMoE(spec, backend=parsed.backend, device=device, max_tokens_per_rank=tokens,
                                  check_expert_ids=False, **parsed.layer_options(emulated=emulate_ep > 1))
        layer.load_experts(w13, w2)
        for _ in range(3):
            layer(x, ids, w)
        torch.cuda.synchronize()
        dist.barrier()
        times, steps, calls = [], {}, 10  # warm-up (compile, graph capture, NCCL init) stays out of both
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            layer(x, ids, w)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            times.append(((t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3))
        # Separate calls for the per-step figures: a backend may time its steps with events it waits for.
        for _ in range(calls):
            timings = {}
            layer(x, ids, w, timings=timings)
            torch.cuda.synchronize()
            for name, ms in timings.items():
                steps[name] = steps.get(name, 0.0) + ms
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                layer(x, ids, w)
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as one:
            layer(x, ids, w)
            torch.cuda.synchronize()
        timeline = kernel_timeline(one.events())
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)
        cpu_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows)
        if steps:
            table = "ms per call by step: " + ", ".join(f"{k}={v / calls:.3f}" for k, v in steps.items()) + "\n" + table
        report.append((variant, times, table, cpu_table, timeline))
        del layer
        dist.barrier()
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--variants", default="nccl,weave,weave:serial")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--emulate-ep", type=int, default=1)
    parser.add_argument("--skew", type=float, default=0.0,
                        help="skewed routing with this busiest-expert / mean count (the bench's 3.0); 0: uniform")
    args = parser.parse_args()
    results = run_distributed(worker, args.nproc, args.model, args.tokens, args.variants.split(","), args.rows,
                              args.emulate_ep, args.skew, backend="nccl", timeout_s=500)
    for variant, times, table, cpu_table, timeline in results[0]:
        print(f"##### {variant}: host-return ms / synced ms per call:",
              " ".join(f"{a:.2f}/{b:.2f}" for a, b in times))
        print(table)
        print(cpu_table)
        before = timeline["before_gemm_us"]
        print(f"##### {variant}: one call's GPU span {timeline['span_us']:.1f} us, first grouped GEMM's work from "
              + ("-" if before is None else f"{before:.1f} us"))
        for name, start, duration in timeline["kernels"]:
            print(f"  {start:8.1f} us  +{duration:7.1f} us  {name[:90]}")
