#!/usr/bin/env bash
# Device run A: GEMM1 A/B (paired 256 vs single 128, serial policy timelines), then the full correctness record.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p $OUT
for cfg in "block_n1=256" "block_n1=128"; do
  echo "### cfg=$cfg"
  WEAVE_MOE_KERNEL_CONFIG=$cfg timeout 90 python3 scripts/timeline_stats.py --model deepseek-v3 --tokens 4096 --variants weave:serial --out /tmp 2>&1 | grep -E "^rank 0|gemm1|rror" | head -3
done
timeout 480 python3 -m weave_moe.validate --suite all --stress-calls 1000 --stall --out $OUT/validate-all.json --timeout 470 2>&1 | grep -vE "^PASS" | tail -30
