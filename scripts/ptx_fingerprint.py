"""Fingerprints of the warp-specialised Gluon GEMMs' sm_90 code, compiled on the CPU: to show that a change to GPU
code which cannot run here (no GPU) leaves the kernels a GPU already ran instruction for instruction as they were.

A fingerprint is the MD5 of a kernel's PTX without what does not execute: `.loc` line records, comments, `.file`
entries, the debug sections and the `$L__tmp` labels that mark inlined calls for the debugger (a refactor that
moves code into a helper changes those and nothing else). Each config is compiled as a launch on Qwen3-30B-A3B's
shape specialises it (`sm90.compile_for_sm90`), both GEMMs.

    python scripts/ptx_fingerprint.py                      # this tree's fingerprints
    python scripts/ptx_fingerprint.py --against 167aeb5    # and those of a commit's tree, compared: exit 1 on a change
    python scripts/ptx_fingerprint.py --megakernel --against HEAD   # the megakernel's launch compiles too (~2 min)

`--megakernel` adds the megakernel's compiles as a resident layer launches them (launch.compile_ptx: STAGE -1, 0, 4,
and -1 / 4 GROUPED_SERIAL, with TMA and the interleaved w13, at DeepSeek-V3's tile shapes).

`--against REV` extracts REV's `src/` with `git archive` into a temporary folder and runs this script there in a child
process (PYTHONPATH = that src), so both sides compile with the same Triton. Both trees must have
`WsConfig.parse` / `WsDecodeConfig.parse` (since 2026-12-06).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

#: Configs fingerprinted by default: the layer's own (the rule's), the probe's usual candidates, K-blocked ones ("b")
DEFAULT_CONFIGS = ("64x256x64w4s4,128x256x64w8s4,128x256x64w8s4t,128x128x64w4s4c2,64x256x64w4s4b,t8w64k128s8,"
                   "t16w64k128s8,t64w64k128s6,t8w64k128s8b")


def fingerprint(ptx: str) -> str:
    """The MD5 of `ptx`'s executable text (module docstring)."""
    code = ptx.split(".section")[0]
    lines = (re.sub(r"\$L__tmp\d+", "L", line) for line in code.splitlines()
             if not line.strip().startswith((".loc", "//", ".file")) and not re.fullmatch(r"\$L__tmp\d+:", line.strip()))
    return hashlib.md5("\n".join(lines).encode()).hexdigest()


def fingerprints(names: list[str]) -> dict:
    """{"<gemm> <name>": fingerprint} of each config name (compact form: "64x256x64w4s4", decode "t16w64k128s8") for
    GEMM0 and GEMM1, compiled for sm_90 without a GPU."""
    import torch

    from weave_moe.backends.weave.kernels import sm90, ws_decode, ws_gemm
    from weave_moe.backends.weave.kernels.grouped_tiles import build_tile_table_torch
    from weave_moe.backends.weave.kernels.ws_ring import block_weights

    hidden, inter, experts = 2048, 768, 2
    bf16 = dict(dtype=torch.bfloat16)
    out = {}
    for name in names:
        decode = name.startswith("t")
        config = (ws_decode.WsDecodeConfig if decode else ws_gemm.WsConfig).parse(name)
        rows = 64 if decode else 512
        tiles = build_tile_table_torch(torch.tensor([0, rows // 2, rows], dtype=torch.int32), config.block_m, rows,
                                       config.split_tail)
        for gemm in (0, 1):
            if gemm == 0:
                a, w = torch.empty(rows, hidden, **bf16), torch.empty(experts, 2 * inter, hidden, **bf16)
                result, scale = torch.empty(rows, inter, **bf16), None
            else:
                a, w = torch.empty(rows, inter, **bf16), torch.empty(experts, hidden, inter, **bf16)
                result, scale = torch.empty(rows, hidden, **bf16), torch.empty(rows)
            if config.k_blocked:   # the weights as the config reads them
                w = block_weights(w, config.block_k)
            launch = ws_decode.ws_decode_launch if decode else ws_gemm.ws_launch
            kernel, _, args, kwargs = launch(gemm, a, w, result, tiles, config, scale=scale, num_sms=132)
            out[f"GEMM{gemm} {name}"] = fingerprint(sm90.compile_for_sm90(kernel, args, kwargs).asm["ptx"])
    return out


#: the megakernel's launch compiles `--megakernel` fingerprints (MegakernelConstants fields beyond MEGAKERNEL_BASE)
MEGAKERNEL_VARIANTS = {"-1": dict(STAGE=-1), "0": dict(STAGE=0), "4": dict(STAGE=4),
                       "-1 grouped serial": dict(STAGE=-1, GROUPED_SERIAL=True),
                       "4 grouped serial": dict(STAGE=4, GROUPED_SERIAL=True)}
MEGAKERNEL_BASE = dict(TOP_K=8, MAX_CHUNKS=8, BLOCK_M=128, BLOCK_N0=128, BLOCK_N1=256, STAGES0=4, BLOCK_K=64,
                       DISPATCH_ROWS=16, COMBINE_ROWS=16, REDUCE_ROWS=16, BLOCK_H=512, DOT_FP32=False, TIMELINE=False,
                       MAX_EVENTS=1, USE_TMA=True, RESIDENT=True, W13_INTERLEAVED=True)


def megakernel_fingerprints() -> dict:
    """{"megakernel <variant>": fingerprint} of `MEGAKERNEL_VARIANTS`, compiled for sm_90 without a GPU."""
    from weave_moe.backends.weave.launch import compile_ptx

    return {f"megakernel {name}": fingerprint(compile_ptx(dict(MEGAKERNEL_BASE, **extra)))
            for name, extra in MEGAKERNEL_VARIANTS.items()}


def fingerprints_of(rev: str, names: list[str], megakernel: bool = False) -> dict:
    """`fingerprints` of commit `rev`'s tree (its src/ from `git archive`), in a child process."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as folder:
        archive = subprocess.run(["git", "-C", root, "archive", rev, "src"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
        env = dict(os.environ, PYTHONPATH=os.path.join(folder, "src"))
        child = subprocess.run([sys.executable, os.path.abspath(__file__), "--configs", ",".join(names), "--json"]
                               + (["--megakernel"] if megakernel else []),
                               capture_output=True, text=True, env=env, cwd=folder)
        if child.returncode:
            raise RuntimeError(f"fingerprints of {rev} failed:\n{child.stderr[-2000:]}")
        return json.loads(child.stdout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated compact config names")
    parser.add_argument("--against", default=None, metavar="REV", help="compare with the fingerprints of REV's tree")
    parser.add_argument("--json", action="store_true", help="print the fingerprints as JSON only")
    parser.add_argument("--megakernel", action="store_true", help="the megakernel's launch compiles too")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    here = fingerprints(names)
    if args.megakernel:
        here.update(megakernel_fingerprints())
    if args.json:
        print(json.dumps(here))
        return 0
    there = fingerprints_of(args.against, names, args.megakernel) if args.against else {}
    changed = 0
    for key, value in here.items():
        verdict = ""
        if args.against:
            same = there.get(key) == value
            changed += not same
            verdict = "  same" if same else f"  CHANGED (was {there.get(key)})"
        print(f"{key:28s} {value}{verdict}")
    if args.against:
        print(f"{changed} of {len(here)} kernels changed against {args.against}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
