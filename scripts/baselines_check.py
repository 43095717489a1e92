"""One-GPU check of the baselines (nccl, symm, deepep) and of nccl's GEMM stage against torch._grouped_mm alone.

Run under torchrun with one process (symm needs a process group for its exchange path):

    torchrun --nproc-per-node 1 scripts/baselines_check.py --out $OUT/baselines_check.json

1. Correctness at EP=1 through the layer (no process group: each backend's local expert stage) against the
   reference, for two paper models with skewed routing, -1 holes, an empty token, T=1 and T=0.
2. The exchange paths on a one-rank process group (the backends built directly with the group): nccl (NCCL
   all-to-all) and symm (NVSHMEM all_to_all_vdev_2d / _offset, E_local > 16 so its expert buckets are exercised),
   each paper model at 2048 tokens against the reference, with the host syncs of one call counted (nccl: 1, the
   split sizes; symm: 0) and its per-stage ms. DeepEP has no one-rank config: reported as skipped.
3. Timing, per paper model at 2048 and 8192 tokens, on the per-rank work of EP=2 (E/2 local experts, T*k rows,
   uniform routing): lib_compute_ms = torch._grouped_mm GEMM0 + torch SiLU-mul + GEMM1 on rows already grouped by
   expert, in a CUDA graph; nccl at EP=1 on the same work with per-stage CUDA events: "gemms" (GEMM0 + Triton
   SiLU-mul + GEMM1, the like-for-like stage), "permute" + "unpermute" (the glue), and the whole call. Ratios
   against lib_compute_ms; the issue's target is gemms <= 1.10x. nccl's output is checked against the reference.
A backend that cannot be built (no NVSHMEM, no deep_ep) is recorded with its error, not fatal.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from weave_moe import routing
from weave_moe.layer import ExpertParallelMoE
from weave_moe.models import PAPER_MODELS, MoESpec
from weave_moe.reference import DEFAULT_TOLERANCE, moe_error, reference_moe
from weave_moe.testing import make_experts


_EXPECTED_HOST_SYNCS = {"nccl": 1, "symm": 0}  # per exchange-path call: nccl's split sizes; symm none


def make_inputs(spec: MoESpec, num_tokens: int, routing_kind: str, seed: int, device):
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, spec.hidden_size, generator=generator, device=device).to(torch.bfloat16)
    if routing_kind == "skewed":
        skew = min(3.0, routing.max_skew(spec.num_experts, spec.top_k))
        ids, weights = routing.skewed(num_tokens, spec.num_experts, spec.top_k, skew=skew, seed=seed, device=device)
    else:
        ids, weights = routing.uniform(num_tokens, spec.num_experts, spec.top_k, seed=seed, device=device)
    ids = ids.to(torch.int32)
    if routing_kind == "skewed" and num_tokens > 1:
        ids[0] = -1  # a token with no expert, and holes in another
        ids[1, ::2] = -1
    return x, ids, weights


def check_layer(backend: str, spec: MoESpec, w13, w2, device) -> list[dict]:
    """EP=1 through the layer, several token counts, against the reference."""
    rows = []
    layer = ExpertParallelMoE(spec, backend=backend, max_tokens_per_rank=1024, device=device)
    layer.load_experts(w13, w2)
    for num_tokens in (1024, 37, 1, 0):
        x, ids, weights = make_inputs(spec, num_tokens, "skewed", seed=num_tokens, device=device)
        out = layer(x, ids, weights)
        again = layer(x, ids, weights)
        ref = reference_moe(x, ids, weights, w13, w2)
        rel_fro, max_abs = moe_error(out, ref)
        rows.append({"backend": backend, "model": spec.name, "tokens": num_tokens, "path": "layer EP=1",
                     "rel_fro": rel_fro, "max_abs": max_abs, "repeat_bitwise": torch.equal(out, again),
                     "ok": rel_fro <= DEFAULT_TOLERANCE and torch.equal(out, again)})
    return rows


def check_exchange(backend_class, spec: MoESpec, w13, w2, num_tokens: int, device) -> dict:
    """The backend's exchange path on the one-rank WORLD group, against the reference."""
    backend = backend_class(spec, dist.group.WORLD, 0, 1, num_tokens, device)
    backend.load_experts(w13, w2)
    x, ids, weights = make_inputs(spec, num_tokens, "skewed", seed=7, device=device)
    out = backend.forward(x, ids, weights)  # also compiles the Triton kernels
    host_syncs = count_host_syncs(functools.partial(backend.forward, x, ids, weights))
    timings: dict = {}
    backend.forward(x, ids, weights, timings=timings)
    small = backend.forward(x[:5], ids[:5], weights[:5])
    ref = reference_moe(x, ids, weights, w13, w2)
    rel_fro, max_abs = moe_error(out, ref)
    rel_small, _ = moe_error(small, ref[:5])
    del backend
    torch.cuda.empty_cache()
    return {"backend": backend_class.name, "model": spec.name, "tokens": num_tokens, "path": "exchange, 1-rank group",
            "rel_fro": rel_fro, "max_abs": max_abs, "rel_small": rel_small, "timings_ms": timings, "host_syncs": host_syncs,
            "ok": rel_fro <= DEFAULT_TOLERANCE and rel_small <= DEFAULT_TOLERANCE
            and host_syncs == _EXPECTED_HOST_SYNCS[backend_class.name]}


