"""Find the launch that faults in a paired decode call (KernelConfig.pair_dispatch) on a GPU: run with
CUDA_LAUNCH_BLOCKING=1 so that the failing launch raises at its own call. One layer per (model, T_max, T, config)
given on the command line as model:T_max:T:config (config: WEAVE_MOE_KERNEL_CONFIG syntax, '+' for ',');
each in a fresh process, its traceback printed."""

import os
import subprocess
import sys

CHILD = r'''
import dataclasses, sys, torch
from weave_moe import ExpertParallelMoE
from weave_moe.backends.weave.config import KernelConfig
from weave_moe.models import MoESpec
from weave_moe.reference import moe_error, reference_moe
from weave_moe.routing import uniform
from weave_moe.testing import make_experts
specs = {"dsv3": MoESpec(128, 8, 7168, 2048, name="dsv3-emu"), "q3": MoESpec(64, 8, 2048, 768, name="q3-emu")}
model, t_max, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spec, dev = specs[model], torch.device("cuda")
layer = ExpertParallelMoE(spec, backend="weave", policy="serial", max_tokens_per_rank=t_max, device=dev,
                          config=dataclasses.replace(KernelConfig.from_env(), resident="on"), debug_poison=True)
w13, w2 = make_experts(spec, seed=1, device=dev)
layer.load_experts(w13, w2)
for call in range(3):
    x = torch.randn(T, spec.hidden_size, device=dev).bfloat16()
    ids, w = uniform(T, spec.num_experts, spec.top_k, seed=call, device=dev)
    out = layer(x, ids, w)
    layer.synchronize()
    print("call", call, "error", moe_error(out.float(), reference_moe(x, ids, w, w13, w2).float()), flush=True)
print("OK")
'''

for case in sys.argv[1:]:
    model, t_max, T, config = case.split(":", 3)
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", WEAVE_MOE_KERNEL_CONFIG=config.replace("+", ","))
    print(f"=== {case}", flush=True)
    result = subprocess.run([sys.executable, "-c", CHILD, model, t_max, T], env=env, capture_output=True, text=True,
                            timeout=240)
    lines = (result.stdout + result.stderr).strip().splitlines()
    print("\n".join(lines[-25:]), flush=True)
