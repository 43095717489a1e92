"""How fast a GPU streams expert weights in the grouped GEMMs' block order, in the layout the layer holds and in the
K-blocked layout (`ws_ring.block_weights`): the DRAM access pattern alone, without the MMAs (perf-notes entry 47).

A grouped GEMM that streams its weights (64-256 rows per expert, decode) reads, per work item (expert, N tile), K
steps of one [BLOCK_N, BLOCK_K] block each. In the layer's layout [E, N, K] such a block is BLOCK_N pieces of
BLOCK_K x 2 bytes, K x 2 bytes apart; in the K-blocked layout [E, K / BLOCK_K, N, BLOCK_K] it is one contiguous run.
This probe reads every block of the weights once, in that order (items dealt round-robin to one program per SM, K
steps in a pipelined loop of TMA loads), sums them (a checksum, so that nothing is skipped), and reports TB/s of
weight bytes, beside `torch.sum` over the same bytes read contiguously. Each variant is checked first: its checksum
against torch's (fp32 sums of the same bf16 weights).

    python scripts/stream_probe.py --models deepseek-v2,deepseek-v3 --out stream.json

Shapes: for each model, one rank's work of EP = 2 (E / 2 local experts; `--experts` reads only that many, e.g. 8
for a decode call's active experts), GEMM0's interleaved w13 [E, 2I, H] and GEMM1's w2 [E, H, I].
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from weave_moe.backends.weave.kernels.ws_ring import block_weights

#: Block shapes (`--blocks`, BLOCK_N x BLOCK_K): the prefill Gluon kernel's W block, BLOCK_K 128, the decode kernel's
DEFAULT_BLOCKS = "256x64,256x128,64x128"


@triton.jit
def _stream_kernel(w_desc, sums_ptr, num_items, num_n, k_steps, w_rows, BLOCKED: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                   STAGES: tl.constexpr):
    """Program p reads items p, p + NUM_PROGRAMS, ... (item = expert * num_n + N tile), each item's K steps in
    order, and stores the fp32 sum of everything it read at sums[p]."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for item in range(pid, num_items, NUM_PROGRAMS):
        expert = item // num_n
        row = (item % num_n) * BLOCK_N
        for kk in tl.range(0, k_steps, num_stages=STAGES):
            if BLOCKED:
                block = w_desc.load([(expert * k_steps + kk) * w_rows + row, 0])
            else:
                block = w_desc.load([expert * w_rows + row, kk * BLOCK_K])
            acc += block.to(tl.float32)
    tl.store(sums_ptr + pid, tl.sum(acc))


def stream(w: torch.Tensor, block_n: int, block_k: int, blocked: bool, num_programs: int, sums: torch.Tensor,
           stages: int = 4) -> None:
    """One pass over `w`: the plain [E, N, K] weights, or with `blocked` the same in the K-blocked layout
    [E, K / block_k, N, block_k]; N a multiple of block_n, K of block_k; `sums` fp32 [num_programs]."""
    if blocked:
        num_experts, k_steps, w_rows, _ = w.shape
        desc = TensorDescriptor.from_tensor(w.view(-1, block_k), [block_n, block_k])
    else:
        num_experts, w_rows, K = w.shape
        k_steps = K // block_k
        desc = TensorDescriptor.from_tensor(w.view(-1, K), [block_n, block_k])
    num_n = w_rows // block_n
    _stream_kernel[(num_programs, )](desc, sums, num_experts * num_n, num_n, k_steps, w_rows, BLOCKED=blocked,
                                     BLOCK_N=block_n, BLOCK_K=block_k, NUM_PROGRAMS=num_programs, STAGES=stages,
                                     num_warps=4)


def main(argv=None) -> int:
    from weave_moe.bench.anchor import graph_replay_ms
    from weave_moe.bench.config import emulated_spec
    from weave_moe.models import MoESpec

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="deepseek-v2,deepseek-v3,qwen3-30b-a3b")
    parser.add_argument("--emulate-ep", type=int, default=2)
    parser.add_argument("--experts", type=int, default=0, help="read only this many experts (0: every local one)")
    parser.add_argument("--blocks", default=DEFAULT_BLOCKS, help="BLOCK_N x BLOCK_K values, comma-separated")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    sums = torch.empty(num_sms, device=device)
    rows, failed = [], 0
    for name in args.models.split(","):
        spec = emulated_spec(MoESpec.from_name(name.strip()), args.emulate_ep)
        E = min(args.experts, spec.num_experts) if args.experts else spec.num_experts
        H, I = spec.hidden_size, spec.intermediate_size
        for gemm, (N, K) in ((0, (2 * I, H)), (1, (H, I))):
            gen = torch.Generator(device=device).manual_seed(gemm)
            w = torch.randn(E, N, K, device=device, generator=gen).bfloat16()
            expected = torch.sum(w, dtype=torch.float32).item()
            numel = w.numel()
            nbytes = numel * 2
            contiguous = statistics.median(graph_replay_ms(lambda: torch.sum(w, dtype=torch.float32), args.reps))
            row = dict(model=name, gemm=gemm, experts=E, N=N, K=K, bytes=nbytes, torch_sum_ms=contiguous,
                       torch_sum_tbps=nbytes / contiguous / 1e9, variants={})
            print(f"{name} GEMM{gemm} weights [{E}, {N}, {K}] {nbytes / 2 ** 20:.0f} MiB: torch.sum "
                  f"{contiguous * 1e3:.1f} us, {row['torch_sum_tbps']:.2f} TB/s", flush=True)
            for text in args.blocks.split(","):
                block_n, block_k = (int(v) for v in text.strip().split("x"))
                if N % block_n or K % block_k:
                    print(f"  {text}: skipped (N = {N}, K = {K} not multiples)")
                    continue
                blocked_w = block_weights(w, block_k)
                for blocked, weights in ((False, w), (True, blocked_w)):
                    label = f"{text}{' blocked' if blocked else ''}"
                    stream(weights, block_n, block_k, blocked, num_sms, sums)
                    got = sums.sum().item()
                    ok = abs(got - expected) <= 1e-3 * (abs(expected) + numel ** 0.5)
                    failed += not ok
                    ms = statistics.median(graph_replay_ms(
                        lambda: stream(weights, block_n, block_k, blocked, num_sms, sums), args.reps))
                    row["variants"][label] = dict(ms=ms, tbps=nbytes / ms / 1e9, checksum_ok=ok)
                    print(f"  {label:18s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:5.2f} TB/s  "
                          f"{'checked' if ok else f'CHECKSUM WRONG {got} vs {expected}'}", flush=True)
                blocked_w = None   # freed before the next block shape's copy
            rows.append(row)
            w = None
            torch.cuda.empty_cache()
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(dict(device=torch.cuda.get_device_name(), command=" ".join(sys.argv), rows=rows), f,
                              indent=1)
    print(f"stream_probe: {failed} failed checks")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
