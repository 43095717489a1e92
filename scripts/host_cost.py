"""Where the host time of one resident weave call goes (one GPU): medians of many calls, each timed alone.

python scripts/host_cost.py --model qwen3-30b-a3b --tokens 1 --emulate-ep 2 [--policy serial] [--out host.json]

Times (microseconds, CPU clock, the GPU drained before each sample so no queue backs up): the whole layer call
(host return; also into a reused `out=` buffer), the backend's forward alone, and its pieces one by one:
torch.empty for out, the slot write of an eager call (CallSlots), pack_call (what a call captured into a caller's
graph launches instead), a slot write + the graph replay, the event record after it (cached stream). Also the GPU
time of one call (events).
"""

import argparse
import functools
import json
import statistics
import time

import torch


def median_us(fn, calls=200, drain=True, digits=1):
    """Median host microseconds of `fn` over `calls` calls; `drain`: the GPU drained before each (no queue backs up),
    else calls queue behind each other as in a serving loop."""
    samples = []
    for _ in range(calls):
        if drain:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(samples), digits)


def main():
    from weave_moe import routing
    from weave_moe.bench.config import emulated_spec
    from weave_moe.bench.variants import parse_variant
    from weave_moe.layer import ExpertParallelMoE
    from weave_moe.models import MoESpec
    from weave_moe.testing import make_experts

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", default="1,2048")
    parser.add_argument("--emulate-ep", type=int, default=2)
    parser.add_argument("--policies", default="serial,weave")
    parser.add_argument("--out")
    parser.add_argument("--cprofile", type=int, default=0, help="also profile this many layer calls per row (cProfile)")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    spec = emulated_spec(MoESpec.from_name(args.model), args.emulate_ep)
    w13, w2 = make_experts(spec, spec.num_experts, first_expert=0, seed=1, device=device)
    report = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        ids, w = routing.uniform(tokens, spec.num_experts, spec.top_k, seed=0)
        ids, w = ids.to(device).to(torch.int32), w.to(device)
        x = torch.randn(tokens, spec.hidden_size, device=device).to(torch.bfloat16)
        for policy in args.policies.split(","):
            # as `weave-moe bench` makes it (under --emulate-ep the layer plans as a rank of that EP would)
            options = parse_variant(f"weave:{policy}").layer_options(emulated=args.emulate_ep > 1)
            layer = ExpertParallelMoE(spec, backend="weave", device=device, max_tokens_per_rank=tokens,
                                      check_expert_ids=False, **options)
            layer.load_experts(w13, w2)
            for _ in range(5):
                layer(x, ids, w)
            torch.cuda.synchronize()
            b = layer.backend
            row = dict(model=args.model, tokens=tokens, policy=policy, resident=bool(b.resident))
            row["layer_call_us"] = median_us(functools.partial(layer, x, ids, w))
            row["backend_forward_us"] = median_us(lambda: b.forward(x, ids, w))
            with torch.no_grad():
                row["layer_call_no_grad_us"] = median_us(functools.partial(layer, x, ids, w))
            buf = torch.empty(tokens, spec.hidden_size, dtype=torch.bfloat16, device=device)
            row["layer_call_out_us"] = median_us(functools.partial(layer, x, ids, w, out=buf))   # a serving engine's call
            row["empty_out_us"] = median_us(lambda: torch.empty(tokens, spec.hidden_size, dtype=torch.bfloat16,
                                                                device=device))
            out = torch.empty(tokens, spec.hidden_size, dtype=torch.bfloat16, device=device)
            # the pack a call captured into a caller's graph launches; an eager call writes its slot instead
            row["pack_call_us"] = median_us(lambda: b.message.pack_call(b.send_routing, ids, w, b.header_device, b.io,
                                                                        x, out, 0, b.status, b.ctrl,
                                                                        b.workspace.flags(0), spec.num_experts))
            slots = type(b.slots)(b.message, device)   # a ring of its own: the layer's must stay in step
            row["slot_write_us"] = median_us(lambda: (slots.write(x, out, ids, w, 0, None),
                                                      slots.consumed_numpy.__setitem__(0, slots.written)))
            row["current_stream_cached_us"] = median_us(b._current_stream)
            graphs = [g for name, (g, _) in b.graphs.graphs.items() if name.startswith("resident")]
            if graphs:
                # every replay of the layer's graph reads the next call slot: write one first, as a call does
                def write_slot():
                    b.slots.write(x, out, ids, w, 0, None)
                write_slot()
                graphs[0].replay()
                row["slot_write_and_replay_us"] = median_us(lambda: (write_slot(), graphs[0].replay()))
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                gpu = []
                for _ in range(50):
                    torch.cuda.synchronize()
                    write_slot()
                    start.record()
                    graphs[0].replay()
                    end.record()
                    end.synchronize()
                    gpu.append(start.elapsed_time(end) * 1e3)
                row["graph_gpu_us"] = round(statistics.median(gpu), 1)
            event = torch.cuda.Event()
            row["event_record_us"] = median_us(lambda: event.record(b._current_stream()))
            timings = {}
            for _ in range(50):
                torch.cuda.synchronize()
                layer(x, ids, w, timings=timings)
            row.update({k: round(v * 1e3 / 50, 1) for k, v in timings.items()})
            print(json.dumps(row), flush=True)
            report.append(row)
            if args.cprofile:
                import cProfile
                import pstats
                profiler = cProfile.Profile()
                torch.cuda.synchronize()
                profiler.enable()
                for _ in range(args.cprofile):
                    layer(x, ids, w)
                profiler.disable()
                torch.cuda.synchronize()
                print(f"##### cProfile, {args.cprofile} layer calls, {policy}, {tokens} tokens", flush=True)
                pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
            del layer
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
