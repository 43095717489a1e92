export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p $OUT/work
for kc in "early_dispatch=1,dispatch_beside_emit=1,pair_dispatch=1" "pair_dispatch=1" "early_dispatch=1,dispatch_beside_emit=1"; do
  echo "=== $kc $(date +%T)"
  WEAVE_MOE_KERNEL_CONFIG=$kc CUDA_LAUNCH_BLOCKING=1 timeout 130 python3 scripts/resident_check.py --out $OUT/work/rc-$(echo $kc | tr ',=' '_-').json --checks check_no_sync_and_host_time > $OUT/work/rc-$(echo $kc | tr ',=' '_-').log 2>&1
  echo "rc=$?"; grep -E "^(PASS|FAIL)" $OUT/work/rc-$(echo $kc | tr ',=' '_-').log | cut -c1-300
  grep -h -o '"traceback": .*' $OUT/work/rc-$(echo $kc | tr ',=' '_-').log | head -1 | sed 's/\\n/\n/g' | tail -25
done
