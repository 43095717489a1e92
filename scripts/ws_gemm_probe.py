"""The warp-specialised Gluon grouped GEMMs (kernels/ws_gemm.py) against the Triton grouped GEMMs and the library's
on the same rows, on a Hopper GPU: correct first, then how fast.

For each (model, tokens): one rank's work of EP = N (`--emulate-ep`, as `weave-moe tune`: E / N local experts,
T x k rows of uniform routing; `weave-moe tune`'s `_Work`, so the same rows, weights, cold-L2 rotations and checked
rows; GEMM0's rows in expert order, as a paired call and the gather launch leave them), each GEMM alone:
- `triton`: kernels/grouped_gemm.py with the config the layer picks (this device's tuned table, else the analytical
  default);
- `library`: `torch._grouped_mm` on the same groups, each GEMM timed alone (checked with GEMM0's SiLU-mul in torch,
  as the nccl backend runs it, and GEMM1's output copied into y; timed without either: until 2026-12-06 the column
  timed an fp32 SiLU-mul over GEMM0's interleaved output and a copy of GEMM1's too, DeepSeek-V2 at 2048 tokens 1312 +
  620 us where the bench's library anchor, both GEMMs and a bf16 SiLU-mul, took 1631 us, bench/results/h100-9401955).
  The Gluon and Triton GEMM0 fuse the SiLU-mul: this column leaves out work that they do;
- `ws <config>`: kernels/ws_gemm.py for each candidate config.
First every candidate runs a small check in child processes (`smoke`: 4 experts of 0 / 1 / 37 / 200 rows, both
GEMMs against the fp32 reference; a config that hangs or faults the GPU costs --smoke-timeout once and is named,
not timed). Every variant is then checked on each shape (outputs poisoned with NaN: an unwritten row fails; the
checked rows against the fp32 reference within the reference's tolerance); only a checked variant is timed (CUDA-
graph replays, median of --reps, cold L2 unless --warm-l2), a shape's variants of each GEMM in --rounds interleaved
rounds (the order rotated, every other round reversed), the median over rounds. Prints TFLOP/s and the TB/s of the least bytes each GEMM
must move (its active experts' weights, its rows in and out: against the GPU's HBM bandwidth where the weights
stream), and writes JSON after every shape (--out). A config named with "b" (e.g. 64x256x64w4s4b) reads the weights
in the K-blocked layout (`ws_ring.block_weights`, made once per shape and K step).

`--gather`: GEMM0 also with its rows scattered over a source buffer in a random order (as a call's receive buffer
holds them), read through the gather rows: `triton gathered` (the Triton GEMM0's pointer loads, KernelConfig.
gemm0_gather), `<ws config> gathered` for each candidate that `gathers` (its producer warpgroup's cp.async,
KernelConfig.ws_gather), and `gather launch` (`grouped_tiles.gather_rows`: the copy into expert order that a GEMM0
reading rows in expert order needs first in a call), so that "gather launch + ws" and "ws gathered" compare.

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
DEFAULT_CONFIGS = ("128x256x64w8s4,128x256x64w8s4t,128x256x64w8s3,128x128x64w4s4c2,128x128x64w4s5c2,"
                   "64x256x64w4s4c2,128x128x64w8s4,64x256x64w4s4")


def parse_config(text: str):
    """A `--configs` name -> WsConfig (`WsConfig.parse`: "128x256x64w8s4[c2][g4][p40][r168][b][t]")."""
    from weave_moe.backends.weave.kernels.ws_gemm import WsConfig

    return WsConfig.parse(text)


#: Candidate decode configs (`--decode --configs`): token rows, weight rows, K step, stages
DEFAULT_DECODE_CONFIGS = "t16w64k128s8,t16w64k64s10,t8w64k128s8,t16w128k128s4,t32w64k128s8"


def parse_decode_config(text: str):
    """A `--decode --configs` name -> WsDecodeConfig (`WsDecodeConfig.parse`: "t16w64k128s8[p40]")."""
    from weave_moe.backends.weave.kernels.ws_decode import WsDecodeConfig

    return WsDecodeConfig.parse(text)


def smoke(config, decode: bool) -> str:
    """One config on a small problem (6 experts of 0 / 1 / 37 / 200 / 70 / 129 rows: 192-row tiles with one, two and
    three row parts that have rows; or 4 of 0 / 1 / 5 / 9 with `decode`; H 1024,
    I 512; rows past the last expert), both GEMMs against the fp32 reference per expert (GEMM0 also through gather
    rows where the config `gathers`), outputs poisoned with NaN:
    "PASS <errors>", or "FAIL <why>" (a row of an expert unwritten or wrong, a row past them written)."""
    import torch
    import torch.nn.functional as F

    from weave_moe.backends.weave.kernels import grouped_gemm as gg
    from weave_moe.backends.weave.kernels import ws_decode, ws_gemm
    from weave_moe.backends.weave.kernels.ws_ring import block_weights
    from weave_moe.reference import DEFAULT_TOLERANCE, moe_error

    gemm0, gemm1 = ((ws_decode.ws_decode_gemm0, ws_decode.ws_decode_gemm1) if decode
                    else (ws_gemm.ws_gemm0, ws_gemm.ws_gemm1))
    counts = [0, 1, 5, 9] if decode else [0, 1, 37, 200, 70, 129]
    E, H, I, rows = len(counts), 1024, 512, sum(counts)
    alloc = rows + 64
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(alloc, H, device="cuda", generator=gen).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) / I ** 0.5).bfloat16()
    h_ref = torch.zeros(rows, I, device="cuda")
    for e in range(E):
        s, f = offsets[e].item(), offsets[e + 1].item()
        gate_up = a[s:f].float() @ w13[e].float().T
        h_ref[s:f] = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    h_in = torch.full((alloc, I), float("nan"), device="cuda").bfloat16()
    h_in[:rows] = h_ref.bfloat16()
    y_ref = torch.zeros(rows, H, device="cuda")
    for e in range(E):
        s, f = offsets[e].item(), offsets[e + 1].item()
        y_ref[s:f] = h_in[s:f].float() @ w2[e].float().T
    tiles = gg.build_tile_table(offsets, config.block_m, alloc, config.split_tail)
    h = torch.full((alloc, I), float("nan"), device="cuda").bfloat16()
    y = torch.full((alloc, H), float("nan"), device="cuda").bfloat16()
    w13, w2 = gg.interleave_w13(w13), w2
    if config.k_blocked:   # the weights as the config reads them (ws_ring.block_weights)
        w13, w2 = block_weights(w13, config.block_k), block_weights(w2, config.block_k)
    gemm0(a, w13, h, tiles, config)
    gemm1(h_in, w2, y, tiles, config)
    checks = [("h", h, h_ref), ("y", y, y_ref)]
    if not decode and config.gathers:   # GEMM0 through gather rows too: the rows scattered over a source buffer
        gather = torch.randperm(alloc, device="cuda", generator=gen).int()
        source = torch.empty_like(a)
        source[gather.long()] = a
        h_gathered = torch.full((alloc, I), float("nan"), device="cuda").bfloat16()
        gemm0(source, w13, h_gathered, tiles, config, gather=gather)
        checks.append(("h gathered", h_gathered, h_ref))
    torch.cuda.synchronize()
    errors = []
    for name, out, ref in checks:
        if torch.isnan(out[:rows]).any():
            return f"FAIL {name}: {int(torch.isnan(out[:rows]).any(1).sum())} of {rows} rows unwritten"
        if not torch.isnan(out[rows:]).all():
            return f"FAIL {name}: rows past the last expert written"
        error = moe_error(out[:rows], ref)[0]
        if error > DEFAULT_TOLERANCE:
            return f"FAIL {name}: error {error:.2e} over {DEFAULT_TOLERANCE:.0e}"
        errors.append(f"{name} {error:.1e}")
    return "PASS " + ", ".join(errors)


def time_in_rounds(items: list, rounds: int, time_once) -> list[float]:
    """Each item's median time over `rounds` interleaved rounds: round r times every item once, in the bench's order
    for round r (`harness.round_orders`: rotated by one per round, every other round reversed), so that a drift of
    the GPU over the minutes a shape takes reaches every item alike. `time_once(item, first)` -> ms; `first` is True
    for the first timing of round 0 only, which a caller may run twice (the first-timed artifact, `time_checked`)."""
    from weave_moe.bench.harness import round_orders

    times: list[list[float]] = [[] for _ in items]
    for r, order in enumerate(round_orders(len(items), rounds)):
        for position, index in enumerate(order):
            times[index].append(time_once(items[index], r == 0 and position == 0))
    return [statistics.median(values) for values in times]


def smoke_all(texts: list[str], decode: bool, timeout_s: float) -> dict:
    """`smoke` for every config, in child processes so that a config that hangs or faults the GPU costs at most
    `timeout_s` and names itself: {text: "PASS ..." / "FAIL ..." / "HANG"}. A child runs the configs in order,
    printing a line before and after each, and stops after a CUDA error (the context is lost); the configs it did not
    reach run in a new child."""
    import subprocess

    results, left = {}, list(texts)
    while left:
        command = [sys.executable, __file__, "--smoke-only", "--configs", ",".join(left)] + (["--decode"] if decode
                                                                                             else [])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
            output, errors = done.stdout, done.stderr
        except subprocess.TimeoutExpired as expired:
            output, errors = (value.decode() if isinstance(value, bytes) else (value or "")
                              for value in (expired.stdout, expired.stderr))
        before, started = len(results), None
        for line in output.splitlines():
            if line.startswith("SMOKE START "):
                started = line[len("SMOKE START "):]
            elif line.startswith("SMOKE END "):
                text, _, verdict = line[len("SMOKE END "):].partition(" :: ")
                results[text], started = verdict, None
        if started is not None:   # begun and never ended: the GPU hung on it, or the child died there
            results[started] = "HANG (or the child died): " + errors[-300:].replace("\n", " ")
        left = [text for text in left if text not in results]
        if left and len(results) == before:   # the child reached none of them: say why, once
            for text in left:
                results[text] = "FAIL the check did not start: " + errors[-300:].replace("\n", " ")
            left = []
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="deepseek-v3,deepseek-v2,phi-3.5-moe,qwen3-30b-a3b,qwen3.5-35b-a3b,"
                                            "deepseek-v2-lite")
    parser.add_argument("--tokens", default=None, help="default 2048,8192; with --decode 1,8,32,128")
    parser.add_argument("--emulate-ep", type=int, default=2)
    parser.add_argument("--decode", action="store_true", help="the decode GEMMs (kernels/ws_decode.py)")
    parser.add_argument("--configs", default=None, help="candidates (default: DEFAULT_CONFIGS or "
                                                         "DEFAULT_DECODE_CONFIGS)")
    parser.add_argument("--reps", type=int, default=5, help="replays per round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="a shape's variants of each GEMM timed in this many interleaved rounds (rotated order), "
                             "each --reps replays; the median over rounds")
    parser.add_argument("--smoke-timeout", type=float, default=90.0,
                        help="seconds for the small check of the configs, first (a hang costs this once)")
    parser.add_argument("--smoke-only", action="store_true", help=argparse.SUPPRESS)   # smoke_all's child
    parser.add_argument("--warm-l2", action="store_true")
    parser.add_argument("--gather", action="store_true", help="GEMM0 through gather rows too (module docstring)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        parser.error(f"--rounds and --reps must be >= 1, given {args.rounds} and {args.reps}")

    import torch
    import torch.nn.functional as F

    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels import ws_decode, ws_gemm
    from weave_moe.backends.weave.kernels.ws_ring import block_weights
    from weave_moe.bench.anchor import graph_replay_ms
    from weave_moe.commands.tune import _Work, tune_shapes
    from weave_moe.models import MoESpec
    from weave_moe.reference import DEFAULT_TOLERANCE

    parse = parse_decode_config if args.decode else parse_config
    texts = [c.strip() for c in (args.configs or (DEFAULT_DECODE_CONFIGS if args.decode else DEFAULT_CONFIGS))
             .split(",") if c.strip()]
    if args.smoke_only:   # smoke_all's child: one line before and after each config
        for text in texts:
            print(f"SMOKE START {text}", flush=True)
            try:
                verdict = smoke(parse(text), args.decode)
            except Exception as exc:   # a config that does not compile or launch here
                verdict = f"FAIL {type(exc).__name__}: {str(exc)[:300]}".replace("\n", " ")
            print(f"SMOKE END {text} :: {verdict}", flush=True)
            if "CUDA error" in verdict:   # the context is lost: the rest run in a new child
                return 3
        return 0
    smoked = smoke_all(texts, args.decode, args.smoke_timeout)
    for text, verdict in smoked.items():
        print(f"smoke {text}: {verdict}", flush=True)
    failures = sum(not verdict.startswith("PASS") for verdict in smoked.values())
    configs = [parse(text) for text in texts if smoked[text].startswith("PASS")]   # the rest are not timed
    kernels = ((ws_decode.ws_decode_gemm0, ws_decode.ws_decode_gemm1) if args.decode
               else (ws_gemm.ws_gemm0, ws_gemm.ws_gemm1))
    tokens = args.tokens or ("1,8,32,128" if args.decode else "2048,8192")
    specs = [MoESpec.from_name(name) for name in args.models.split(",") if name]
    shapes = tune_shapes(specs, [int(t) for t in tokens.split(",") if t], args.emulate_ep)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    results = []

    def write():
        if args.out:
            from weave_moe.bench.metadata import git_commit

            with open(args.out, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), commit=git_commit(), command=" ".join(sys.argv),
                               warm_l2=args.warm_l2, decode=args.decode, smoke=smoked,
                               configs=[str(c) for c in configs], results=results), f, indent=1, default=str)

    write()   # the small checks' verdicts, before any shape

    for shape in shapes:
        work = _Work(shape, seed=0, l2_bytes=None if args.warm_l2 else props.L2_cache_size)
        work.gather = None   # rows in expert order for every variant (ws_gemm reads them through TMA)
        E, H, I = shape["E_local"], shape["H"], shape["I"]
        flops = {0: 2.0 * work.rows * H * 2 * I, 1: 2.0 * work.rows * I * H}
        # the bytes each GEMM must move at least: its active experts' weights, its rows in, its rows out (bf16)
        active = int((work.offsets[1:] > work.offsets[:-1]).sum())
        min_bytes = {0: 2.0 * (active * 2 * I * H + work.rows * H + work.rows * I),
                     1: 2.0 * (active * H * I + work.rows * I + work.rows * H)}
        w13_t = work.w13.transpose(1, 2)   # [E, H, 2I] view, interleaved columns
        w2_t = work.w2.transpose(1, 2)     # [E, I, H]
        row = dict(shape, variants={})

        checked = {0: [], 1: []}   # per GEMM: (name, error, launches) of the variants checked, timed after all

        def record(gemm: int, name: str, launchers, timed=None) -> None:
            """Check rotation 0's launch now; a variant within the tolerance is timed with the shape's others
            (`time_checked`), every rotation's launch in one graph. launchers(r) -> callable (`timed`, when given,
            the launchers timed instead: the library's GEMM without what only its check needs)."""
            nonlocal failures
            entry = row["variants"].setdefault(name, {})
            try:
                error = work.error(gemm, launchers(0))
                launches = [(timed or launchers)(r) for r in range(work.rotations[gemm])]
            except Exception as exc:   # a config that does not compile or launch here: skipped, named
                entry[f"gemm{gemm}"] = dict(skipped=f"{type(exc).__name__}: {str(exc)[:300]}")
                print(f"  {shape['model']} T={shape['tokens']} GEMM{gemm} {name}: skipped, {type(exc).__name__}: "
                      f"{str(exc)[:200]}", flush=True)
                return
            failures += error > DEFAULT_TOLERANCE
            entry[f"gemm{gemm}"] = dict(ms=float("nan"), error=error, tflops=None, min_tbps=None)
            if error <= DEFAULT_TOLERANCE:
                checked[gemm].append((name, error, launches))
            else:
                print(f"  {shape['model']} T={shape['tokens']} GEMM{gemm} {name}: error {error:.1e}, not timed",
                      flush=True)

        def time_checked() -> None:
            """Every checked variant of each GEMM timed in --rounds interleaved rounds (`time_in_rounds`). The first
            timed in round 0 runs twice and keeps the second: on an H100 the first variant timed on a shape
            measured up to 1.18x the same kernel's time in a run that timed it second (DeepSeek-V3's t8 decode GEMMs
            in bench/results/h100-5af6fb0/ws_decode_probe.log, DeepSeek-V2's t16 ones in
            bench/results/h100-1eee06e/ws_decode_probe-reversed.log)."""
            for gemm, items in checked.items():
                rotations = work.rotations[gemm]

                def time_once(item, first):
                    launches = item[2]
                    for _ in range(2 if first else 1):
                        ms = statistics.median(graph_replay_ms(lambda: [launch() for launch in launches],
                                                               args.reps)) / rotations
                    return ms
                for (name, error, _), ms in zip(items, time_in_rounds(items, args.rounds, time_once)):
                    row["variants"][name][f"gemm{gemm}"].update(ms=ms, tflops=flops[gemm] / ms / 1e9,
                                                                min_tbps=min_bytes[gemm] / ms / 1e9)
                    print(f"  {shape['model']} T={shape['tokens']} GEMM{gemm} {name}: {ms * 1e3:.1f} us, "
                          f"{flops[gemm] / ms / 1e9:.0f} TFLOP/s, {min_bytes[gemm] / ms / 1e9:.2f} TB/s of its "
                          f"least bytes, error {error:.1e}", flush=True)
                items.clear()

        for gemm in (0, 1):
            config = gc.default_config(gemm, work.rows, E, H, I)
            record(gemm, f"triton {config!r}", lambda r, gemm=gemm, config=config: work.launcher(gemm, config, r))

        def library0(r):   # checked with the SiLU-mul (h against the reference); timed as the GEMM alone
            offs = work.rotated_offsets[r][1:]

            def run(check: bool = True):
                gate_up = torch._grouped_mm(work.a[:work.rows], w13_t, offs=offs)
                if check:
                    gate_up = gate_up.view(work.rows, I, 2)
                    work.h[:work.rows] = (F.silu(gate_up[..., 0].float()) * gate_up[..., 1].float()).bfloat16()
            return run

        def library1(r):   # checked through y; timed as the GEMM alone (its output not copied)
            offs = work.rotated_offsets[r][1:]

            def run(check: bool = True):
                out = torch._grouped_mm(work.h_in[:work.rows], w2_t, offs=offs)
                if check:
                    work.y[:work.rows] = out
            return run

        record(0, "library", library0, timed=lambda r: lambda: library0(r)(check=False))
        record(1, "library", library1, timed=lambda r: lambda: library1(r)(check=False))
        if args.gather and not args.decode:   # GEMM0's rows scattered over a source buffer: source[gather[m]] = a[m]
            from weave_moe.backends.weave.kernels import grouped_gemm as gg
            from weave_moe.backends.weave.kernels import grouped_tiles

            gen = torch.Generator(device="cuda").manual_seed(7)
            gather = torch.randperm(work.alloc, device="cuda", generator=gen).int()
            source = torch.empty_like(work.a)
            source[gather.long()] = work.a
            config = gc.default_config(0, work.rows, E, H, I)
            record(0, f"triton gathered {config!r}", lambda r, config=config: (
                lambda tiles=work.table(config.block_m, config.split_tail, r): gg.launch_gemm(
                    0, config, source, work.w13, work.h, tiles, gather=gather, pdl=work.pdl,
                    stream_k_scratch=work.stream_k_scratch, status=work.status)))
            count = work.rotated_offsets[0][-1:]
            sms = props.multi_processor_count

            def gather_launch(r):
                def run():   # the copy alone; GEMM0 then computes its h from the copied rows (checked so)
                    grouped_tiles.gather_rows(source, gather, work.a, count, 4 * sms)
                    kernels[0](work.a, work.w13, work.h, work.table(64, False, r), ws_gemm.DEFAULT_CONFIG)
                return run
            record(0, "gather launch + ws default", gather_launch)
            for config in configs:
                if config.gathers and not config.k_blocked:
                    record(0, f"{config} gathered", lambda r, config=config: (
                        lambda tiles=work.table(config.block_m, config.split_tail, r): ws_gemm.ws_gemm0(
                            source, work.w13, work.h, tiles, config, gather=gather)))
        blocked = {}   # block_k -> (w13, w2) in the K-blocked layout, made once per shape for k_blocked configs

        def weights(config):
            if not config.k_blocked:
                return work.w13, work.w2
            if config.block_k not in blocked:
                blocked[config.block_k] = (block_weights(work.w13, config.block_k),
                                           block_weights(work.w2, config.block_k))
            return blocked[config.block_k]

        for config in configs:
            def ws0(r, config=config):
                tiles = work.table(config.block_m, config.split_tail, r)
                w13 = weights(config)[0]
                return lambda: kernels[0](work.a, w13, work.h, tiles, config)

            def ws1(r, config=config):
                tiles = work.table(config.block_m, config.split_tail, r)
                w2 = weights(config)[1]
                return lambda: kernels[1](work.h_in, w2, work.y, tiles, config)

            record(0, str(config), ws0)
            record(1, str(config), ws1)
        time_checked()
        results.append(row)
        write()
    print(f"\n{'model':18s} {'T':>5s} {'gemm':>4s}  {'triton us':>9s} {'library us':>10s} {'best ws us':>10s} "
          f"{'ws TB/s':>7s}  best ws")
    for row in results:
        for gemm in (0, 1):
            measured = {name: v.get(f"gemm{gemm}", {}) for name, v in row["variants"].items()}
            times = {name: m.get("ms") for name, m in measured.items()}
            triton = next((t for name, t in times.items() if name.startswith("triton") and t is not None), None)
            ws = [(t, name) for name, t in times.items()
                  if name.split()[0] in ("ws", "wsd") and t is not None and t == t]
            best = min(ws) if ws else (float("nan"), "-")
            tbps = measured.get(best[1], {}).get("min_tbps") or float("nan")
            print(f"{row['model']:18s} {row['tokens']:5d} {gemm:4d}  {(triton or float('nan')) * 1e3:9.1f} "
                  f"{(times.get('library') or float('nan')) * 1e3:10.1f} {best[0] * 1e3:10.1f} {tbps:7.2f}  "
                  f"{best[1]}")
    print(f"ws_gemm_probe: {failures} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
