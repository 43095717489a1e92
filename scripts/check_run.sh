#!/usr/bin/env bash
# Quick device check after a change: correctness (quick suite), host profile, kernel timeline of two shapes.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p $OUT
timeout 200 python3 -m weave_moe.validate --suite quick --out $OUT/validate-quick.json --timeout 190 2>&1 | grep -E "FAIL|passed"
timeout 120 python3 scripts/profile_layer.py --model qwen3-30b-a3b --tokens 8192 --variants nccl,weave,weave:static:20 --rows 12 2>&1 | grep -E "#####|moe_megakernel|cudaStreamSync|cudaLaunchKernel|Self CPU time total" | cut -c1-180
for m in "qwen3-30b-a3b 8192" "deepseek-v3 4096"; do
  set -- $m
  timeout 100 python3 scripts/timeline_stats.py --model $1 --tokens $2 --variants ${VARIANTS:-weave:serial,weave:static:20,weave} --out $OUT 2>&1 | grep -E "^rank|gemm|error|Error" | head -24
done
