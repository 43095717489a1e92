"""The weave grouped GEMMs (kernels/grouped_gemm.py) against torch._grouped_mm on the expert work of one rank.

    PYTHONPATH=src python3 scripts/gemm_bench.py --out $OUT            # six paper models x 2048 / 8192 tokens

Work per shape: the per-rank work of EP=2 with uniform routing: 2T tokens (T per rank, two ranks) each pick k
distinct experts of E at random; this rank owns experts [0, E/2) and gets every pair that lands there (about T*k rows),
rows grouped by expert. Both sides compute GEMM0 [P, H] x w13 -> silu(gate) * up -> h [P, I] bf16 -> GEMM1 -> y [P, H]
bf16 on the same groups.

Library side: torch._grouped_mm GEMM0, then SiLU-mul as the nccl backend does it (fp32 silu * up, one bf16 rounding),
then torch._grouped_mm GEMM1 ("library"); also the two grouped_mm alone ("library GEMMs only", a lower bound of any
library pipeline). Weave side: grouped_gemm0 (SiLU-mul fused) + grouped_gemm1, several configs each; the tile table
build (a few small torch ops) is timed apart.

Check: every variant's h and y against an fp32 reference of the same bf16 inputs, ||out - ref|| / ||ref|| <= 1e-2
(bf16 operands; h rounded to bf16 before GEMM1 on both sides), outputs poisoned with NaN before each checked run.
Timing: each measured region captured in a CUDA graph, replayed after 3 warm-up replays, median of --reps replays
timed by CUDA events. FLOPs counted as 6 * P * H * I (useful FLOPs, padding not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from weave_moe.backends.weave.kernels import gemm_configs as gc
from weave_moe.backends.weave.kernels import grouped_gemm as gg
from weave_moe.bench.anchor import graph_replay_ms
from weave_moe.models import PAPER_MODELS, MoESpec

C = gc.GemmConfig
# name -> config; GEMM0 configs ("interleaved" picks the w13 layout).
GEMM0_VARIANTS = {
    "128x256x64 s3 masked flat": C(epilogue=0),
    "128x256x64 s3 clippedTMA flat": C(epilogue=2),
    "128x256x64 s3 TMA noflat": C(epilogue=1, flatten=False),
    "128x256x64 s4 TMA noflat": C(epilogue=1, flatten=False, num_stages=4),
    "128x256x64 s3 masked flat 2dots": C(epilogue=0, interleaved=False),
    "128x128x64 s4 masked flat": C(block_n=128, num_stages=4, epilogue=0),
    "64x256x64 s4 w4 masked flat": C(block_m=64, num_warps=4, num_stages=4, epilogue=0),
    "64x256x64 s4 w4 TMA noflat": C(block_m=64, num_warps=4, num_stages=4, epilogue=1, flatten=False),
    "128x256x64 s3 masked flat g4": C(epilogue=0, group_m=4),
    "128x256x64 s3 masked flat g16": C(epilogue=0, group_m=16),
    "128x256x64 s4 clippedTMA flat": C(epilogue=2, num_stages=4),
    "128x256x128 s2 clippedTMA flat": C(epilogue=2, num_stages=2, block_k=128),
    "64x256x64 s4 w4 clippedTMA flat": C(block_m=64, num_warps=4, num_stages=4, epilogue=2),
    "64x256x64 s5 w4 masked flat": C(block_m=64, num_warps=4, num_stages=5, epilogue=0),
    "64x128x64 s4 w4 masked flat": C(block_m=64, block_n=128, num_warps=4, num_stages=4, epilogue=0),
    "128x256x64 s4 clippedTMA flat split": C(epilogue=2, num_stages=4, split_tail=True),
    "128x256x64 s3 clippedTMA flat split": C(epilogue=2, num_stages=3, split_tail=True),
}
GEMM1_VARIANTS = {
    "128x256x64 s3 masked flat": C(epilogue=0),
    "128x256x64 s3 clippedTMA flat": C(epilogue=2),
    "128x256x64 s3 TMA noflat": C(epilogue=1, flatten=False),
    "128x128x64 s4 masked flat": C(block_n=128, num_stages=4, epilogue=0),
    "64x256x64 s4 w4 masked flat": C(block_m=64, num_warps=4, num_stages=4, epilogue=0),
    "64x256x64 s4 w4 TMA noflat": C(block_m=64, num_warps=4, num_stages=4, epilogue=1, flatten=False),
    "128x256x64 s4 masked flat": C(epilogue=0, num_stages=4),
    "64x256x64 s4 w4 clippedTMA flat": C(block_m=64, num_warps=4, num_stages=4, epilogue=2),
    "64x256x64 s5 w4 masked flat": C(block_m=64, num_warps=4, num_stages=5, epilogue=0),
    "128x256x64 s3 masked flat g16": C(epilogue=0, group_m=16),
    "128x256x64 s4 masked flat split": C(epilogue=0, num_stages=4, split_tail=True),
    "128x256x64 s3 masked flat split": C(epilogue=0, num_stages=3, split_tail=True),
}


def graph_time_ms(fn, reps: int) -> float:
    """Median ms of `fn` captured in a CUDA graph, over `reps` replays."""
    return statistics.median(graph_replay_ms(fn, reps))


def make_work(spec: MoESpec, tokens: int, routing: str, seed: int):
    """Row counts of rank 0's E/2 local experts when 2 * tokens tokens (two ranks) are routed by weave_moe.routing
    (`uniform`, or `skewed` with its default skew 3): the per-rank work of EP=2."""
    from weave_moe import routing as routing_lib

    num_local = spec.num_experts // 2
    if routing == "uniform":
        ids, _ = routing_lib.uniform(2 * tokens, spec.num_experts, spec.top_k, seed=seed)
    else:
        ids, _ = routing_lib.skewed(2 * tokens, spec.num_experts, spec.top_k, seed=seed)
    ids = ids.long()
    return torch.bincount(ids[ids < num_local].flatten(), minlength=num_local).to("cuda")


def bench_shape(spec: MoESpec, tokens: int, routing: str, reps: int, variants0: dict, variants1: dict, log) -> dict:
    torch.manual_seed(tokens)
    num_local = spec.num_experts // 2
    hidden, inter = spec.hidden_size, spec.intermediate_size
    counts = make_work(spec, tokens, routing, seed=tokens)
    rows = int(counts.sum())
    offsets = torch.zeros(num_local + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(counts, 0)
    alloc_rows = (rows + 127) // 128 * 128  # the backend's pair buffers are sized by a bound, not the exact count
    a = torch.randn(alloc_rows, hidden, device="cuda").bfloat16()
    w13 = (torch.randn(num_local, 2 * inter, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(num_local, hidden, inter, device="cuda") / inter ** 0.5).bfloat16()
    w13_interleaved = gg.interleave_w13(w13)
    flops = 6.0 * rows * hidden * inter
    result = dict(model=spec.name, tokens=tokens, routing=routing, local_experts=num_local, hidden=hidden, intermediate=inter,
                  rows=rows, rows_min=int(counts.min()), rows_max=int(counts.max()), gflop=flops / 1e9)

    # fp32 reference of the same bf16 inputs on up to 16 experts spread over the range (first and last included):
    # a full fp32 reference of DeepSeek-V3 at 8192 tokens would take over a minute. tf32 products: ~3e-4 error, far
    # under the 1e-2 bound. NaN poisoning is checked on every row.
    offs_host = offsets.tolist()
    checked = sorted(set(torch.linspace(0, num_local - 1, min(16, num_local)).round().long().tolist()))
    check_rows = torch.cat([torch.arange(offs_host[e], offs_host[e + 1], device="cuda") for e in checked])
    h_ref = torch.empty(rows, inter, device="cuda")
    y_ref = torch.empty(rows, hidden, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    for e in checked:
        s, f = offs_host[e], offs_host[e + 1]
        if s == f:
            continue
        gu = a[s:f].float() @ w13[e].float().T
        h_ref[s:f] = F.silu(gu[:, :inter]) * gu[:, inter:]
        y_ref[s:f] = h_ref[s:f].bfloat16().float() @ w2[e].float().T
    torch.backends.cuda.matmul.allow_tf32 = False
    h_ref, y_ref = h_ref[check_rows], y_ref[check_rows]
    h_lib_in = torch.randn(rows, inter, device="cuda").bfloat16()  # GEMM1 input of the timed runs
    h_lib_in[check_rows] = h_ref.bfloat16()
    result["checked_experts"] = len(checked)

    def rel_err(out, ref):
        if torch.isnan(out).any():
            return float("nan")
        out = out[check_rows].float()
        return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()

    # library
    ends = offsets[1:].contiguous()
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    a_rows = a[:rows]

    def library_gemm0():
        return torch._grouped_mm(a_rows, w13_t, offs=ends)

    def library():
        gu = torch._grouped_mm(a_rows, w13_t, offs=ends)
        h = (F.silu(gu[:, :inter].float()) * gu[:, inter:].float()).bfloat16()
        return torch._grouped_mm(h, w2_t, offs=ends)

    def library_gemms_only():
        torch._grouped_mm(a_rows, w13_t, offs=ends)
        torch._grouped_mm(h_lib_in, w2_t, offs=ends)

    y_lib = library()
    result["library_err_y"] = rel_err(y_lib, y_ref)
    result["library_ms"] = graph_time_ms(library, reps)
    result["library_gemms_only_ms"] = graph_time_ms(library_gemms_only, reps)
    result["library_gemm0_ms"] = graph_time_ms(library_gemm0, reps)
    result["library_gemm1_ms"] = graph_time_ms(lambda: torch._grouped_mm(h_lib_in, w2_t, offs=ends), reps)
    result["library_tflops"] = flops / result["library_ms"] / 1e9
    log(f"  library {result['library_ms']:.3f} ms (gemms only {result['library_gemms_only_ms']:.3f}; "
        f"gemm0 {result['library_gemm0_ms']:.3f}, gemm1 {result['library_gemm1_ms']:.3f}), err {result['library_err_y']:.2e}")

    tables = {}

    def table(cfg):
        key = (cfg.block_m, cfg.split_tail)
        if key not in tables:
            tables[key] = gg.build_tile_table(offsets, cfg.block_m, alloc_rows, cfg.split_tail)
        return tables[key]

    result["tile_table_ms"] = graph_time_ms(lambda: gg.build_tile_table(offsets, 128, alloc_rows), reps)
    h = torch.empty(alloc_rows, inter, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(alloc_rows, hidden, device="cuda", dtype=torch.bfloat16)
    h_in = torch.zeros(alloc_rows, inter, device="cuda", dtype=torch.bfloat16)
    h_in[:rows] = h_lib_in
    g0, g1 = {}, {}
    for name, cfg in variants0.items():
        try:
            tiles = table(cfg)
            w = w13_interleaved if cfg.interleaved else w13
            h.fill_(float("nan"))
            gg.grouped_gemm0(a, w, h, tiles, cfg)
            torch.cuda.synchronize()
            err = rel_err(h[:rows], h_ref)
            ms = graph_time_ms(lambda: gg.grouped_gemm0(a, w, h, tiles, cfg), reps)
            g0[name] = dict(ms=ms, err=err, ok=bool(err <= 1e-2))
            log(f"  gemm0 {name:34s} {ms:.3f} ms  err {err:.2e}  (library {result['library_gemm0_ms']:.3f})")
        except Exception as exc:  # a config that does not compile or fit must not stop the sweep
            g0[name] = dict(error=repr(exc)[:500])
            log(f"  gemm0 {name}: FAILED {repr(exc)[:300]}")
    for name, cfg in variants1.items():
        try:
            tiles = table(cfg)
            y.fill_(float("nan"))
            gg.grouped_gemm1(h_in, w2, y, tiles, cfg)
            torch.cuda.synchronize()
            err = rel_err(y[:rows], y_ref)
            ms = graph_time_ms(lambda: gg.grouped_gemm1(h_in, w2, y, tiles, cfg), reps)
            g1[name] = dict(ms=ms, err=err, ok=bool(err <= 1e-2))
            log(f"  gemm1 {name:34s} {ms:.3f} ms  err {err:.2e}  (library {result['library_gemm1_ms']:.3f})")
        except Exception as exc:
            g1[name] = dict(error=repr(exc)[:500])
            log(f"  gemm1 {name}: FAILED {repr(exc)[:300]}")
    result["gemm0"], result["gemm1"] = g0, g1
    ok0 = {k: v for k, v in g0.items() if v.get("ok")}
    ok1 = {k: v for k, v in g1.items() if v.get("ok")}
    if ok0 and ok1:
        best0 = min(ok0, key=lambda k: ok0[k]["ms"])
        best1 = min(ok1, key=lambda k: ok1[k]["ms"])
        cfg0, cfg1 = variants0[best0], variants1[best1]
        w = w13_interleaved if cfg0.interleaved else w13
        t0, t1 = table(cfg0), table(cfg1)

        def weave():
            gg.grouped_gemm0(a, w, h, t0, cfg0)
            gg.grouped_gemm1(h, w2, y, t1, cfg1)

        def weave_with_tables():
            u0 = gg.build_tile_table(offsets, cfg0.block_m, alloc_rows, cfg0.split_tail)
            u1 = u0 if (cfg1.block_m, cfg1.split_tail) == (cfg0.block_m, cfg0.split_tail) else \
                gg.build_tile_table(offsets, cfg1.block_m, alloc_rows, cfg1.split_tail)
            gg.grouped_gemm0(a, w, h, u0, cfg0)
            gg.grouped_gemm1(h, w2, y, u1, cfg1)

        h.fill_(float("nan"))
        y.fill_(float("nan"))
        weave()
        torch.cuda.synchronize()
        result["weave_err_h"] = rel_err(h[:rows], h_ref)
        result["weave_err_y"] = rel_err(y[:rows], y_ref)
        result["weave_best"] = dict(gemm0=best0, gemm1=best1)
        result["weave_ms"] = graph_time_ms(weave, reps)
        result["weave_with_tables_ms"] = graph_time_ms(weave_with_tables, reps)
        result["weave_tflops"] = flops / result["weave_ms"] / 1e9
        result["weave_vs_library"] = result["weave_ms"] / result["library_ms"]
        result["weave_vs_library_gemms_only"] = result["weave_ms"] / result["library_gemms_only_ms"]
        log(f"  weave best {best0} + {best1}: {result['weave_ms']:.3f} ms ({result['weave_tflops']:.0f} TFLOP/s), "
            f"with tables {result['weave_with_tables_ms']:.3f}; library {result['library_ms']:.3f} "
            f"({result['library_tflops']:.0f}); ratio {result['weave_vs_library']:.3f}; "
            f"err h {result['weave_err_h']:.2e} y {result['weave_err_y']:.2e}")
    # the shipped default (gemm_configs.default_config) and a candidate (the same with split tails where the default
    # uses 128-row tiles), with routing weights applied in GEMM1's epilogue and the tile tables built in the timed
    # region, each timed twice around a second library timing: the spread between the two is the noise here
    scale = torch.rand(alloc_rows, device="cuda") * 0.9 + 0.1  # routing-weight-like, away from 0

    def candidate_config(gemm):
        cfg = gc.default_config(gemm, rows, num_local)
        return cfg.with_(split_tail=True) if cfg.block_m == 128 else cfg

    pairs = {"default": (gc.default_config(0, rows, num_local), gc.default_config(1, rows, num_local)),
             "candidate": (candidate_config(0), candidate_config(1))}

    def pipeline(cfg0, cfg1):
        w = w13_interleaved if cfg0.interleaved else w13

        def run():
            t0 = gg.build_tile_table(offsets, cfg0.block_m, alloc_rows, cfg0.split_tail)
            same = (cfg1.block_m, cfg1.split_tail) == (cfg0.block_m, cfg0.split_tail)
            t1 = t0 if same else gg.build_tile_table(offsets, cfg1.block_m, alloc_rows, cfg1.split_tail)
            gg.grouped_gemm0(a, w, h, t0, cfg0)
            gg.grouped_gemm1(h, w2, y, t1, cfg1, scale=scale)
        return run

    for key, (cfg0, cfg1) in pairs.items():
        run = pipeline(cfg0, cfg1)
        h.fill_(float("nan"))
        y.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        result[f"{key}_configs"] = dict(gemm0=repr(cfg0), gemm1=repr(cfg1))
        result[f"{key}_err_y"] = rel_err(y[:rows] / scale[:rows, None], y_ref)
        result[f"{key}_ms"] = graph_time_ms(run, reps)
    result["library_ms_2"] = graph_time_ms(library, reps)
    lib = min(result["library_ms"], result["library_ms_2"])
    for key, (cfg0, cfg1) in pairs.items():
        result[f"{key}_ms_2"] = graph_time_ms(pipeline(cfg0, cfg1), reps)
        result[f"{key}_vs_library"] = max(result[f"{key}_ms"], result[f"{key}_ms_2"]) / lib
        result[f"{key}_tflops"] = flops / min(result[f"{key}_ms"], result[f"{key}_ms_2"]) / 1e9
        log(f"  {key} (tables + weights in the epilogue) {result[f'{key}_ms']:.3f} / {result[f'{key}_ms_2']:.3f} ms, "
            f"library {result['library_ms']:.3f} / {result['library_ms_2']:.3f}; worst ratio "
            f"{result[f'{key}_vs_library']:.3f}; err y {result[f'{key}_err_y']:.2e}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--models", default=",".join(PAPER_MODELS))
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--commit", default="", help="commit to record (default: git rev-parse of the cwd)")
    parser.add_argument("--routing", default="uniform,skewed")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--gemm0", default="", help="comma-separated GEMM0 variant names (default: all)")
    parser.add_argument("--gemm1", default="", help="comma-separated GEMM1 variant names (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gemm_bench needs a CUDA GPU")
        return 1
    import triton
    v0 = {k: GEMM0_VARIANTS[k] for k in args.gemm0.split(",")} if args.gemm0 else GEMM0_VARIANTS
    v1 = {k: GEMM1_VARIANTS[k] for k in args.gemm1.split(",")} if args.gemm1 else GEMM1_VARIANTS
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "gemm_bench.log"), "w")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    commit = args.commit
    if not commit:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), device=torch.cuda.get_device_name(),
                sms=torch.cuda.get_device_properties(0).multi_processor_count, torch=torch.__version__,
                triton=triton.__version__, commit=commit, command=" ".join(sys.argv))
    log(json.dumps(meta))
    results = []
    started = time.time()
    for model in args.models.split(","):
        for tokens, routing in [(t, r) for t in map(int, args.tokens.split(",")) for r in args.routing.split(",")]:
            spec = MoESpec.from_name(model)
            log(f"{model} T={tokens} {routing} (elapsed {time.time() - started:.0f} s)")
            try:
                results.append(bench_shape(spec, tokens, routing, args.reps, v0, v1, log))
            except Exception:
                log(traceback.format_exc())
            torch.cuda.empty_cache()
            with open(os.path.join(args.out, "gemm_bench.json"), "w") as f:
                json.dump(dict(meta=meta, results=results), f, indent=1)
    log("\nmodel              T    routing  rows   library ms (TF) gemms-only | best ms (TF)  ratio | default ms (TF) "
        "worst ratio | candidate ms (TF) worst ratio | best gemm0 / gemm1")
    for r in results:
        if "weave_ms" not in r:
            log(f"{r['model']:18s} {r['tokens']:5d} {r['routing']:8s} no valid weave variant")
            continue
        log(f"{r['model']:18s} {r['tokens']:5d} {r['routing']:8s} {r['rows']:6d}  {r['library_ms']:6.3f} "
            f"({r['library_tflops']:3.0f})  {r['library_gemms_only_ms']:6.3f}  | {r['weave_ms']:6.3f} "
            f"({r['weave_tflops']:3.0f}) {r['weave_vs_library']:5.3f} | {r['default_ms']:6.3f} "
            f"({r['default_tflops']:3.0f})  {r['default_vs_library']:5.3f}  | {r['candidate_ms']:6.3f} "
            f"({r['candidate_tflops']:3.0f})  {r['candidate_vs_library']:5.3f}  | {r['weave_best']['gemm0']} / "
            f"{r['weave_best']['gemm1']}")
    for key in ("weave_vs_library", "default_vs_library", "candidate_vs_library"):
        ratios = [r[key] for r in results if key in r]
        if ratios:
            geo = torch.tensor(ratios).log().mean().exp().item()
            log(f"{key}: geomean {geo:.3f} over {len(ratios)} shapes; worst {max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
