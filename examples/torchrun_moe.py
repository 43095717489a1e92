"""An MoE block under torchrun: a router, then one expert-parallel layer, called with a different batch every step.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_moe.py                       # CPU: gloo + nccl backend
    torchrun --standalone --nproc-per-node 2 examples/torchrun_moe.py --model qwen3-30b-a3b  # 2 GPUs: the megakernel

Each rank owns E / EP experts; every step routes its own tokens through a softmax gate, runs the layer, and (with
--check) compares with the single-process reference on the same tokens.
"""

import argparse
import time

import torch
import torch.distributed as dist

import weave_moe as wm
from weave_moe.reference import moe_error, reference_moe
from weave_moe.testing import make_experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="registered model (default: a small one on CPU, qwen3-30b-a3b "
                                                      "on GPUs); see `weave-moe models`")
    parser.add_argument("--backend", default=None, help="weave (default with GPUs) or nccl (default on CPU)")
    parser.add_argument("--policy", default="weave", help="weave backend schedule policy")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=None, help="largest batch per rank (default 256 CPU, 8192 GPU)")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    spec = (wm.MoESpec.from_name(args.model) if args.model else
            wm.MoESpec.from_name("qwen3-30b-a3b") if on_gpu else wm.MoESpec(16, 4, 256, 128, name="small"))
    if args.backend is None:   # the megakernel where the GPU runs it (Hopper or newer), else the all-to-all baseline
        from weave_moe.backends.weave.config import unsupported_device

        args.backend = "weave" if on_gpu and unsupported_device(device) is None else "nccl"
    backend = args.backend
    max_tokens = args.max_tokens or (8192 if on_gpu else 256)

    # The router is replicated (same seed everywhere); each rank holds only its slice of the experts.
    torch.manual_seed(0)
    gate = torch.nn.Linear(spec.hidden_size, spec.num_experts, bias=False).to(device)
    local = spec.num_experts // world
    w13, w2 = make_experts(spec, local, first_expert=rank * local, seed=1, device=device)
    options = dict(policy=args.policy) if backend == "weave" else {}
    layer = wm.ExpertParallelMoE(spec, group=dist.group.WORLD, backend=backend, max_tokens_per_rank=max_tokens,
                                 device=device, **options)
    layer.load_experts(w13, w2)
    if args.check:
        full_w13, full_w2 = make_experts(spec, seed=1, device=device)  # every expert, for the reference only

    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        tokens = int(torch.randint(1, max_tokens + 1, (1,), generator=generator))  # ragged batches across ranks
        x = torch.randn(tokens, spec.hidden_size, generator=generator).to(device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            ids, weights = wm.routing.from_gate(gate(x.float()), spec.top_k)
        start = time.perf_counter()
        out = layer(x, ids, weights)
        if on_gpu:
            torch.cuda.synchronize(device)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        line = f"rank {rank} step {step}: {tokens:5d} tokens, {elapsed_ms:7.2f} ms"
        if args.check:
            error = moe_error(out, reference_moe(x, ids, weights, full_w13, full_w2))[0]
            line += f", error vs reference {error:.2e}"
            assert error <= 1e-2, line
        print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
