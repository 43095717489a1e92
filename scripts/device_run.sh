#!/usr/bin/env bash
# One device call: environment facts, correctness, timing. Usage: scripts/device_run.sh <stage...>
# Results land under $OUT (the device tool brings them back).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    env) nvidia-smi -L; nvidia-smi topo -m | head -4; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())";;
    quick) timeout 400 python3 -m weave_moe.validate --suite quick --out "$OUT/validate-quick.json" --timeout 380;;
    edge) timeout 500 python3 -m weave_moe.validate --suite edge --stress-calls 300 --stall --out "$OUT/validate-edge.json" --timeout 480;;
    paper) timeout 580 python3 -m weave_moe.validate --suite paper --out "$OUT/validate-paper.json" --timeout 560;;
    bench-small) timeout 500 python3 -m weave_moe.cli bench --models qwen3-30b-a3b,deepseek-v2-lite --tokens 2048,8192 --routing uniform,skewed --variants nccl,weave:serial,weave:static:20,weave --iters 10 --no-progress --name bench-small --out "$OUT" --timeout 480;;
    *) echo "unknown stage $stage";;
  esac
done
