"""The warp-specialised Gluon grouped GEMMs (kernels/ws_gemm.py) against the Triton grouped GEMMs and the library's
on the same rows, on a Hopper GPU: correct first, then how fast.

For each (model, tokens): one rank's work of EP = N (`--emulate-ep`, as `weave-moe tune`: E / N local experts,
T x k rows of uniform routing; `weave-moe tune`'s `_Work`, so the same rows, weights, cold-L2 rotations and checked
rows; GEMM0's rows in expert order, as a paired call and the gather launch leave them), each GEMM alone:
- `triton`: kernels/grouped_gemm.py with the config the layer picks (this device's tuned table, else the analytical
  default);
- `library`: `torch._grouped_mm` on the same groups (GEMM0 followed by the SiLU-mul in torch, as the nccl backend);
- `ws <config>`: kernels/ws_gemm.py for each candidate config.
Every variant is checked first (outputs poisoned with NaN: an unwritten row fails; the checked rows against the fp32
reference within the reference's tolerance); only a checked variant is timed (CUDA-graph replays, median of --reps,
cold L2 unless --warm-l2). Prints TFLOP/s and writes JSON after every shape (--out).

    python scripts/ws_gemm_probe.py --models deepseek-v3,qwen3-30b-a3b --tokens 2048,8192 --out ws.json

`--decode`: the decode GEMMs of kernels/ws_decode.py instead (the weights as the MMA's rows), at decode sizes
(default 1, 8, 32, 128 tokens), candidates written "t16w64k128s8" (token rows, weight rows, K step, stages).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

#: Candidate configs (`--configs`): block_m x block_n x block_k, consumer warps, stages, "c2": ping-pong consumers
DEFAULT_CONFIGS = ("128x256x64w8s4,128x256x64w8s3,128x128x64w4s4c2,128x128x64w4s5c2,64x256x64w4s4c2,"
                   "128x128x64w8s4,64x256x64w4s4")


def parse_config(text: str):
    """"128x256x64w8s4" (then optionally "c2" two consumers, "p40" producer registers, "r168" maxnreg) ->
    WsConfig."""
    import re

    from weave_moe.backends.weave.kernels.ws_gemm import WsConfig

    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(?:c(\d+))?(?:p(\d+))?(?:r(\d+))?", text.strip())
    if not match:
        raise ValueError(f"config {text!r}: expected e.g. 128x256x64w8s4[c2][p40][r168]")
    bm, bn, bk, warps, stages, consumers, producer, maxnreg = match.groups()
    fields = dict(block_m=int(bm), block_n=int(bn), block_k=int(bk), num_warps=int(warps), stages=int(stages))
    for name, value in (("consumers", consumers), ("producer_regs", producer), ("maxnreg", maxnreg)):
        if value:
            fields[name] = int(value)
    return WsConfig(**fields)


#: Candidate decode configs (`--decode --configs`): token rows, weight rows, K step, stages
DEFAULT_DECODE_CONFIGS = "t16w64k128s8,t16w64k64s10,t8w64k128s8,t16w128k128s4,t32w64k128s8"


def parse_decode_config(text: str):
    """"t16w64k128s8" (then optionally "p40" producer registers) -> WsDecodeConfig."""
    import re

    from weave_moe.backends.weave.kernels.ws_decode import WsDecodeConfig

    match = re.fullmatch(r"t(\d+)w(\d+)k(\d+)s(\d+)(?:p(\d+))?", text.strip())
    if not match:
        raise ValueError(f"decode config {text!r}: expected e.g. t16w64k128s8[p40]")
    bt, bw, bk, stages, producer = match.groups()
    fields = dict(block_t=int(bt), block_w=int(bw), block_k=int(bk), stages=int(stages))
    if producer:
        fields["producer_regs"] = int(producer)
    return WsDecodeConfig(**fields)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="deepseek-v3,deepseek-v2,phi-3.5-moe,qwen3-30b-a3b,qwen3.5-35b-a3b,"
                                            "deepseek-v2-lite")
    parser.add_argument("--tokens", default=None, help="default 2048,8192; with --decode 1,8,32,128")
    parser.add_argument("--emulate-ep", type=int, default=2)
    parser.add_argument("--decode", action="store_true", help="the decode GEMMs (kernels/ws_decode.py)")
    parser.add_argument("--configs", default=None, help="candidates (default: DEFAULT_CONFIGS or "
                                                         "DEFAULT_DECODE_CONFIGS)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warm-l2", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels import ws_decode, ws_gemm
    from weave_moe.bench.anchor import graph_replay_ms
    from weave_moe.commands.tune import _Work, tune_shapes
    from weave_moe.models import MoESpec
    from weave_moe.reference import DEFAULT_TOLERANCE

    parse = parse_decode_config if args.decode else parse_config
    configs = [parse(c) for c in (args.configs or (DEFAULT_DECODE_CONFIGS if args.decode else DEFAULT_CONFIGS))
               .split(",") if c.strip()]
    kernels = ((ws_decode.ws_decode_gemm0, ws_decode.ws_decode_gemm1) if args.decode
               else (ws_gemm.ws_gemm0, ws_gemm.ws_gemm1))
    tokens = args.tokens or ("1,8,32,128" if args.decode else "2048,8192")
    specs = [MoESpec.from_name(name) for name in args.models.split(",") if name]
    shapes = tune_shapes(specs, [int(t) for t in tokens.split(",") if t], args.emulate_ep)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    results, failures = [], 0

    def write():
        if args.out:
            from weave_moe.bench.metadata import git_commit

            with open(args.out, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), commit=git_commit(), command=" ".join(sys.argv),
                               warm_l2=args.warm_l2, decode=args.decode, configs=[str(c) for c in configs],
                               results=results), f, indent=1, default=str)

    for shape in shapes:
        work = _Work(shape, seed=0, l2_bytes=None if args.warm_l2 else props.L2_cache_size)
        work.gather = None   # rows in expert order for every variant (ws_gemm reads them through TMA)
        E, H, I = shape["E_local"], shape["H"], shape["I"]
        flops = {0: 2.0 * work.rows * H * 2 * I, 1: 2.0 * work.rows * I * H}
        w13_t = work.w13.transpose(1, 2)   # [E, H, 2I] view, interleaved columns
        w2_t = work.w2.transpose(1, 2)     # [E, I, H]
        row = dict(shape, variants={})

        def record(gemm: int, name: str, launchers) -> None:
            """Check rotation 0's launch, then time every rotation's in one graph; launchers(r) -> callable."""
            nonlocal failures
            rotations = work.rotations[gemm]
            entry = row["variants"].setdefault(name, {})
            try:
                error = work.error(gemm, launchers(0))
                ms = float("nan")
                if error <= DEFAULT_TOLERANCE:
                    launches = [launchers(r) for r in range(rotations)]
                    ms = statistics.median(graph_replay_ms(lambda: [launch() for launch in launches],
                                                           args.reps)) / rotations
            except Exception as exc:   # a config that does not compile or launch here: skipped, named
                entry[f"gemm{gemm}"] = dict(skipped=f"{type(exc).__name__}: {str(exc)[:300]}")
                print(f"  {shape['model']} T={shape['tokens']} GEMM{gemm} {name}: skipped, {type(exc).__name__}: "
                      f"{str(exc)[:200]}", flush=True)
                return
            failures += error > DEFAULT_TOLERANCE
            entry[f"gemm{gemm}"] = dict(ms=ms, error=error, tflops=flops[gemm] / ms / 1e9 if ms == ms else None)
            print(f"  {shape['model']} T={shape['tokens']} GEMM{gemm} {name}: {ms * 1e3:.1f} us, "
                  f"{flops[gemm] / ms / 1e9 if ms == ms else float('nan'):.0f} TFLOP/s, error {error:.1e}",
                  flush=True)

        for gemm in (0, 1):
            config = gc.default_config(gemm, work.rows, E, H, I)
            record(gemm, f"triton {config!r}", lambda r, gemm=gemm, config=config: work.launcher(gemm, config, r))

        def library0(r):
            offs = work.rotated_offsets[r][1:]

            def run():
                gate_up = torch._grouped_mm(work.a[:work.rows], w13_t, offs=offs).view(work.rows, I, 2)
                work.h[:work.rows] = (F.silu(gate_up[..., 0].float()) * gate_up[..., 1].float()).bfloat16()
            return run

        def library1(r):
            offs = work.rotated_offsets[r][1:]

            def run():
                work.y[:work.rows] = torch._grouped_mm(work.h_in[:work.rows], w2_t, offs=offs)
            return run

        record(0, "library", library0)
        record(1, "library", library1)
        for config in configs:
            def ws0(r, config=config):
                tiles = work.table(config.block_m, False, r)
                return lambda: kernels[0](work.a, work.w13, work.h, tiles, config)

            def ws1(r, config=config):
                tiles = work.table(config.block_m, False, r)
                return lambda: kernels[1](work.h_in, work.w2, work.y, tiles, config)

            record(0, str(config), ws0)
            record(1, str(config), ws1)
        results.append(row)
        write()
    print(f"\n{'model':18s} {'T':>5s} {'gemm':>4s}  {'triton us':>9s} {'library us':>10s} {'best ws us':>10s}  best ws")
    for row in results:
        for gemm in (0, 1):
            times = {name: v.get(f"gemm{gemm}", {}).get("ms") for name, v in row["variants"].items()}
            triton = next((t for name, t in times.items() if name.startswith("triton")), None)
            ws = [(t, name) for name, t in times.items()
                  if name.split()[0] in ("ws", "wsd") and t is not None and t == t]
            best = min(ws) if ws else (float("nan"), "-")
            print(f"{row['model']:18s} {row['tokens']:5d} {gemm:4d}  {(triton or float('nan')) * 1e3:9.1f} "
                  f"{(times.get('library') or float('nan')) * 1e3:10.1f} {best[0] * 1e3:10.1f}  {best[1]}")
    print(f"ws_gemm_probe: {failures} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