def count_host_syncs(call) -> int:
    """Synchronizing CUDA calls (blocking copies, stream syncs) made by `call()` (CUDA sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def time_cuda(fn, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def lib_compute_ms(spec_local: MoESpec, w13, w2, ids, iters: int) -> float:
    """torch._grouped_mm GEMM0 + SiLU-mul (torch ops) + GEMM1 on the rows grouped by expert, in a CUDA graph."""
    num_local = spec_local.num_experts
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat[flat >= 0], minlength=num_local)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    num_pairs = int(offsets[-1])
    rows = torch.randn(num_pairs, spec_local.hidden_size, device=ids.device).to(torch.bfloat16)
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    intermediate = spec_local.intermediate_size

    def compute():
        gate_up = torch._grouped_mm(rows, w13_t, offs=offsets)
        h = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        return torch._grouped_mm(h, w2_t, offs=offsets)

    for _ in range(3):
        compute()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compute()
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(time_cuda(graph.replay, iters))


def time_nccl(spec: MoESpec, num_tokens: int, device, iters: int) -> dict:
    """nccl at EP=1 on the per-rank work of EP=2: E/2 local experts, T*k rows, uniform routing."""
    spec_local = MoESpec(spec.num_experts // 2, spec.top_k, spec.hidden_size, spec.intermediate_size,
                         name=f"{spec.name}/EP2-rank")
    w13, w2 = make_experts(spec_local, seed=1, device=device)
    x, ids, weights = make_inputs(spec_local, num_tokens, "uniform", seed=3, device=device)
    lib_ms = lib_compute_ms(spec_local, w13, w2, ids, iters)
    layer = ExpertParallelMoE(spec_local, backend="nccl", max_tokens_per_rank=num_tokens, device=device,
                              check_expert_ids=False)
    layer.load_experts(w13, w2)
    for _ in range(3):
        out = layer(x, ids, weights)
    torch.cuda.synchronize()
    call_ms = statistics.median(time_cuda(functools.partial(layer, x, ids, weights), iters))
    stages: dict[str, list] = {}
    for _ in range(iters):
        timings: dict = {}
        layer(x, ids, weights, timings=timings)
        for stage, ms in timings.items():
            stages.setdefault(stage, []).append(ms)
    stage_ms = {stage: statistics.median(values) for stage, values in stages.items()}
    ref = reference_moe(x, ids, weights, w13, w2)
    rel_fro, _ = moe_error(out, ref)
    experts_ms = stage_ms["permute"] + stage_ms["gemms"] + stage_ms["unpermute"]
    result = {"model": spec.name, "tokens": num_tokens, "local_experts": spec_local.num_experts,
              "pairs": num_tokens * spec.top_k, "lib_compute_ms": lib_ms, "nccl_call_ms": call_ms,
              "nccl_stage_ms": stage_ms, "gemms_over_lib": stage_ms["gemms"] / lib_ms,
              "experts_over_lib": experts_ms / lib_ms, "call_over_lib": call_ms / lib_ms, "rel_fro": rel_fro,
              "ok": rel_fro <= DEFAULT_TOLERANCE}
    del layer, w13, w2
    torch.cuda.empty_cache()
    return result


def guarded(results: list, label: str, fn, *args):
    try:
        value = fn(*args)
        results.extend(value if isinstance(value, list) else [value])
    except Exception as error:  # noqa: BLE001 - record and go on: one missing backend must not hide the others
        results.append({"label": label, "error": f"{type(error).__name__}: {error}",
                        "traceback": traceback.format_exc(limit=4), "ok": False})
    print(json.dumps(results[-1], default=str)[:400], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "baselines_check.json"))
    parser.add_argument("--models", default=",".join(PAPER_MODELS))
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    # NVSHMEM's heap is sized once, when the first symm buffer is allocated: room for every model's buffers here.
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(8 * 2**30))
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    models = args.models.split(",")
    started = time.time()
    report: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                    "checks": [], "timings": []}

    from weave_moe.backends.nccl import NcclBackend
    from weave_moe.backends.symm import SymmBackend

    for name in ("qwen3-30b-a3b", "phi-3.5-moe"):
        spec = MoESpec.from_name(name)
        w13, w2 = make_experts(spec, seed=2, device=device)
        for backend in ("nccl", "symm", "deepep"):
            guarded(report["checks"], f"{backend} layer {name}", check_layer, backend, spec, w13, w2, device)
        del w13, w2
    for name in models:
        spec = MoESpec.from_name(name)
        w13, w2 = make_experts(spec, seed=2, device=device)
        for backend_class in (NcclBackend, SymmBackend):
            guarded(report["checks"], f"{backend_class.name} exchange {name}", check_exchange, backend_class, spec,
                    w13, w2, 2048, device)
        del w13, w2
        torch.cuda.empty_cache()
    report["checks"].append({"backend": "deepep", "path": "exchange, 1-rank group", "ok": None,
                             "skipped": "DeepEP's intranode configs need 2, 4 or 8 ranks"})
    for name in models:
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            guarded(report["timings"], f"nccl timing {name} {num_tokens}", time_nccl, MoESpec.from_name(name),
                    num_tokens, device, args.iters)
    try:
        import deep_ep  # noqa: F401 - only to report the installed version
        import importlib.metadata

        report["deep_ep_version"] = importlib.metadata.version("deep_ep")
    except ImportError as error:
        report["deep_ep_version"] = f"not importable: {error}"
    report["wall_s"] = time.time() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as file:
        json.dump(report, file, indent=1, default=str)
    print(f"\n{'model':<18} {'T':>5} {'lib ms':>7} {'gemms':>7} {'x lib':>6} {'experts':>8} {'x lib':>6} "
          f"{'call':>7} {'x lib':>6}")
    for row in report["timings"]:
        if "error" in row:
            print(row["label"], row["error"])
            continue
        stage = row["nccl_stage_ms"]
        experts = stage["permute"] + stage["gemms"] + stage["unpermute"]
        print(f"{row['model']:<18} {row['tokens']:>5} {row['lib_compute_ms']:>7.3f} {stage['gemms']:>7.3f} "
              f"{row['gemms_over_lib']:>6.3f} {experts:>8.3f} {row['experts_over_lib']:>6.3f} "
              f"{row['nccl_call_ms']:>7.3f} {row['call_over_lib']:>6.3f}")
    failed = [row for row in report["checks"] + report["timings"] if row.get("ok") is False]
    print(f"\n{len(failed)} failed checks; results in {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
