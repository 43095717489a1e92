#!/usr/bin/env bash
# Kernel-config sweep with in-kernel timelines (serial policy: clean per-tile GEMM rates) and a host-path profile.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p $OUT
WEAVE_MOE_HOST_TIMING=1 timeout 120 python3 scripts/profile_layer.py --model qwen3-30b-a3b --tokens 8192 --variants nccl,weave --rows 8 2>&1 | grep -E "#####|host ms|moe_megakernel|cudaLaunchKernel" | cut -c1-200
for cfg in ${CONFIGS:-"stages1=4" "block_k1=128,stages1=3" "block_n1=256,stages1=3" "stages0=4" "block_m=64"}; do
  for m in "qwen3-30b-a3b 8192" "deepseek-v3 4096"; do
    set -- $m
    echo "### cfg=$cfg model=$1 tokens=$2"
    WEAVE_MOE_KERNEL_CONFIG=$cfg timeout 100 python3 scripts/timeline_stats.py --model $1 --tokens $2 --variants weave:serial --out $OUT 2>&1 | grep -E "^rank 0|gemm|dispatch|combine|reduce|rror" | head -7
  done
done
