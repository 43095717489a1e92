#!/usr/bin/env bash
# GPU bisect of the decode fault: trees/<commit>/src for each commit in commits.txt (oldest first)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/bis
tar -xzf _bisect/trees.tar.gz -C /tmp/bis
read -a C < _bisect/commits.txt
LOG=$OUT/bisect.log
test_one() {  # 0 = pass
  local c=$1 t0=$(date +%s)
  (cd /tmp/bis/trees/$c && PYTHONPATH=$PWD/src timeout ${PER:-150} python3 -m weave_moe.bench --emulate-ep 2 --models qwen3-30b-a3b --tokens ${TOK:-1,32} --routing uniform --variants weave:serial --check --iters 3 --no-progress --timeout $(( ${PER:-150} - 10 )) --name b-$c --out /tmp/bis/out-$c > /tmp/bis/log-$c 2>&1)
  local rc=$?
  echo "### $c rc=$rc $(( $(date +%s) - t0 ))s" >> $LOG
  grep -iE "rel|error|fail|Traceback|checks" /tmp/bis/log-$c | head -8 >> $LOG
  sed -n '/Failed checks/,/^$/p;/Errors/,/^$/p' /tmp/bis/out-$c/b-$c.md 2>/dev/null | head -12 >> $LOG
  echo "$c rc=$rc"
  return $rc
}
lo=0; hi=$(( ${#C[@]} - 1 ))
test_one ${C[$lo]} || { echo "GOOD END FAILS: environment?"; tail -40 /tmp/bis/log-${C[$lo]} >> $LOG; exit 3; }
test_one ${C[$hi]} && { echo "BAD END PASSES"; exit 4; }
while (( hi - lo > 1 )); do
  mid=$(( (lo + hi) / 2 ))
  if test_one ${C[$mid]}; then lo=$mid; else hi=$mid; fi
done
echo "FIRST BAD: ${C[$hi]} (last good ${C[$lo]})" | tee -a $LOG
tail -30 /tmp/bis/log-${C[$hi]} >> $LOG
