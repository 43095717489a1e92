#!/usr/bin/env bash
# Kernel-config sweep with in-kernel timelines; host-path profile. Run on the 2 x H200 machine.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p $OUT
timeout 120 python3 scripts/profile_layer.py --model qwen3-30b-a3b --tokens 8192 --variants weave --rows 12 2>&1 | grep -E "#####|moe_megakernel|cudaStreamSync|cudaLaunchKernel|Self CPU time total" | cut -c1-180
for cfg in "block_n0=64" "block_n0=128" "block_n0=128,block_n1=256" "block_n0=64,num_stages=4" "block_n0=128,block_k=128,num_stages=2"; do
  for m in "qwen3-30b-a3b 8192" "deepseek-v3 4096"; do
    set -- $m
    echo "### cfg=$cfg model=$1 tokens=$2"
    WEAVE_MOE_KERNEL_CONFIG=$cfg timeout 100 python3 scripts/timeline_stats.py --model $1 --tokens $2 --variants weave:serial,weave:static:20 --out $OUT 2>&1 | grep -E "^rank 0|gemm|error|Error" | head -12
  done
done
