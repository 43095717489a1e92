"""Two-GPU probe of the device-resident call at EP=2 (KernelConfig.resident="on"): what each rank's device state says
after a layer's first and second calls, written as JSON.

    python scripts/resident_ep2_probe.py --out $OUT/resident_ep2_probe.json

Why: on an H200 pair (bench/results/h200x2-session5/) one rank's first resident call waited out its whole deadline
while the other finished, and the ranks then hung in the next collective. This probe makes the calls without any
collective after them (ranks compare notes through the c10d store only, with limits), so a fault shows as data:
per rank and call, the status word ([error code, flag tag, value seen, value expected]: kernels/sync.py), the arrival
and combine flags, the plan row, the call header, whether every rank received the same routing messages, and the
output's error against weave_moe.reference. Policies: serial (the grouped GEMMs after a dispatch-only launch) and a
split one (static:20: one launch).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch

POLICIES = ("serial", "static:20")


def _read(tensor: torch.Tensor, device) -> list:
    """A copy to the host on a side stream: the layer's stream may hold a kernel that never ends."""
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        host = tensor.to("cpu", non_blocking=True)
    side.synchronize()
    return host.tolist()


def probe(rank: int, world_size: int, calls: int, wait_s: float, shared_gpu: bool = False) -> dict:
    import torch.distributed as dist

    from weave_moe.backends.weave.config import KernelConfig
    from weave_moe.backends.weave.workspace import retire_shared
    from weave_moe.layer import ExpertParallelMoE
    from weave_moe.models import MoESpec
    from weave_moe.reference import moe_error, reference_moe
    from weave_moe.testing import make_experts

    # --shared-gpu: both ranks on cuda:0 (a gloo group; the kernels of the two processes time-share the GPU, so the
    # protocol runs, slowly, on one GPU)
    device = torch.device("cuda", 0 if shared_gpu else rank)
    torch.cuda.set_device(device)
    store = dist.distributed_c10d._get_default_store()
    group = dist.group.WORLD
    spec = MoESpec(16, 2, 256, 128, name="probe")
    w13, w2 = make_experts(spec, seed=3, device=device)
    local = spec.num_experts // world_size
    results = {}
    for policy in POLICIES:
        layer = ExpertParallelMoE(spec, group=group, backend="weave", policy=policy, device=device,
                                  max_tokens_per_rank=64, timeout_s=2.0, debug_poison=True,
                                  config=KernelConfig(resident="on"))
        layer.load_experts(w13[rank * local:(rank + 1) * local], w2[rank * local:(rank + 1) * local])
        backend = layer.backend
        rows = []
        for call in range(calls):
            gen = torch.Generator(device).manual_seed(100 * call + rank)
            T = 48
            ids = torch.stack([torch.randperm(spec.num_experts, generator=gen, device=device)[:spec.top_k]
                               for _ in range(T)]).to(torch.int32)
            weights = torch.rand(T, spec.top_k, generator=gen, device=device)
            x = torch.randn(T, spec.hidden_size, generator=gen, device=device).to(torch.bfloat16)
            start = time.perf_counter()
            error = None
            try:
                out = layer(x, ids, weights)
            except Exception as exc:  # noqa: BLE001 - recorded
                error, out = f"{type(exc).__name__}: {exc}"[:800], None
            done = torch.cuda.Event()
            done.record()
            while not done.query() and time.perf_counter() - start < wait_s:
                time.sleep(0.01)
            row = dict(call=call, finished=done.query(), seconds=round(time.perf_counter() - start, 3),
                       error=error, status=_read(backend.status, device),
                       flags=_read(backend.workspace.flags(0), device), plans=_read(backend.plans_device, device),
                       header=_read(backend.header_device, device),
                       routing_sums=_read(backend.all_routing.long().sum(1), device))
            if row["finished"] and out is not None and error is None:
                ref = reference_moe(x, ids, weights, w13, w2)
                row["rel_error"] = float(moe_error(out, ref)[0])
                try:
                    layer.synchronize()
                except Exception as exc:  # noqa: BLE001 - recorded
                    row["sync_error"] = f"{type(exc).__name__}: {exc}"[:800]
            rows.append(row)
            print(f"rank {rank} {policy} call {call}: {json.dumps(row)[:900]}", flush=True)
            # line the ranks up through the store only (a collective could queue behind a kernel that never ends)
            key = f"probe/{policy}/{call}"
            store.set(f"{key}/{rank}", json.dumps(row))
            try:
                store.wait([f"{key}/{r}" for r in range(world_size)], datetime.timedelta(seconds=wait_s + 30))
            except Exception as exc:  # noqa: BLE001
                row["peer_missing"] = type(exc).__name__
                break
            peers = [json.loads(store.get(f"{key}/{r}")) for r in range(world_size)]
            row["same_routing_on_every_rank"] = len({tuple(p["routing_sums"]) for p in peers}) == 1
            if not all(p["finished"] for p in peers):
                break
        results[policy] = rows
        del layer
        retire_shared(group)  # every rank, same point: the next layer starts on a fresh workspace
        store.set(f"probe/{policy}/end/{rank}", "1")
        store.wait([f"probe/{policy}/end/{r}" for r in range(world_size)], datetime.timedelta(seconds=wait_s + 60))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--wait", type=float, default=15.0, help="seconds to wait for a call's kernels")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--shared-gpu", action="store_true",
                        help="both ranks on one GPU (gloo group): the protocol without a second GPU")
    args = parser.parse_args()
    from weave_moe.reference import DEFAULT_TOLERANCE
    from weave_moe.testing import run_distributed

    per_rank = run_distributed(probe, 2, args.calls, args.wait, args.shared_gpu,
                               backend="gloo" if args.shared_gpu else "nccl", shared_device=args.shared_gpu,
                               timeout_s=args.timeout)
    with open(args.out, "w") as handle:
        json.dump(dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), ranks=per_rank), handle,
                  indent=1)
    ok = all(row.get("finished") and not row.get("error") and row.get("rel_error", 1.0) <= DEFAULT_TOLERANCE
             and not row.get("sync_error") for result in per_rank for rows in result.values() for row in rows)
    print("resident EP=2 probe:", "all calls correct" if ok else "FAILURES (see the rows above)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
