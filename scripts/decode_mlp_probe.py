"""The fused decode MLP (kernels/decode_mlp.py) against the grouped GEMM0 -> GEMM1 pair on the same rows, on a GPU.

For each (model, tokens): one rank's work of EP = N (`--emulate-ep`, as `weave-moe tune`: E / N local experts, T x k
rows of uniform routing; `weave-moe tune`'s `_Work`, so the same rows, weights, cold-L2 rotations and checked rows),
timed as CUDA-graph replays (median of --reps, 3 warm-ups), cold L2 unless --warm-l2:
- `grouped`: GEMM0 then GEMM1 reading its h, each with the config the layer picks (`gemm_configs.default_config`:
  this device's tuned table, else the analytical default);
- `fused <config>`: `decode_mlp` then `reduce_parts` (the parts summed into y; a combine could fold that sum), for
  each candidate config; and `fused-only`: `decode_mlp` alone for the best one (what the reduction costs).
Every variant is checked first on the checked rows against the reference (y within the reference's tolerance, no
unwritten row). Prints a table and writes JSON (--out).

    python scripts/decode_mlp_probe.py --models qwen3-30b-a3b,deepseek-v3 --tokens 1,2,4,8 --out probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys


def candidates(inter: int, block_i, block_n, block_k, warps, stages):
    from weave_moe.backends.weave.kernels.decode_mlp import DecodeMlpConfig

    for bi, bn, bk, w, s in itertools.product(block_i, block_n, block_k, warps, stages):
        if bi > max(16, inter):
            continue
        # shared memory: stages x (a [16, bk] + w13 [2 bi, bk]) + w2 [bn, bi], bf16; keep under ~200 KB
        if 2 * (s * (16 * bk + 2 * bi * bk) + bn * bi) > 200 * 1024:
            continue
        yield DecodeMlpConfig(block_i=bi, block_n=bn, block_k=bk, num_warps=w, num_stages=s)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,qwen3.5-35b-a3b,deepseek-v2-lite,deepseek-v3")
    parser.add_argument("--tokens", default="1,2,4,8")
    parser.add_argument("--emulate-ep", type=int, default=2)
    parser.add_argument("--block-i", default="32,64,128")
    parser.add_argument("--block-n", default="64,128,256")
    parser.add_argument("--block-k", default="64,128")
    parser.add_argument("--warps", default="4")
    parser.add_argument("--stages", default="3,4")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warm-l2", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch

    from weave_moe.backends.weave.kernels import decode_mlp as dm
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.bench.anchor import graph_replay_ms
    from weave_moe.commands.tune import _Work, tune_shapes
    from weave_moe.models import MoESpec
    from weave_moe.reference import DEFAULT_TOLERANCE, moe_error

    ints = lambda text: [int(v) for v in text.split(",") if v]
    specs = [MoESpec.from_name(name) for name in args.models.split(",") if name]
    shapes = tune_shapes(specs, ints(args.tokens), args.emulate_ep)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    results, failures = [], 0

    def write(rows):
        if args.out:
            from weave_moe.bench.metadata import git_commit

            with open(args.out, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), commit=git_commit(), command=" ".join(sys.argv),
                               warm_l2=args.warm_l2, results=rows), f, indent=1, default=str)

    for shape in shapes:
        work = _Work(shape, seed=0, l2_bytes=None if args.warm_l2 else props.L2_cache_size)
        work.gather = None   # a paired call's GEMM0 reads its rows in place (in expert order), as the fused one does
        rotations = len(work.rotated_offsets)
        H, I, E = shape["H"], shape["I"], shape["E_local"]
        y_fused = torch.empty(work.alloc, H, device="cuda", dtype=torch.bfloat16)

        def timed(launchers) -> float:
            launches = [launch for r in range(rotations) for launch in launchers(r)]
            return statistics.median(graph_replay_ms(lambda: [launch() for launch in launches], args.reps)) / rotations

        def checked(run, out) -> float:
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            if torch.isnan(out[:work.rows]).any():
                return float("inf")
            return moe_error(out[work.check_rows], work.y_ref)[0]

        configs = [gc.default_config(g, work.rows, E, H, I) for g in (0, 1)]
        grouped = lambda r: (work.launcher(0, configs[0], r), work.launcher(1, configs[1], r, after_gemm0=True))
        row = dict(shape, grouped_configs=[repr(c) for c in configs], rotations=rotations, fused={})
        row["grouped_error"] = checked(lambda: [launch() for launch in grouped(0)], work.y)
        row["grouped_ms"] = timed(grouped)
        parts_by_bi = {}
        for config in candidates(I, ints(args.block_i), ints(args.block_n), ints(args.block_k), ints(args.warps),
                                 ints(args.stages)):
            if config.block_i not in parts_by_bi:
                parts_by_bi[config.block_i] = torch.empty(dm.parts_shape(work.alloc, H, I, config.block_i),
                                                          device="cuda")
            parts = parts_by_bi[config.block_i]

            def fused(r, config=config, parts=parts, reduce=True):
                tiles = work.table(config.block_m, False, r)
                launches = [lambda: dm.decode_mlp(work.a, work.w13, work.w2, tiles, parts, config)]
                if reduce:
                    launches.append(lambda: dm.reduce_parts(parts, y_fused, work.rotated_offsets[r][-1:]))
                return launches

            try:
                error = checked(lambda: [launch() for launch in fused(0)], y_fused)
                ms = timed(fused) if error <= DEFAULT_TOLERANCE else float("nan")
                only = timed(lambda r: fused(r, reduce=False)) if error <= DEFAULT_TOLERANCE else float("nan")
            except Exception as exc:   # a config that does not compile or launch here (resources): skipped
                print(f"  {config}: skipped, {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                row["fused"][repr(config)] = dict(skipped=f"{type(exc).__name__}: {str(exc)[:200]}")
                continue
            failures += error > DEFAULT_TOLERANCE
            row["fused"][repr(config)] = dict(ms=ms, fused_only_ms=only, error=error)
            print(f"  {shape['model']} T={shape['tokens']} {config}: {ms:.4f} ms (alone {only:.4f}), "
                  f"error {error:.1e}", flush=True)
        timed_ok = [(v["ms"], k) for k, v in row["fused"].items() if "ms" in v and v["ms"] == v["ms"]]
        best = min(timed_ok) if timed_ok else None
        row["best_fused"] = best[1] if best else None
        row["best_fused_ms"] = best[0] if best else None
        failures += row["grouped_error"] > DEFAULT_TOLERANCE
        results.append(row)
        write(results)   # after every shape: a run cut at its time limit keeps what it measured
        print(f"{shape['model']} T={shape['tokens']} rows={work.rows}: grouped {row['grouped_ms'] * 1e3:.1f} us "
              f"({', '.join(row['grouped_configs'])}), best fused {best[0] * 1e3 if best else float('nan'):.1f} us "
              f"({best[1] if best else '-'})", flush=True)
    print(f"\n{'model':18s} {'T':>3s} {'rows':>5s} {'grouped us':>11s} {'fused us':>9s} {'ratio':>6s}  best fused")
    for row in results:
        ratio = row["best_fused_ms"] / row["grouped_ms"] if row["best_fused_ms"] else float("nan")
        print(f"{row['model']:18s} {row['tokens']:3d} {row['rows']:5d} {row['grouped_ms'] * 1e3:11.1f} "
              f"{(row['best_fused_ms'] or float('nan')) * 1e3:9.1f} {ratio:6.3f}  {row['best_fused']}")
    print(f"decode_mlp_probe: {failures} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
