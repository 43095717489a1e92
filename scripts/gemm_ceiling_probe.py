"""One-off probe (issue 14): where the grouped GEMMs lose against a dense GEMM of the same size on one H200.

    PYTHONPATH=src python3 scripts/gemm_ceiling_probe.py --out $OUT

For each shape (the per-rank work of EP=2 at 8192 tokens, uniform routing), GEMM0 (+ SiLU-mul) and GEMM1 of the
grouped kernels are timed on three groupings of the same rows: the layer's (E_local experts), 8 experts of equal rows
and 1 expert (a dense GEMM with one weight: no expert boundaries, weights read once), beside cuBLAS (torch.mm on the
dense grouping, torch._grouped_mm on the others) and a few schedule variants (epilogue, flatten, group_m). If our
kernel reaches the dense ceiling on 1 expert but not on the layer's grouping, the loss is in the grouping (weight
traffic, tile order, expert tails); if it does not reach it on 1 expert either, the loss is in the main loop.
Every timed output is checked once against torch on its first expert (relative error <= 1e-2). Median of CUDA-graph
replays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import traceback

import torch
import torch.nn.functional as F

from weave_moe.backends.weave.kernels import grouped_gemm as gg
from weave_moe.bench.anchor import graph_replay_ms
from weave_moe.models import MoESpec

SHAPES = {"deepseek-v3": 8192, "deepseek-v2": 8192, "phi-3.5-moe": 8192, "qwen3-30b-a3b": 8192}
DEFAULT_MODELS = "deepseek-v3,deepseek-v2"


def ms_of(fn, reps):
    return statistics.median(graph_replay_ms(fn, reps))


def variants(gemm: int, base: gg.GemmConfig, few: bool = False) -> dict:
    out = {"default": base}
    for epilogue in (0, 1, 2, 3):
        if epilogue != base.epilogue and not (epilogue == 1 and base.split_tail):
            stages = min(base.num_stages, 3) if epilogue == 1 and base.block_m * base.block_n >= 128 * 256 else \
                base.num_stages
            out[f"epilogue={epilogue} s{stages}"] = base.with_(epilogue=epilogue, num_stages=stages)
    out["flatten=0"] = base.with_(flatten=False)
    if few:
        return out
    for group in (4, 16):
        if group != base.group_m:
            out[f"group_m={group}"] = base.with_(group_m=group)
    for stages in (3, 4):
        out[f"128x256 s{stages} w8 e{base.epilogue}"] = base.with_(block_m=128, block_n=256, num_warps=8,
                                                                    num_stages=stages, split_tail=False)
    unique = {}
    for name, cfg in out.items():   # each config once, under its first name
        if cfg not in unique.values():
            unique[name] = cfg
    return unique


def run_shape(model: str, tokens: int, reps: int, log, few: bool = False) -> list[dict]:
    spec = MoESpec.from_name(model)
    num_local, H, I = spec.num_experts // 2, spec.hidden_size, spec.intermediate_size
    from weave_moe import routing as routing_lib
    ids, _ = routing_lib.uniform(2 * tokens, spec.num_experts, spec.top_k, seed=tokens)
    ids = ids.long()
    rows = int((ids < num_local).sum())
    records = []
    weights13 = (torch.randn(num_local, 2 * I, H, device="cuda") / H ** 0.5).bfloat16()
    weights2 = (torch.randn(num_local, H, I, device="cuda") / I ** 0.5).bfloat16()
    w13_il = gg.interleave_w13(weights13)
    alloc = (rows + 255) // 256 * 256
    a = torch.randn(alloc, H, device="cuda").bfloat16()
    h_in = (torch.randn(alloc, I, device="cuda") * 0.5).bfloat16()
    h = torch.empty(alloc, I, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(alloc, H, device="cuda", dtype=torch.bfloat16)
    layer_counts = torch.bincount(ids[ids < num_local].flatten(), minlength=num_local)
    groupings = {f"layer E={num_local}": layer_counts.tolist(),
                 "E=8 equal": [rows // 8] * 7 + [rows - 7 * (rows // 8)],
                 "E=1 dense": [rows]}
    for grouping, counts in groupings.items():
        experts = len(counts)
        offsets = torch.zeros(experts + 1, dtype=torch.int32, device="cuda")
        offsets[1:] = torch.cumsum(torch.tensor(counts, device="cuda"), 0)
        w13, w13_i, w2 = weights13[:experts], w13_il[:experts], weights2[:experts]
        ends = offsets[1:].contiguous()
        e0 = int(counts[0])
        ref_gu = a[:e0].float() @ w13[0].float().T
        ref_h = F.silu(ref_gu[:, :I]) * ref_gu[:, I:]
        ref_y = h_in[:e0].float() @ w2[0].float().T

        def err(out, ref):
            out = out[:e0].float()
            return float("nan") if torch.isnan(out).any() else ((out - ref).norm() / ref.norm()).item()

        flops0, flops1 = 4.0 * rows * H * I, 2.0 * rows * H * I
        base = {"model": model, "tokens": tokens, "grouping": grouping, "experts": experts, "rows": rows}
        # cuBLAS
        if experts == 1:
            lib0 = ms_of(lambda: a[:rows] @ w13[0].T, reps)
            lib1 = ms_of(lambda: h_in[:rows] @ w2[0].T, reps)
            lib_name = "torch.mm"
        else:
            lib0 = ms_of(lambda: torch._grouped_mm(a[:rows], w13.transpose(1, 2), offs=ends), reps)
            lib1 = ms_of(lambda: torch._grouped_mm(h_in[:rows], w2.transpose(1, 2), offs=ends), reps)
            lib_name = "torch._grouped_mm"
        for gemm, ms, flops in ((0, lib0, flops0), (1, lib1, flops1)):
            records.append(dict(base, gemm=gemm, variant=lib_name, ms=ms, tflops=flops / ms / 1e9))
            log(f"{model} {grouping:14s} gemm{gemm} {lib_name:28s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s")
        for gemm in (0, 1):
            cfg0 = gg.default_config(gemm, rows, num_local, H, I)
            for name, cfg in variants(gemm, cfg0, few).items():
                try:
                    tiles = gg.build_tile_table(offsets, cfg.block_m, alloc, cfg.split_tail)
                    if gemm == 0:
                        w = w13_i if cfg.interleaved else w13
                        fn = (lambda w=w, tiles=tiles, cfg=cfg: gg.grouped_gemm0(a, w, h, tiles, cfg, pdl=False))
                        out, ref, flops = h, ref_h, flops0
                    else:
                        fn = (lambda tiles=tiles, cfg=cfg: gg.grouped_gemm1(h_in, w2, y, tiles, cfg, pdl=False))
                        out, ref, flops = y, ref_y, flops1
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    e = err(out, ref)
                    ms = ms_of(fn, reps)
                    records.append(dict(base, gemm=gemm, variant=name, config=repr(cfg), ms=ms,
                                        tflops=flops / ms / 1e9, err=e, ok=bool(e <= 1e-2)))
                    log(f"{model} {grouping:14s} gemm{gemm} {name:28s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s"
                        f" err {e:.1e}")
                except Exception as exc:  # a variant that does not compile or fit must not stop the probe
                    records.append(dict(base, gemm=gemm, variant=name, error=repr(exc)[:400]))
                    log(f"{model} {grouping} gemm{gemm} {name}: FAILED {repr(exc)[:200]}")
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--few", action="store_true", help="the epilogue and flatten variants only")
    parser.add_argument("--commit", default=os.environ.get("WEAVE_MOE_GIT_COMMIT", ""))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "gemm_ceiling_probe.log"), "w")

    def log(line):
        print(line, flush=True)
        log_file.write(line + "\n")

    records = []
    for model in args.models.split(","):
        try:
            records += run_shape(model, SHAPES[model], args.reps, log, args.few)
        except Exception:
            log(traceback.format_exc())
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=args.commit,
                command="scripts/gemm_ceiling_probe.py")
    with open(os.path.join(args.out, "gemm_ceiling_probe.json"), "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
