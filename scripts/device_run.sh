#!/usr/bin/env bash
# One device call: environment facts, correctness, timing. Usage: scripts/device_run.sh <stage...>
# Results land under $OUT/work and are packed into $OUT/results.tar.gz (the device tool brings back <= 8 files).
# Set WEAVE_MOE_GIT_COMMIT to the commit being run (the tree copied to the GPU box has no .git).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; W=$OUT/work; mkdir -p "$W"
SWEEP_VARIANTS="nccl,weave:serial,weave"
for c in 8 16 24 32 48 64 96; do for k in 1 2 4; do SWEEP_VARIANTS+=",weave:static:$c,$k"; done; done
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    env) nvidia-smi -L; nvidia-smi topo -m | head -4; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())";;
    # QUICK_ARGS: more options, e.g. --variants weave:serial@gemm0_gather=on
    # decode sizes checked first (the decode compiles; a fault in them passed every prefill check, perf-notes 28):
    # nccl and the weave backend's serial and adaptive policies against the reference on a layer's first call and on
    # a replay (bench --check), at 1 / 32 / 128 tokens, one rank's work of EP=2
    decode-check) timeout "${DC_TIMEOUT:-240}" python3 -m weave_moe.bench --emulate-ep 2 --models "${DC_MODELS:-qwen3-30b-a3b,deepseek-v3}" --tokens "${DC_TOKENS:-1,32,128}" --routing uniform --variants "${DC_VARIANTS:-nccl,weave:serial,weave}" --check --iters 5 --no-progress --timeout $(( ${DC_TIMEOUT:-240} - 10 )) --name decode-check --out "$W" > "$W/decode-check.log" 2>&1; echo "rc=$?"; tail -14 "$W/decode-check.log";;
    quick) timeout "${QUICK_TIMEOUT:-400}" python3 -m weave_moe.validate --suite quick --nproc "${NPROC:-$(nvidia-smi -L | wc -l)}" ${QUICK_ARGS:-} --out "$W/validate-quick.json" --timeout $(( ${QUICK_TIMEOUT:-400} - 20 )) > "$W/validate-quick.log" 2>&1; echo "rc=$?"; grep -vE "^PASS" "$W/validate-quick.log" | tail -12;;
    quick-host) WEAVE_MOE_KERNEL_CONFIG=resident=off timeout 400 python3 -m weave_moe.validate --suite quick --nproc "${NPROC:-$(nvidia-smi -L | wc -l)}" --out "$W/validate-quick-host.json" --timeout 380 > "$W/validate-quick-host.log" 2>&1; echo "rc=$?"; grep -vE "^PASS" "$W/validate-quick-host.log" | tail -12;;
    failures) timeout "${FAILURES_TIMEOUT:-400}" python3 -m weave_moe.validate --suite quick --failures --nproc "${NPROC:-$(nvidia-smi -L | wc -l)}" --out "$W/validate-failures.json" --timeout 380 > "$W/validate-failures.log" 2>&1; echo "rc=$?"; grep -vE "^PASS" "$W/validate-failures.log" | tail -12;;
    edge) timeout 400 python3 -m weave_moe.validate --suite edge --stress-calls 300 --bad-ids --nproc "${NPROC:-$(nvidia-smi -L | wc -l)}" --out "$W/validate-edge.json" --timeout 380 > "$W/validate-edge.log" 2>&1; echo "rc=$?"; grep -vE "^PASS" "$W/validate-edge.log" | tail -12;;
    # one GPU: the per-rank work of EP=2 (E/2 local experts, T*k rows), every backend side by side
    emu-quick) timeout 300 python3 -m weave_moe.bench --emulate-ep 2 --models qwen3-30b-a3b,deepseek-v3,deepseek-v2-lite --tokens 128,2048,8192 --routing uniform --variants nccl,weave:serial,weave --check --iters 20 --no-progress --timeout 280 --name "${BENCH_NAME:-emu-quick}" --out "$W" 2>&1 | tail -25;;
    # grouped_gemm=off: the serial policy's GEMMs inside the megakernel, so its timeline covers the whole call
    utilisation) WEAVE_MOE_KERNEL_CONFIG=grouped_gemm=off timeout "${UTIL_TIMEOUT:-400}" python3 scripts/timeline_stats.py --emulate-ep 2 --models deepseek-v3:4096,qwen3-30b-a3b:8192 --variants weave:serial,weave:static:20,weave:static:20,4,weave --out "$W/util" > "$W/utilisation.log" 2>&1; echo "rc=$?"; grep -v '^   ' "$W/utilisation.log" | tail -16;;
    # per-shape grouped-GEMM configs (weave-moe tune, one GPU): the six paper models' per-rank work of EP=2 at 2048 and
    # 8192 tokens (TUNE_TOKENS, TUNE_MODELS; TUNE_ARGS: more options, e.g. the candidate grid; TUNE_OUT: a table to
    # update in place, e.g. the shipped one, instead of a new one); the table comes back as $W/tuned/<device key>.json (to commit as
    # src/weave_moe/backends/weave/kernels/tuned/<device key>.json), written after every shape, so a timeout keeps what ran
    tune) timeout "${TUNE_TIMEOUT:-300}" python3 -m weave_moe.cli tune --models "${TUNE_MODELS:-deepseek-v3,phi-3.5-moe,qwen3-30b-a3b,qwen3.5-35b-a3b,deepseek-v2-lite,deepseek-v2}" --emulate-ep 2 --tokens "${TUNE_TOKENS:-2048,8192}" --out "${TUNE_OUT:-$W/tuned}" ${TUNE_ARGS:-} > "$W/tune.log" 2>&1; echo "rc=$?"; grep -vE "^  GEMM" "$W/tune.log" | tail -45; if [ -n "${TUNE_OUT:-}" ]; then mkdir -p "$W/tuned"; cp "$TUNE_OUT" "$W/tuned/"; fi;;
    # the default (adaptive) policy's planning link: KernelConfig.fused_planner (the device planner inside the counts
    # launch) and early_scan (the first table kernel beside the planning launch) side by side with the defaults, at
    # decode and prefill sizes (one GPU, one rank's work of EP=2), --check on every row; the planner's own timings
    # and the planning counts launch's bitwise check are the `planner` stage (device_planner_check.py)
    fused-planner) timeout "${FP_TIMEOUT:-400}" python3 -m weave_moe.bench --emulate-ep 2 --models "${FP_MODELS:-qwen3-30b-a3b,deepseek-v3}" --tokens "${FP_TOKENS:-1,8,32,128,2048}" --routing uniform --variants nccl,weave:serial,weave,weave@fused_planner=on,weave@early_scan=on,weave@fused_planner=on@early_scan=on --check --iters 30 --rounds 5 --no-progress --timeout $(( ${FP_TIMEOUT:-400} - 10 )) --name fused-planner --out "$W" > "$W/fused-planner.log" 2>&1; echo "rc=$?"; tail -30 "$W/fused-planner.log";;
    # where the grouped GEMMs lose against a dense GEMM (issue 14, perf-notes 30): the layer's tiles against the
    # same tiles all on expert 0's weights, GROUP_M values, the same rows over 1 / 8 / 32 / E/2 equal experts;
    # rotated order
    gemm-l2) timeout "${GL_TIMEOUT:-400}" python3 scripts/gemm_l2_probe.py --models "${GL_MODELS:-deepseek-v3}" --tokens "${GL_TOKENS:-8192}" --rounds "${GL_ROUNDS:-15}" --out "$W/gemm_l2_probe.json" > "$W/gemm_l2_probe.log" 2>&1; echo "rc=$?"; tail -24 "$W/gemm_l2_probe.log";;
    # the decode levers side by side, --check on every row, 5 rounds: the serial policy without the paired call (on
    # by default at EP = 1, perf-notes 37-38), with the early dispatch instead; the default policy with the early dispatch, and with the planner in the counts launch and the scan
    # beside it too (its ~10 us over serial at 1 token, perf-notes 28 and 34)
    decode-levers) timeout "${DL_TIMEOUT:-420}" python3 -m weave_moe.bench --emulate-ep 2 --models "${DL_MODELS:-qwen3-30b-a3b,deepseek-v3}" --tokens "${DL_TOKENS:-1,8,32}" --routing uniform --variants "${DL_VARIANTS:-nccl,weave:serial@pair_dispatch=off,weave:serial@pair_dispatch=off@early_dispatch=on,weave:serial,weave,weave@early_dispatch=on,weave@fused_planner=on@early_scan=on@early_dispatch=on}" --check --iters 30 --rounds 5 --no-progress --timeout $(( ${DL_TIMEOUT:-420} - 10 )) --name decode-levers --out "$W" > "$W/decode-levers.log" 2>&1; echo "rc=$?"; tail -34 "$W/decode-levers.log";;
    # the default policy at EP = 1 without emulation (KernelConfig.serial_at_ep1: the serial plan's layer) against
    # planning on the device per call, --check on every row, 3 rounds
    ep1-default) timeout "${E1_TIMEOUT:-300}" python3 -m weave_moe.bench --models "${E1_MODELS:-qwen3-30b-a3b,deepseek-v2-lite}" --tokens "${E1_TOKENS:-1,32,2048}" --routing uniform --variants "${E1_VARIANTS:-nccl,weave,weave@serial_at_ep1=off}" --check --iters 20 --rounds 3 --no-progress --timeout $(( ${E1_TIMEOUT:-300} - 10 )) --name ep1-default --out "$W" > "$W/ep1-default.log" 2>&1; echo "rc=$?"; tail -30 "$W/ep1-default.log";;
    # the warp-specialised Gluon grouped GEMMs (kernels/ws_gemm.py: a TMA producer warp, wgmma consumer warpgroups)
    # against the Triton grouped GEMMs (the layer's configs) and torch._grouped_mm, each GEMM alone on the same rows,
    # cold L2, every variant checked first (WS_CONFIGS: candidates, e.g. 128x256x64w8s4,64x256x64w4s4)
    ws-gemm) timeout "${WS_TIMEOUT:-400}" python3 scripts/ws_gemm_probe.py --models "${WS_MODELS:-deepseek-v3,deepseek-v2,phi-3.5-moe,qwen3-30b-a3b,qwen3.5-35b-a3b,deepseek-v2-lite}" --tokens "${WS_TOKENS:-2048,8192}" ${WS_CONFIGS:+--configs "$WS_CONFIGS"} ${WS_ARGS:-} --out "$W/ws_gemm_probe.json" > "$W/ws_gemm_probe.log" 2>&1; echo "rc=$?"; grep -v "^  " "$W/ws_gemm_probe.log" | tail -30;;
    # the weights streamed alone in the grouped GEMMs' block order, the layer's layout against the K-blocked one
    # (scripts/stream_probe.py, perf-notes 47: is the DRAM access pattern what holds the weight-streaming GEMMs at
    # 61-70% of HBM?); STP_EXPERTS=8: a decode call's active experts only
    stream-probe) timeout "${STP_TIMEOUT:-200}" python3 scripts/stream_probe.py --models "${STP_MODELS:-deepseek-v2,deepseek-v3,qwen3-30b-a3b}" ${STP_EXPERTS:+--experts "$STP_EXPERTS"} --out "$W/stream_probe${STP_EXPERTS:+-$STP_EXPERTS}.json" > "$W/stream_probe${STP_EXPERTS:+-$STP_EXPERTS}.log" 2>&1; echo "rc=$?"; tail -30 "$W/stream_probe${STP_EXPERTS:+-$STP_EXPERTS}.log";;
    # perf-notes 47's first call in one stage (~8 min): the DRAM question without and with the MMAs (the layer's
    # layout against the K-blocked one, "b"), then `tune --ws` on two shapes (its first GPU run, table under
    # $W/tuned), then the Gluon GEMMs in calls
    # the Gluon GEMM0 reading the received rows through the gather rows (KernelConfig.ws_gather, perf-notes 48): each
    # GEMM0 alone through gather rows (the ws configs' cp.async producer, the Triton kernel's, the gather launch +
    # the ws kernel on rows in expert order; checked), then in calls, the serial policy without and with it, checked
    ws-gather) WS_TIMEOUT="${WG_TIMEOUT:-150}" WS_MODELS="${WG_MODELS:-deepseek-v2,deepseek-v3,qwen3-30b-a3b}" WS_TOKENS="${WG_TOKENS:-2048,8192}" WS_CONFIGS="${WG_CONFIGS:-64x256x64w4s4,128x256x64w8s4}" WS_ARGS=--gather "$0" ws-gemm
        WC_TIMEOUT="${WGC_TIMEOUT:-150}" WC_TOKENS="${WGC_TOKENS:-512,2048,8192}" WC_MODELS="${WGC_MODELS:-deepseek-v2,qwen3-30b-a3b,deepseek-v3}" WC_VARIANTS="nccl,weave:serial,weave:serial@ws_gather=on" WC_NAME=ws-gather-calls "$0" ws-calls;;
    # GEMM1 launched programmatically after GEMM0 where both are Gluon (KernelConfig.ws_chain, perf-notes 48): the serial
    # policy without and with it at decode and prefill sizes, every row checked, 3 rounds
    ws-chain) WC_TIMEOUT="${WCH_TIMEOUT:-200}" WC_TOKENS="${WCH_TOKENS:-1,8,32,2048}" WC_MODELS="${WCH_MODELS:-qwen3-30b-a3b,deepseek-v3,deepseek-v2}" WC_VARIANTS="nccl,weave:serial,weave:serial@ws_chain=on" WC_NAME=ws-chain-calls "$0" ws-calls;;
    # the first call of the next GPU session (perf-notes 48): ws-gather, ws-chain, then the stream probe
    # the gather launch's copy by received row (KernelConfig.scatter_rows) against by pair, where a call makes one
    # (I > 1024: the Triton GEMM0 does not read the gather rows), at prefill sizes, --check on every row, 3 rounds
    scatter-rows) timeout "${SR_TIMEOUT:-420}" python3 -m weave_moe.bench --emulate-ep 2 --models "${SR_MODELS:-deepseek-v3,deepseek-v2,deepseek-v2-lite,phi-3.5-moe}" --tokens "${SR_TOKENS:-2048,8192}" --routing uniform --variants "${SR_VARIANTS:-nccl,weave:serial,weave:serial@scatter_rows=on}" --check --iters 10 --rounds 3 --no-progress --timeout $(( ${SR_TIMEOUT:-420} - 10 )) --name scatter-rows --out "$W" > "$W/scatter-rows.log" 2>&1; echo "rc=$?"; tail -30 "$W/scatter-rows.log";;
    # the next session's first call (docs/perf-notes.md, "The next GPU session, one list (as of entry 49)"), ~9 min
    # EP=2's protocol on one GPU with scatter_rows / ws_chain on (entry 51: checked at EP=1 only on a GPU); the table
    # without DeepSeek-V2 2048's GEMM0 entry (entry 51) in calls, with the Gluon GEMM0 through the gather
    # rows beside it (ws_gather, now on the 64x256x64 default there), uniform and skewed; then issue 14's record
    next52) SV_TIMEOUT=200 "$0" shared-validate
        TA_TABLES=shipped TA_MODELS=deepseek-v2,deepseek-v3 TA_TOKENS=2048 TA_ROUTING=uniform,skewed TA_VARIANTS=nccl,weave:serial,weave:serial@ws_gather=on TA_TIMEOUT=200 TA_PROFILE=deepseek-v2:2048 "$0" table-ab;;
    # the H100 prefill entries re-tuned into the shipped table, both routings, 3 confirmation rounds, the probe order
    # fixed (perf-notes 51, list item 1): three models a call
    retune-a) TUNE_TIMEOUT=560 TUNE_MODELS=deepseek-v3,deepseek-v2,phi-3.5-moe TUNE_TOKENS=2048,8192 TUNE_OUT=src/weave_moe/backends/weave/kernels/tuned/nvidia-h100-80gb-hbm3.json TUNE_ARGS="--block-m 64,128 --block-n 256 --warps 4,8 --stages 3,4 --ws rule,64x256x64w4s4c2,128x256x64w8s4 --routing uniform,skewed --confirm 3 --git-commit ${WEAVE_MOE_GIT_COMMIT:-unknown}" "$0" tune;;
    retune-b) TUNE_TIMEOUT=560 TUNE_MODELS=qwen3-30b-a3b,qwen3.5-35b-a3b,deepseek-v2-lite TUNE_TOKENS=2048,8192 TUNE_OUT=src/weave_moe/backends/weave/kernels/tuned/nvidia-h100-80gb-hbm3.json TUNE_ARGS="--block-m 64,128 --block-n 256 --warps 4,8 --stages 3,4 --ws rule,64x256x64w4s4c2,128x256x64w8s4 --routing uniform,skewed --confirm 3 --git-commit ${WEAVE_MOE_GIT_COMMIT:-unknown}" "$0" tune;;
    # 192-row tiles (three 64-row consumers sharing each W stage: ws_ring "Row parts") on DeepSeek-V2 / V3 at 2048
    # tokens, each GEMM alone beside the 64- and 128-row configs; then DeepSeek-V2 2048 tuned with them among the
    # candidates into the shipped table, and its calls with that table (uniform, skewed) and a timeline
    rowparts) WS_MODELS=deepseek-v2,deepseek-v3 WS_TOKENS=2048 WS_CONFIGS=64x256x64w4s4,128x256x64w8s4,192x128x64w4s4,192x128x64w4s3 WS_TIMEOUT=220 "$0" ws-gemm
        TUNE_TIMEOUT=150 TUNE_MODELS=deepseek-v2 TUNE_TOKENS=2048 TUNE_OUT=src/weave_moe/backends/weave/kernels/tuned/nvidia-h100-80gb-hbm3.json TUNE_ARGS="--block-m 64,128 --block-n 256 --warps 4,8 --stages 3,4 --ws rule,64x256x64w4s4c2,128x256x64w8s4,192x128x64w4s4,192x128x64w4s3 --routing uniform,skewed --confirm 3 --git-commit ${WEAVE_MOE_GIT_COMMIT:-unknown}" "$0" tune
        TA_TABLES=shipped TA_MODELS=deepseek-v2 TA_TOKENS=2048 TA_ROUTING=uniform,skewed TA_VARIANTS=nccl,weave:serial TA_TIMEOUT=150 TA_PROFILE=deepseek-v2:2048 "$0" table-ab;;
    # every H100 prefill entry re-tuned with the row-part configs (192x128x64, 4 or 5 stages) and 5-stage 64x256x64
    # among the candidates, then issue 14's record on that table in the same call
    retune-rows) TUNE_TIMEOUT=300 TUNE_OUT=src/weave_moe/backends/weave/kernels/tuned/nvidia-h100-80gb-hbm3.json TUNE_ARGS="--block-m 64,128 --block-n 256 --warps 4,8 --stages 3,4 --ws rule,64x256x64w4s4c2,64x256x64w4s5,128x256x64w8s4,192x128x64w4s4,192x128x64w4s5 --routing uniform,skewed --confirm 3 --git-commit ${WEAVE_MOE_GIT_COMMIT:-unknown}" "$0" tune
        EVAL_TIMEOUT=280 EVAL_TOKENS=2048,8192 EVAL_VARIANTS=nccl,weave:serial,weave BENCH_NAME=h100-eval6-emu-ep2-r3 "$0" eval6-emu;;
    # perf-notes entry 56: the 2048-token prefill entries re-tuned with `--ws auto`, which now includes the 192-row
    # tile with GROUP_M 1 and 2 (hand-set for DeepSeek-V2 / V3 at 7180516), into the shipped H100 table
    retune-2048) TUNE_TIMEOUT=560 TUNE_MODELS=deepseek-v3,deepseek-v2,phi-3.5-moe,qwen3-30b-a3b,qwen3.5-35b-a3b,deepseek-v2-lite TUNE_TOKENS=2048 TUNE_OUT=src/weave_moe/backends/weave/kernels/tuned/nvidia-h100-80gb-hbm3.json TUNE_ARGS="--block-m 64,128 --block-n 256 --warps 4,8 --stages 3,4 --ws auto --routing uniform,skewed --confirm 3 --git-commit ${WEAVE_MOE_GIT_COMMIT:-unknown}" "$0" tune;;
    # perf-notes 52's list, item 0: the resident check with the Gluon GEMM0 reading the gather rows (ws_gather)
    next53) WEAVE_MOE_KERNEL_CONFIG=ws_gather=1 RESIDENT_CALLS=1000 RESIDENT_TIMEOUT=400 "$0" resident;;
    # item 1: DeepSeek-V2 / V3 2048's GEMMs alone with the row parts: 192-row at BK 64 (4, 5 stages), BK 128 (2
    # stages), GROUP_M 2 / 4, and 128-row tiles as two parts of 64x256 or 64x128 ("h")
    next53b) WS_MODELS=deepseek-v2,deepseek-v3 WS_TOKENS=2048 WS_CONFIGS=192x128x64w4s4,192x128x64w4s5,192x128x128w4s2,192x128x64w4s4g2,192x128x64w4s4g4,128x256x64w4s4h,128x256x64w4s3h,128x128x64w4s4h WS_TIMEOUT=400 "$0" ws-gemm;;
    # perf-notes 53 (KernelConfig.chain_pairs: the paired call's tile tables in its counts launch, GEMM0 loading its
    # first weights while the pair dispatch runs): the resident check with it (~6 min on a fresh host), then the
    # serial policy without and with it at decode sizes, every row checked, 5 rounds, with the calls' timelines
    next54) WEAVE_MOE_KERNEL_CONFIG=chain_pairs=on RESIDENT_CALLS=1000 RESIDENT_TIMEOUT=400 "$0" resident;;
    next54b) WC_TIMEOUT="${CP_TIMEOUT:-300}" WC_TOKENS="${CP_TOKENS:-1,8,32}" WC_MODELS="${CP_MODELS:-qwen3-30b-a3b,deepseek-v3,deepseek-v2}" WC_ROUNDS=5 WC_VARIANTS="nccl,weave:serial,weave:serial@chain_pairs=on" WC_NAME=chain-pairs "$0" ws-calls
        RP_TOKENS="1 8" RP_VARIANTS="weave:serial,weave:serial@chain_pairs=on" "$0" resident-profile;;
    # perf-notes entry 56: the candidate table (DeepSeek-V3 2048's GEMM0 and Qwen3.5-35B-A3B 2048's on the Gluon
    # 192-row tile, GROUP_M 2 / 1) in calls against the shipped one, with and without ws_gather; then the 192-row and
    # GROUP_M variants at 8192 tokens, where the Triton kernels run today; next56c: the Triton GEMM0s of DeepSeek-V3,
    # Qwen3.5-35B-A3B and Qwen3-30B-A3B at 2048 tokens with GROUP_M = an expert's M tiles (1, 1, 2) in calls
    # the 8192-token Gluon entries of ws_gemm_probe (bench/results/h100-4ad5052) in calls: DeepSeek-V2 both GEMMs on
    # 128x256x64 w8 s4, Phi-3.5-MoE GEMM0 with GROUP_M 4 (the candidate also holds DeepSeek-V3 2048 GEMM0, next56)
    # decode timed as serving engines run it (bench --graph: each capturable variant's call replayed from a CUDA graph;
    # nccl at EP = 1 and weave's resident call both are) and eagerly, one host (eager first: a fresh host's compiles
    # land there, the graph run finds them cached)
    graph-decode) timeout "${GD_TEST_TIMEOUT:-120}" python3 -m pytest -q tests/test_gpu_nccl.py -k replays > "$W/graph-nccl-test.log" 2>&1; echo "nccl capture test rc=$?"; tail -2 "$W/graph-nccl-test.log"
          for mode in ${GD_MODES:-eager graph}; do timeout "${GD_TIMEOUT:-240}" python3 -m weave_moe.bench --emulate-ep 2 --models "${GD_MODELS:-qwen3-30b-a3b,qwen3.5-35b-a3b,deepseek-v3,deepseek-v2-lite}" --tokens "${GD_TOKENS:-1,8,32,128,512}" --routing uniform --variants "${GD_VARIANTS:-nccl,weave:serial,weave}" --check --iters 30 --rounds 3 $([ $mode = graph ] && echo --graph) --no-progress --timeout $(( ${GD_TIMEOUT:-240} - 10 )) --name "decode-$mode" --out "$W" > "$W/decode-$mode.log" 2>&1; echo "$mode rc=$?"; tail -12 "$W/decode-$mode.log" | cut -c1-200; done;;
    # the decode levers that lost eagerly because the host's time per call rose (entry 55's
    # chain_pairs), replayed from a caller's graph, where the host is outside the call (perf-notes entry 60)
    graph-levers) for mode in ${GL2_MODES:-eager graph}; do timeout "${GL2_TIMEOUT:-300}" python3 -m weave_moe.bench --emulate-ep 2 --models "${GL2_MODELS:-qwen3-30b-a3b,qwen3.5-35b-a3b,deepseek-v2-lite}" --tokens "${GL2_TOKENS:-1,8,32}" --routing uniform --variants "${GL2_VARIANTS:-nccl,weave:serial,weave:serial@chain_pairs=on,weave:serial@chain_pairs=capture}" --check --iters 30 --rounds 5 $([ $mode = graph ] && echo --graph) --no-progress --timeout $(( ${GL2_TIMEOUT:-300} - 10 )) --name "graph-levers-$mode" --out "$W" > "$W/graph-levers-$mode.log" 2>&1; echo "$mode rc=$?"; tail -14 "$W/graph-levers-$mode.log" | cut -c1-200; done;;
    # chain_pairs="capture" checked: the caller's-capture check (paired calls chained inside the capture, eager
    # calls after it unchained), then graph-levers
    next60) WEAVE_MOE_KERNEL_CONFIG=chain_pairs=capture RESIDENT_CHECKS=check_graph_capture RESIDENT_CALLS=100 RESIDENT_TIMEOUT="${N60_TIMEOUT:-200}" "$0" resident
        GL2_TIMEOUT="${N60B_TIMEOUT:-180}" "$0" graph-levers;;
    # why the skewed rows lose to the library where the uniform ones win: weave:serial's kernel timeline, uniform and
    # skewed (3.0, as the bench), DeepSeek-V2 at 2048 / 8192 and Qwen3-30B-A3B at 2048; DeepSeek-V3 8192 for where its
    # ~0.8 ms outside the GEMMs goes (issue 14's 620 TFLOP/s)
    skew-profile) for mt in ${SKP_CONFIGS:-deepseek-v2:2048 deepseek-v2:8192 qwen3-30b-a3b:2048 deepseek-v3:8192}; do for skew in 0 3; do
          timeout 120 python3 scripts/profile_layer.py --nproc 1 --emulate-ep 2 --model "${mt%%:*}" --tokens "${mt##*:}" --skew $skew --variants weave:serial --rows 30 > "$W/profile-skew$skew-${mt%%:*}-${mt##*:}.txt" 2>&1; echo "profile ${mt} skew $skew rc=$?"; grep -A14 -E "^#####.*span" "$W/profile-skew$skew-${mt%%:*}-${mt##*:}.txt"; done; done;;
    next58) TA_TABLES="shipped bench/results/h100-4ad5052/table-candidate.json" TA_MODELS=deepseek-v2,phi-3.5-moe TA_TOKENS=8192 TA_ROUTING=uniform,skewed TA_VARIANTS="nccl,weave:serial,weave:serial@ws_gather=on,weave" TA_TIMEOUT=240 "$0" table-ab;;
    next56) TA_TABLES="shipped bench/results/h100-7180516/table-candidate.json" TA_MODELS=deepseek-v3,qwen3.5-35b-a3b,qwen3-30b-a3b TA_TOKENS=2048 TA_ROUTING=uniform,skewed TA_VARIANTS="nccl,weave:serial,weave:serial@ws_gather=on,weave:serial@gemm0_gather=off" TA_TIMEOUT=270 "$0" table-ab;;
    next56b) WS_MODELS=deepseek-v3,deepseek-v2,phi-3.5-moe WS_TOKENS=8192 WS_CONFIGS=192x128x64w4s4,192x128x64w4s4g2,192x128x64w4s4g4,128x256x64w8s4,128x256x64w8s4g4 WS_TIMEOUT=300 "$0" ws-gemm;;
    next56c) TA_TABLES="shipped bench/results/h100-7180516/table-candidate-triton.json" TA_MODELS=deepseek-v3,qwen3.5-35b-a3b,qwen3-30b-a3b TA_TOKENS=2048 TA_ROUTING=uniform,skewed TA_VARIANTS="nccl,weave:serial" TA_TIMEOUT=250 "$0" table-ab;;
    # perf-notes 54 (one call, ~9 min): the decode chain's shortcuts (one-program pack and counts, the EP = 1 pair
    # dispatch without flags) in every row, the serial policy without / with chain_pairs at 1 / 8 / 32 tokens (5
    # rounds), decode in layers sized for a serving engine's 8192 tokens, both 1-token timelines, then the resident
    # check with ws_gather and chain_pairs on (what fits of 1000 calls)
    next55) WC_TIMEOUT=180 WC_TOKENS=1,8,32 WC_MODELS=qwen3-30b-a3b,deepseek-v3,deepseek-v2 WC_ROUNDS=5 WC_VARIANTS="nccl,weave:serial,weave:serial@chain_pairs=on" WC_NAME=chain-pairs "$0" ws-calls
        WC_TIMEOUT=90 WC_TOKENS=1,8 WC_MODELS=qwen3-30b-a3b,deepseek-v3 WC_ROUNDS=3 WC_ARGS="--max-tokens-per-rank 8192" WC_VARIANTS="nccl,weave:serial,weave:serial@chain_pairs=on" WC_NAME=decode-tmax8192 "$0" ws-calls
        RP_TOKENS=1 RP_VARIANTS="weave:serial,weave:serial@chain_pairs=on" "$0" resident-profile
        WEAVE_MOE_KERNEL_CONFIG=ws_gather=1,chain_pairs=on RESIDENT_CALLS=1000 RESIDENT_TIMEOUT="${RESIDENT_TIMEOUT:-170}" "$0" resident;;
    # perf-notes 52's list, item 2 (an H200): the six models' prefill shapes tuned with the Gluon kernels among the
    # candidates (--ws auto: the rule's configs and the 192-row tiles) into the shipped H200 table, then the record
    # (tune refuses to update a table measured on another GPU: on an H100 this stage stops before measuring.) The six
    # shapes at both sizes need more than one call: h200-prefill-2048 and h200-prefill-8192 split it (entry 61's list)
    # perf-notes 63: the same A/B cut to what decides `pair_tokens` / `decode_tokens`, in calls a host that is taken
    # back after a few minutes can finish: Qwen3-30B-A3B at 128 then 512 tokens, the partial JSON kept per row
    pt-short) PT_TIMEOUT=${PTS_TIMEOUT:-280} PT_MODELS=qwen3-30b-a3b PT_TOKENS=128,512 PT_NAME=pt-short PT_VARIANTS=nccl,weave:serial,weave:serial@pair_tokens=512,weave:serial@pair_dispatch=off@decode_tokens=512 "$0" pair-tokens;;
    # ... then decode calls in a layer of pair_tokens=512 and T_max 512: they take the decode layer's pair dispatch
    # (its size class), so they should time as in a decode layer
    pt-decode) PT_TIMEOUT=${PTD_TIMEOUT:-200} PT_MODELS=qwen3-30b-a3b PT_TOKENS=1,32 PT_NAME=pt-decode PT_ARGS="--max-tokens-per-rank 512" PT_VARIANTS=weave:serial,weave:serial@pair_tokens=512 "$0" pair-tokens;;
    h200-prefill) TUNE_TIMEOUT=${H2P_TIMEOUT:-420} TUNE_TOKENS=${H2P_TOKENS:-2048,8192} TUNE_OUT=src/weave_moe/backends/weave/kernels/tuned/nvidia-h200.json TUNE_ARGS="--block-m 64,128 --block-n 256 --warps 4,8 --stages 3,4 --ws auto,64x256x64w4s4c2,128x256x64w8s4 --routing uniform,skewed --confirm 3 --git-commit ${WEAVE_MOE_GIT_COMMIT:-unknown}" "$0" tune;;
    h200-prefill-2048) H2P_TIMEOUT=530 H2P_TOKENS=2048 "$0" h200-prefill;;
    h200-prefill-8192) H2P_TIMEOUT=530 H2P_TOKENS=8192 "$0" h200-prefill;;
    # perf-notes 61's list, item 1: the Qwen shapes' GEMMs at 128 / 512 tokens (over the library's alone there on an
    # H100) tuned into this GPU's own table, then decode as served at those sizes
    decode-tune) key=$(python3 -c "import torch; from weave_moe.backends.weave.kernels import gemm_configs as gc; print(gc.device_key(torch.cuda.get_device_name()))")
        TUNE_TIMEOUT=${DT_TIMEOUT:-400} TUNE_MODELS=${DT_MODELS:-qwen3-30b-a3b,qwen3.5-35b-a3b} TUNE_TOKENS=${DT_TOKENS:-128,512} TUNE_OUT="src/weave_moe/backends/weave/kernels/tuned/$key.json" TUNE_ARGS="--block-m 16,64 --block-n 128,256 --block-k 64,128 --warps 4 --stages 3,4 --ws auto,t16w128k128s5,t32w128k128s4,t64w128k128s4,t64w128k64s8 --routing uniform --confirm 3 --git-commit ${WEAVE_MOE_GIT_COMMIT:-unknown}" "$0" tune;;
    # perf-notes 62: the paired call (pair dispatch, no task tables, pair combine) for calls of 65-512 tokens, replayed
    # from a caller's graph as served, against the call with task tables
    # perf-notes 64's list: the long paired class's pair dispatch on more programs per SM; the decode record (1-512
    # tokens, the paired call's default pair_tokens against 64); the launches without GEMM copying in wider steps
    pp-ab) PT_TIMEOUT=${PP_TIMEOUT:-280} PT_MODELS=${PP_MODELS:-qwen3-30b-a3b,deepseek-v2-lite} PT_TOKENS=${PP_TOKENS:-128,256,512} PT_NAME=pp-ab PT_VARIANTS=nccl,weave:serial,weave:serial@pair_programs=2,weave:serial@pair_programs=4 "$0" pair-tokens;;
    decode-record) PT_TIMEOUT=${DR_TIMEOUT:-280} PT_MODELS=qwen3-30b-a3b,qwen3.5-35b-a3b,deepseek-v3 PT_TOKENS=1,8,32,128,512 PT_NAME=decode-record PT_VARIANTS=nccl,weave:serial,weave:serial@pair_tokens=64 "$0" pair-tokens;;
    # decode calls in a layer sized as servers size one (T_max 8192: the pack and the counts walk T_max x k ids each
    # call) against the bench's layers of T_max = the call's tokens
    decode-tmax) PT_TIMEOUT=${DTM_TIMEOUT:-240} PT_MODELS=qwen3-30b-a3b,deepseek-v3 PT_TOKENS=1,32,512 PT_NAME=decode-tmax PT_ARGS="--max-tokens-per-rank 8192" PT_VARIANTS=nccl,weave:serial "$0" pair-tokens;;
    # (pair_tokens=64: the call with task tables at 128 / 512 tokens too, what an EP > 1 rank makes there)
    copy-width) PT_TIMEOUT=${CW_TIMEOUT:-290} PT_MODELS=qwen3-30b-a3b,deepseek-v2-lite PT_TOKENS=${CW_TOKENS:-128,512,2048} PT_NAME=copy-width PT_VARIANTS=nccl,weave:serial@pair_tokens=64,weave:serial@pair_tokens=64@block_h=1024,weave:serial@pair_tokens=64@block_h=2048,weave:serial@pair_tokens=64@dispatch_rows=8,weave:serial@pair_tokens=64@combine_rows=8 "$0" pair-tokens;;
    pair-tokens) timeout "${PT_TIMEOUT:-540}" python3 -m weave_moe.bench --emulate-ep 2 --models "${PT_MODELS:-qwen3-30b-a3b,qwen3.5-35b-a3b}" --tokens "${PT_TOKENS:-128,256,512}" --routing uniform --variants "${PT_VARIANTS:-nccl,weave:serial,weave:serial@pair_tokens=512,weave:serial@pair_dispatch=off,weave:serial@pair_dispatch=off@decode_tokens=512,weave,weave@decode_tokens=512}" --check --iters 30 --rounds 3 --graph ${PT_ARGS:-} --no-progress --timeout $(( ${PT_TIMEOUT:-540} - 10 )) --name "${PT_NAME:-pair-tokens-graph}" --out "$W" > "$W/${PT_NAME:-pair-tokens-graph}.log" 2>&1; echo "rc=$?"; tail -22 "$W/${PT_NAME:-pair-tokens-graph}.log" | cut -c1-200;;
    # the 192-row tiles' GEMM0 through the gather rows (no copy launch): the small checks (each config also gathered),
    # then DeepSeek-V2 2048's calls with and without ws_gather on the shipped table (192x128x64 GEMM0), 3 rounds
    rowgather) timeout 150 python3 scripts/ws_gemm_probe.py --smoke-only --configs 192x128x64w4s4,192x128x64w4s5,64x256x64w4s4 > "$W/ws_gemm_smoke.log" 2>&1; echo "smoke rc=$?"; grep "SMOKE END" "$W/ws_gemm_smoke.log"
        SR_MODELS=deepseek-v2 SR_TOKENS=2048 SR_VARIANTS=nccl,weave:serial,weave:serial@ws_gather=on SR_TIMEOUT=200 "$0" scatter-rows;;
    # ... and, as a second call (one call may run 600 s), issue 14's record with the anchor in the rounds
    next52b) EVAL_TIMEOUT=500 EVAL_TOKENS=2048,8192 EVAL_VARIANTS=nccl,weave:serial,weave BENCH_NAME=h100-eval6-emu-ep2-r3 "$0" eval6-emu;;
    # DeepSeek-V2 at 2048 tokens (issue 14's worst row): each GEMM alone per config against the library's, then the
    # call with the analytical configs against the shipped table's, uniform and skewed, with the call's timeline
    next51) WS_MODELS=deepseek-v2 WS_TOKENS=2048 WS_CONFIGS=64x256x64w4s4,128x256x64w8s4,128x256x64w8s3,64x256x64w4s4c2,128x256x64w8s4t WS_TIMEOUT=130 "$0" ws-gemm
        TA_TABLES="off shipped" TA_MODELS=deepseek-v2 TA_TOKENS=2048 TA_ROUTING=uniform,skewed TA_VARIANTS=nccl,weave:serial TA_TIMEOUT=120 TA_PROFILE=deepseek-v2:2048 "$0" table-ab;;
    next49) SR_TIMEOUT=200 "$0" scatter-rows
        WC_TIMEOUT=150 WC_TOKENS=1,8,32 WC_MODELS=qwen3-30b-a3b,deepseek-v2,deepseek-v3 WC_VARIANTS=nccl,weave:serial,weave:serial@ws_chain=on WC_ROUNDS=5 WC_NAME=chain-decode "$0" ws-calls
        EVAL_TIMEOUT=230 EVAL_TOKENS=2048,8192 EVAL_MODELS=deepseek-v2,deepseek-v2-lite EVAL_VARIANTS=nccl,weave:serial,weave BENCH_NAME=h100-eval6-emu-ep2-r3-rest "$0" eval6-emu;;
    next48) WG_TIMEOUT=120 WGC_TIMEOUT=150 "$0" ws-gather; WCH_TIMEOUT=150 "$0" ws-chain; STP_TIMEOUT=70 "$0" stream-probe;;
    next47) STP_TIMEOUT=100 "$0" stream-probe
        WS_MODELS=deepseek-v2,deepseek-v3 WS_TOKENS=2048 WS_CONFIGS=64x256x64w4s4,64x256x64w4s4b,64x256x128w4s2,64x256x128w4s2b,64x256x64w4s4c2 WS_TIMEOUT=150 "$0" ws-gemm
        WD_MODELS=qwen3-30b-a3b,deepseek-v3 WD_TOKENS=1,32 WD_CONFIGS=t8w64k128s8,t8w64k128s8b,t16w64k128s8,t16w64k128s8b WD_TIMEOUT=80 "$0" ws-decode
        TUNE_TIMEOUT=90 TUNE_MODELS=deepseek-v2,qwen3-30b-a3b TUNE_TOKENS=2048,4 TUNE_ARGS="--block-m 64,128 --block-n 256 --warps 4,8 --stages 4 --ws rule,64x256x128w4s2 --confirm 2 --git-commit ${WEAVE_MOE_GIT_COMMIT:-unknown}" "$0" tune
        WC_TIMEOUT=100 WC_TOKENS=1,2048 WC_MODELS=deepseek-v2,qwen3-30b-a3b "$0" ws-calls;;
    # ... and their decode form (kernels/ws_decode.py: the weights as the MMA's rows) at decode sizes
    ws-decode) timeout "${WD_TIMEOUT:-300}" python3 scripts/ws_gemm_probe.py --decode --models "${WD_MODELS:-qwen3-30b-a3b,qwen3.5-35b-a3b,deepseek-v2-lite,deepseek-v3}" --tokens "${WD_TOKENS:-1,8,32,128}" ${WD_CONFIGS:+--configs "$WD_CONFIGS"} --out "$W/ws_decode_probe.json" > "$W/ws_decode_probe.log" 2>&1; echo "rc=$?"; grep -v "^  " "$W/ws_decode_probe.log" | tail -40;;
    # ... and in calls (KernelConfig.ws_gemm, on): the serial policy without and with them at decode and prefill sizes, one rank's
    # work of EP=2, --check on every row, 3 rounds (WC_ARGS: more bench options, e.g. --max-tokens-per-rank 8192)
    ws-calls) timeout "${WC_TIMEOUT:-420}" python3 -m weave_moe.bench --emulate-ep 2 --models "${WC_MODELS:-deepseek-v3,deepseek-v2,qwen3-30b-a3b,qwen3.5-35b-a3b}" --tokens "${WC_TOKENS:-1,32,2048,8192}" --routing uniform --variants "${WC_VARIANTS:-nccl,weave:serial@ws_gemm=off,weave:serial}" --check --iters 10 --rounds "${WC_ROUNDS:-3}" ${WC_ARGS:-} --no-progress --timeout $(( ${WC_TIMEOUT:-420} - 10 )) --name "${WC_NAME:-ws-calls}" --out "$W" > "$W/${WC_NAME:-ws-calls}.log" 2>&1; echo "rc=$?"; tail -30 "$W/${WC_NAME:-ws-calls}.log";;
    # the dispatch beside the emit (KernelConfig.dispatch_beside_emit) against the dispatch launch after it, at prefill
    # sizes, --check on every row, 5 rounds; with the early dispatch for decode calls too (1 token)
    beside-emit) timeout "${BE_TIMEOUT:-420}" python3 -m weave_moe.bench --emulate-ep 2 --models "${BE_MODELS:-qwen3-30b-a3b,deepseek-v3,deepseek-v2-lite}" --tokens "${BE_TOKENS:-1,128,2048,8192}" --routing uniform --variants "${BE_VARIANTS:-nccl,weave:serial,weave:serial@dispatch_beside_emit=on@early_dispatch=on,weave,weave@dispatch_beside_emit=on@early_dispatch=on}" --check --iters 20 --rounds 5 --no-progress --timeout $(( ${BE_TIMEOUT:-420} - 10 )) --name beside-emit --out "$W" > "$W/beside-emit.log" 2>&1; echo "rc=$?"; tail -34 "$W/beside-emit.log";;
    # the paired decode call at EP = 1 (KernelConfig.pair_dispatch, on by default, perf-notes 37-38) against the serial
    # policy without it and the default policy; at decode sizes, --check on every row, 5 rounds
    paired) timeout "${PD_TIMEOUT:-400}" python3 -m weave_moe.bench --emulate-ep 2 --models "${PD_MODELS:-qwen3-30b-a3b,deepseek-v3,deepseek-v2-lite}" --tokens "${PD_TOKENS:-1,8,32,64}" --routing uniform --variants "${PD_VARIANTS:-nccl,weave:serial@pair_dispatch=off,weave:serial,weave}" --check --iters 30 --rounds 5 --no-progress --timeout $(( ${PD_TIMEOUT:-400} - 10 )) --name paired --out "$W" > "$W/paired.log" 2>&1; echo "rc=$?"; tail -34 "$W/paired.log";;
    # the row copies in 16-byte vectors and the dispatch's pipelined steps (KernelConfig.vector_rows, on) against the
    # element-wise copies before them, side by side at decode and prefill sizes, --check on every row
    vector-rows) timeout "${VR_TIMEOUT:-420}" python3 -m weave_moe.bench --emulate-ep 2 --models "${VR_MODELS:-qwen3-30b-a3b,deepseek-v2,deepseek-v3}" --tokens "${VR_TOKENS:-1,32,2048,8192}" --routing uniform --variants "${VR_VARIANTS:-nccl,weave:serial,weave:serial@vector_rows=off,weave,weave@vector_rows=off}" --check --iters 20 --rounds 5 --no-progress --timeout $(( ${VR_TIMEOUT:-420} - 10 )) --name vector-rows --out "$W" > "$W/vector-rows.log" 2>&1; echo "rc=$?"; tail -34 "$W/vector-rows.log";;
    planner) timeout "${PLANNER_TIMEOUT:-300}" python3 scripts/device_planner_check.py --vectors 1000 --out "$W/device_planner_check.json" > "$W/device_planner_check.log" 2>&1; echo "rc=$?"; tail -20 "$W/device_planner_check.log";;
    baselines) timeout "${BASELINES_TIMEOUT:-300}" torchrun --standalone --nproc-per-node 1 scripts/baselines_check.py --iters 20 --out "$W/baselines_check.json" > "$W/baselines_check.log" 2>&1; echo "rc=$?"; tail -30 "$W/baselines_check.log";;
    # eval6 on one GPU (EVAL_ROUNDS rounds, 3 by default: one round moved rows by up to 8% between runs, perf-notes 49):
    # every paper model, the per-rank work of EP=2, every baseline that runs at EP=1 and the weave
    # policies, --check on all; partial JSON/CSV survive the timeout
    eval6-emu) timeout "${EVAL_TIMEOUT:-560}" python3 -m weave_moe.bench --emulate-ep 2 ${EVAL_MODELS:+--models "$EVAL_MODELS"} --tokens "${EVAL_TOKENS:-128,2048,8192}" --routing "${EVAL_ROUTING:-uniform,skewed}" --variants "${EVAL_VARIANTS:-nccl,weave:serial,weave:static:20,weave}" --check --iters 10 --rounds "${EVAL_ROUNDS:-3}" --no-progress --timeout 300 --name "${BENCH_NAME:-h200-eval6-emu-ep2}" --out "$W" > "$W/eval6.log" 2>&1; echo "rc=$?"; tail -40 "$W/eval6.log";;
    hf) mkdir -p "$W/hf"; timeout 400 python3 examples/hf_generate.py --preset qwen3-30b-a3b --new-tokens 8 --time-dir "$W/hf" > "$W/hf/hf_generate_gpu_ep1.log" 2>&1; echo "rc=$?"; tail -15 "$W/hf/hf_generate_gpu_ep1.log";;
    # validate-all / verify: a fresh machine compiles ~20 layer shapes' task tables (~5 s each, cold) before the suite's
    # ~60 s; the first run gets 400 s, later ones find the caches warm.
    validate-all) timeout 420 python3 -m weave_moe.validate --suite all --stress-calls 1000 --stall --bad-ids --out "$W/validate-all.json" --timeout 400 > "$W/validate-all.log" 2>&1; grep -vE "^PASS" "$W/validate-all.log" | tail -30;;
    validate-stall) timeout 90 python3 -m weave_moe.validate --suite none --stall --out "$W/validate-stall.json" --timeout 80 2>&1 | tail -5;;
    calibrate) timeout 300 python3 -m weave_moe.cli calibrate --measure --timeline-dir "$W/calib" --out "$W/h200_measured.json" --report "$W/calibrate-report.json" 2>&1 | tail -30;;
    sweep) timeout 210 python3 -m weave_moe.cli bench --models qwen3-30b-a3b,deepseek-v2-lite,phi-3.5-moe,deepseek-v2 --tokens 1024,2048,4096,8192 --routing uniform --variants "$SWEEP_VARIANTS" --iters 10 --no-breakdown --no-progress --name ck-sweep --out "$W" --timeout 200 2>&1 | tail -5;;
    attention) timeout 300 python3 -m weave_moe.cli bench --tokens 2048,4096,8192 --routing uniform --variants nccl,weave:serial,weave --iters 10 --no-breakdown --attention --no-progress --name e2e-attention --out "$W" --timeout 280 2>&1 | tail -5;;
    bench) timeout 330 python3 -m weave_moe.cli bench --tokens 128,512,2048,4096,8192 --check --iters 20 --no-progress --name "${BENCH_NAME:-h200x2-eval}" --out "$W" --timeout 320 2>&1 | tail -5;;
    diag-edge) timeout 75 python3 -m weave_moe.validate --suite edge --trace 50 --out "$W/diag-edge.json" --timeout 70 > "$W/diag-edge.log" 2>&1; echo "rc=$?"; grep -vE "^PASS" "$W/diag-edge.log" | tail -40;;
    diag-edge-eager) WEAVE_MOE_CUDA_GRAPH=0 timeout 75 python3 -m weave_moe.validate --suite edge --trace 50 --out "$W/diag-edge-eager.json" --timeout 70 > "$W/diag-edge-eager.log" 2>&1; echo "rc=$?"; grep -vE "^PASS|^\[rank" "$W/diag-edge-eager.log" | tail -25;;
    diag-stress) timeout 65 python3 -m weave_moe.validate --suite quick --stress-calls 300 --stall --trace 40 --out "$W/diag-stress.json" --timeout 60 > "$W/diag-stress.log" 2>&1; echo "rc=$?"; grep -vE "^PASS" "$W/diag-stress.log" | tail -40;;
    stall-repeat) for i in 1 2; do timeout 45 python3 -m weave_moe.validate --suite none --stall --out "$W/validate-stall-$i.json" --timeout 40 2>&1 | tail -2; done;;
    verify) for i in 1 2 3; do t=$([ $i = 1 ] && echo 400 || echo 150); timeout $((t + 10)) python3 -m weave_moe.validate --suite all --stress-calls 1000 --stall --bad-ids --out "$W/validate-all-$i.json" --timeout $t > "$W/verify-$i.log" 2>&1; grep -vE "^PASS" "$W/verify-$i.log" | tail -4; done;;
    ab) # A/B of kernel configs (AB_CONFIGS="none tma=0 compile_layout=0 fused_serial=1 ..."; none = the defaults, which
        # since bb8bd82 include tma=1 and compile_layout=1; config names with "=" come back renamed by the device tool,
        # so read them from results.tar.gz): GPU correctness of
        # serial / a chunked split / weave with the config, then the same bench for each, side by side with nccl.
        # ~1.5-2.5 min per config (a compiled layout adds a compile per shape): four configs may need two calls.
        for cfg in ${AB_CONFIGS:-none tma=0 compile_layout=0 fused_serial=1}; do
          kc=$([ "$cfg" = none ] && echo "" || echo "$cfg")
          WEAVE_MOE_KERNEL_CONFIG=$kc timeout 200 python3 -m weave_moe.validate --suite quick --variants weave:serial,weave:static:20,4,weave --out "$W/validate-ab-$cfg.json" --timeout 190 2>&1 | tail -1
          WEAVE_MOE_KERNEL_CONFIG=$kc timeout 250 python3 -m weave_moe.cli bench --models "${AB_MODELS:-qwen3-30b-a3b,deepseek-v2-lite,deepseek-v3}" --tokens 2048,8192 --routing uniform --variants nccl,weave:serial,weave --iters 10 --no-breakdown --no-progress --name "ab-$cfg" --out "$W" --timeout 240 2>&1 | tail -4
        done;;
    profile) # where a call's time goes: torch.profiler CUDA/CPU tables + per-step times, default (compiled) vs eager layout
        for cfg in none compile_layout=0; do
          kc=$([ "$cfg" = none ] && echo "" || echo "$cfg")
          WEAVE_MOE_KERNEL_CONFIG=$kc timeout 200 python3 scripts/profile_layer.py --model qwen3-30b-a3b --tokens 2048 --variants weave:serial,nccl --rows 40 > "$W/profile-$cfg.txt" 2>&1
          grep -E "^#####|ms per call by step" "$W/profile-$cfg.txt" | cut -c1-300
        done;;
    # the device-resident call (KernelConfig.resident): its own checks, then the validation suites and the bench with it
    resident) timeout "${RESIDENT_TIMEOUT:-400}" python3 scripts/resident_check.py --out "$W/resident_check${RESIDENT_CHECKS:+-$RESIDENT_CHECKS}.json" --calls "${RESIDENT_CALLS:-10000}" --checks "${RESIDENT_CHECKS:-}" > "$W/resident_check${RESIDENT_CHECKS:+-$RESIDENT_CHECKS}.log" 2>&1; echo "rc=$?"; grep -E "^FAIL|resident check|Error" "$W/resident_check${RESIDENT_CHECKS:+-$RESIDENT_CHECKS}.log" | cut -c1-400 | tail -20;;
    resident-validate) WEAVE_MOE_KERNEL_CONFIG=resident=on timeout 300 python3 -m weave_moe.validate --suite quick --nproc 1 --out "$W/validate-quick-resident.json" --timeout 280 > "$W/validate-quick-resident.log" 2>&1; echo "rc=$?"; grep -vE "^PASS" "$W/validate-quick-resident.log" | tail -12
        WEAVE_MOE_KERNEL_CONFIG=resident=on timeout 250 python3 -m weave_moe.validate --suite edge --stress-calls 300 --nproc 1 --out "$W/validate-edge-resident.json" --timeout 240 > "$W/validate-edge-resident.log" 2>&1; echo "rc=$?"; grep -vE "^PASS" "$W/validate-edge-resident.log" | tail -12;;
    # RB_CONFIG: more KernelConfig settings for both modes (e.g. stage_ctas_rows=16); BENCH names stay resident-<mode>
    resident-bench) for mode in ${RB_MODES:-on off}; do
          models=$([ $mode = on ] && echo "${RB_MODELS:-qwen3-30b-a3b,deepseek-v3}" || echo "${RB_MODELS_OFF:-qwen3-30b-a3b}")
          tokens=$([ $mode = on ] && echo "${RB_TOKENS:-1,32,512,2048}" || echo "${RB_TOKENS_OFF:-32,2048}")
          WEAVE_MOE_KERNEL_CONFIG=resident=$mode${RB_CONFIG:+,$RB_CONFIG} timeout "${RB_TIMEOUT:-280}" python3 -m weave_moe.bench --emulate-ep 2 --models "$models" --tokens "$tokens" --routing uniform --variants nccl,weave:serial,weave --check --iters 20 --no-progress --timeout $(( ${RB_TIMEOUT:-280} - 10 )) --name "resident-$mode" --out "$W" > "$W/bench-resident-$mode.log" 2>&1; echo "rc=$?"; tail -22 "$W/bench-resident-$mode.log"
        done;;
    exchange-check) timeout "${XCHK_TIMEOUT:-150}" python3 scripts/routing_exchange_check.py --out "$W/routing_exchange_check.json" > "$W/routing_exchange_check.log" 2>&1; echo "rc=$?"; tail -15 "$W/routing_exchange_check.log" | cut -c1-300;;
    resident-profile) for t in ${RP_TOKENS:-1 2048}; do
          WEAVE_MOE_KERNEL_CONFIG=resident=on timeout 150 python3 scripts/profile_layer.py --nproc 1 --emulate-ep 2 --model "${RP_MODEL:-qwen3-30b-a3b}" --tokens $t --variants "${RP_VARIANTS:-weave:serial,weave}" --rows 45 > "$W/profile-resident${RP_MODEL:+-$RP_MODEL}-$t.txt" 2>&1; echo "rc=$?"
          grep -E "^#####|Self CUDA time total|Self CPU time total" "$W/profile-resident${RP_MODEL:+-$RP_MODEL}-$t.txt" | cut -c1-200
        done;;
    # the counts kernel (kernels/counts.py) bitwise against CountsFormat.build + verdict, and timed
    counts-check) timeout "${CC_TIMEOUT:-200}" python3 scripts/counts_check.py --out "$W/counts_check.json" > "$W/counts_check.log" 2>&1; echo "rc=$?"; tail -12 "$W/counts_check.log" | cut -c1-300;;
    # A/B of KernelConfig.wide_gemm0 (the megakernel's GEMM0 as one wide MMA): the default policy where its plans run
    # the megakernel's own tiles (WA_TOKENS), off then on, --check on every row; results wide-off.* / wide-on.*
    wide-ab) for wide in off on; do
          WEAVE_MOE_KERNEL_CONFIG=wide_gemm0=$wide timeout "${WA_TIMEOUT:-200}" python3 -m weave_moe.bench --emulate-ep 2 --models "${WA_MODELS:-qwen3-30b-a3b,deepseek-v3,phi-3.5-moe}" --tokens "${WA_TOKENS:-1,32,512}" --routing uniform --variants weave,weave:serial --check --iters 20 --no-progress --timeout $(( ${WA_TIMEOUT:-200} - 10 )) --name "wide-$wide" --out "$W" > "$W/bench-wide-$wide.log" 2>&1; echo "rc=$?"; tail -12 "$W/bench-wide-$wide.log"
        done;;
    # two GPUs. DeepEP from its public source (scripts/build_deepep.sh; DEEPEP_SRC: a checkout carried to the machine,
    # default .deepep/DeepEP, a folder .git/info/exclude ignores: `carry: [".deepep"]`)
    # (~90 s; the wheel stays in DEEPEP_WHEELS on that machine: a later stage of a warm machine reinstalls it)
    deepep-build) timeout "${DEEPEP_TIMEOUT:-300}" bash scripts/build_deepep.sh "${DEEPEP_SRC:-.deepep/DeepEP}" "${DEEPEP_WHEELS:-.deepep/wheels}" > "$W/deepep-build.log" 2>&1; echo "rc=$?"; tail -3 "$W/deepep-build.log";;
    # the EP=2 record, over several calls. ep2-validate: validate quick at EP=2 for the baselines deepep and symm (each in
    # its own processes; deepep needs deepep-build first), then for the weave policies with the host-driven and the
    # resident call (EP2_VAL_TIMEOUT each). ep2-failures: the failure suite (stall, bad ids, sequence), resident call.
    ep2-validate) for v in ${EP2_VAL_BASELINES-deepep symm}; do
          timeout 100 python3 -m weave_moe.validate --suite quick --nproc 2 --variants $v --out "$W/validate-quick-ep2-$v.json" --timeout 90 > "$W/validate-quick-ep2-$v.log" 2>&1; echo "$v rc=$?"; grep -vE "^PASS" "$W/validate-quick-ep2-$v.log" | tail -4
        done
        for mode in ${EP2_VAL_MODES:-off on}; do
          WEAVE_MOE_KERNEL_CONFIG=resident=$mode timeout "${EP2_VAL_TIMEOUT:-170}" python3 -m weave_moe.validate --suite quick --nproc 2 $([ "$mode" = on ] && echo "${EP2_VAL_ARGS---graph-capture 20}") --trace "${EP2_TRACE:-120}" --out "$W/validate-quick-ep2-resident-$mode.json" --timeout $(( ${EP2_VAL_TIMEOUT:-170} - 10 )) > "$W/validate-quick-ep2-resident-$mode.log" 2>&1; echo "resident=$mode rc=$?"; grep -vE "^PASS" "$W/validate-quick-ep2-resident-$mode.log" | tail -6
        done;;
    # the resident call at EP=2, state per rank and call with no collective after a call (scripts/resident_ep2_probe.py)
    ep2-probe) timeout "${EP2_PROBE_TIMEOUT:-200}" python3 scripts/resident_ep2_probe.py --out "$W/resident_ep2_probe.json" --timeout $(( ${EP2_PROBE_TIMEOUT:-200} - 10 )) > "$W/resident_ep2_probe.log" 2>&1; echo "rc=$?"; cut -c1-700 "$W/resident_ep2_probe.log" | tail -20;;
    # the EP=2 protocol on ONE GPU: two processes on cuda:0 over a gloo group, kernels time-shared (correctness only)
    shared-probe) timeout "${SP_TIMEOUT:-200}" python3 scripts/resident_ep2_probe.py --shared-gpu --out "$W/resident_ep2_probe_shared.json" --timeout $(( ${SP_TIMEOUT:-200} - 10 )) > "$W/resident_ep2_probe_shared.log" 2>&1; echo "rc=$?"; cut -c1-600 "$W/resident_ep2_probe_shared.log" | tail -24;;
    shared-validate) WEAVE_MOE_KERNEL_CONFIG=resident=${SV_RESIDENT:-on}${SV_KC:+,$SV_KC} timeout "${SV_TIMEOUT:-200}" python3 -m weave_moe.validate --shared-gpu --suite "${SV_SUITE:-quick}" --variants "${SV_VARIANTS:-weave:serial,weave:static:20,weave}" ${SV_ARGS:-} --nproc 2 --trace "${SV_TRACE:-120}" --out "$W/validate-shared-${SV_RESIDENT:-on}.json" --timeout $(( ${SV_TIMEOUT:-200} - 10 )) > "$W/validate-shared-${SV_RESIDENT:-on}.log" 2>&1; echo "rc=$?"; grep -vE "^PASS" "$W/validate-shared-${SV_RESIDENT:-on}.log" | cut -c1-400 | tail -14;;
    # KernelConfig.pair_peers (the paired call at EP > 1) on two ranks sharing one GPU: the edge suite with the
    # serial policy (layers of T_max <= pair_tokens are paired: (0, 512), (1, 1), (300, 129), (64, 128)), bad ids,
    # graph capture and a stalled peer on serial layers; then the quick suite's cases. Correctness only.
    peers-validate) WEAVE_MOE_KERNEL_CONFIG=resident=on,pair_peers=on timeout "${PV_TIMEOUT:-300}" python3 -m weave_moe.validate --shared-gpu --suite edge --variants weave:serial --bad-ids --graph-capture 20 --stall --policy serial --nproc 2 --trace 120 --out "$W/validate-peers-edge.json" --timeout $(( ${PV_TIMEOUT:-300} - 10 )) > "$W/validate-peers-edge.log" 2>&1; echo "rc=$?"; grep -vE "^PASS" "$W/validate-peers-edge.log" | cut -c1-400 | tail -14
        WEAVE_MOE_KERNEL_CONFIG=resident=on,pair_peers=on timeout "${PVQ_TIMEOUT:-200}" python3 -m weave_moe.validate --shared-gpu --suite quick --variants weave:serial,weave --nproc 2 --trace 120 --out "$W/validate-peers-quick.json" --timeout $(( ${PVQ_TIMEOUT:-200} - 10 )) > "$W/validate-peers-quick.log" 2>&1; echo "rc=$?"; grep -vE "^PASS" "$W/validate-peers-quick.log" | cut -c1-400 | tail -14;;
    # two GPUs: KernelConfig.pair_peers against the call with task tables at decode sizes (layers of T_max = the
    # call's tokens, so every call of the pair_peers variant is paired), every row checked
    peers-ep2) EP2_TIMEOUT=${PE_TIMEOUT:-400} EP2_MODELS=${PE_MODELS:-qwen3-30b-a3b,deepseek-v2-lite,deepseek-v3} EP2_TOKENS=${PE_TOKENS:-1,8,32,128,512} EP2_ROUTING=uniform EP2_VARIANTS=nccl,weave:serial,weave:serial@pair_peers=on "$0" ep2-bench;;
    ep2-failures) WEAVE_MOE_KERNEL_CONFIG=resident=${EP2_FAIL_RESIDENT:-on} timeout "${EP2_FAIL_TIMEOUT:-200}" python3 -m weave_moe.validate --suite quick --failures --nproc 2 --trace "${EP2_TRACE:-120}" --out "$W/validate-failures-ep2.json" --timeout $(( ${EP2_FAIL_TIMEOUT:-200} - 10 )) > "$W/validate-failures-ep2.log" 2>&1; echo "failures rc=$?"; grep -vE "^PASS" "$W/validate-failures-ep2.log" | tail -8;;
    # ep2-bench: every baseline (nccl, symm, deepep: run deepep-build first in the same warm machine) and the weave
    # policies side by side at EP=2, --check on all (EP2_TOKENS, EP2_ROUTING, EP2_VARIANTS, EP2_MODELS, EP2_KC: the
    # KernelConfig, e.g. resident=on; partial JSON/CSV survive the timeout)
    ep2-bench) WEAVE_MOE_KERNEL_CONFIG=${EP2_KC:-} timeout "${EP2_TIMEOUT:-420}" python3 -m weave_moe.cli bench --models "${EP2_MODELS:-qwen3-30b-a3b,deepseek-v3,phi-3.5-moe,qwen3.5-35b-a3b,deepseek-v2-lite,deepseek-v2}" --tokens "${EP2_TOKENS:-128,2048,8192}" --routing "${EP2_ROUTING:-uniform,skewed}" --variants "${EP2_VARIANTS:-nccl,symm,deepep,weave:serial,weave}" --check --iters 10 --no-progress --name "${BENCH_NAME:-h200x2-eval6}" --out "$W" --timeout $(( ${EP2_TIMEOUT:-420} - 10 )) > "$W/ep2-bench-${BENCH_NAME:-h200x2-eval6}.log" 2>&1; echo "rc=$?"; tail -30 "$W/ep2-bench-${BENCH_NAME:-h200x2-eval6}.log";;
    # host cost of the primitives a call is made of (scripts/host_primitives.py): run beside host-cost, whose
    # absolute figures vary with the machine's host
    launch-probe) timeout 120 python3 scripts/launch_probe.py --out "$W/launch_probe.json" > "$W/launch_probe.log" 2>&1; echo "rc=$?"; tail -14 "$W/launch_probe.log" | cut -c1-300;;
    # A/B of KernelConfig.decode_stages at decode sizes: per-kernel GPU time (torch.profiler) and the bench, both modes
    decode-ab) for ds in 0 1; do
          WEAVE_MOE_KERNEL_CONFIG=decode_stages=$ds timeout 120 python3 scripts/profile_layer.py --nproc 1 --emulate-ep 2 --model "${DA_MODEL:-qwen3-30b-a3b}" --tokens "${DA_PROFILE_TOKENS:-1}" --variants "${DA_VARIANTS:-weave:serial,weave}" --rows 30 > "$W/profile-decode_stages$ds.txt" 2>&1; echo "profile decode_stages=$ds rc=$?"
          WEAVE_MOE_KERNEL_CONFIG=decode_stages=$ds timeout "${DA_TIMEOUT:-150}" python3 -m weave_moe.bench --emulate-ep 2 --models "${DA_MODELS:-qwen3-30b-a3b,deepseek-v3}" --tokens "${DA_TOKENS:-1,8,32,128}" --routing uniform --variants "${DA_BENCH_VARIANTS:-nccl,weave:serial,weave}" --check --iters 20 --no-progress --timeout $(( ${DA_TIMEOUT:-150} - 10 )) --name "decode-stages$ds" --out "$W" > "$W/bench-decode-stages$ds.log" 2>&1; echo "bench decode_stages=$ds rc=$?"; tail -9 "$W/bench-decode-stages$ds.log"
        done;;
    # A/B of programmatic dependent launch (WEAVE_MOE_PDL, kernels/sync.py) at decode sizes: the bench in both modes,
    # then torch.profiler's per-kernel GPU time with it on
    pdl-ab) for pdl in 0 1; do
          WEAVE_MOE_PDL=$pdl timeout "${PA_TIMEOUT:-90}" python3 -m weave_moe.bench --emulate-ep 2 --models "${PA_MODELS:-qwen3-30b-a3b,deepseek-v3}" --tokens "${PA_TOKENS:-1,32}" --routing uniform --variants "${PA_VARIANTS:-nccl,weave:serial,weave}" --check --iters 20 --no-progress --timeout $(( ${PA_TIMEOUT:-90} - 10 )) --name "pdl$pdl" --out "$W" > "$W/bench-pdl$pdl.log" 2>&1; echo "bench pdl=$pdl rc=$?"; tail -7 "$W/bench-pdl$pdl.log"
        done
        timeout 90 python3 scripts/profile_layer.py --nproc 1 --emulate-ep 2 --model qwen3-30b-a3b --tokens 1 --variants weave:serial,weave --rows 30 > "$W/profile-pdl1.txt" 2>&1; echo "profile rc=$?";;
    # A/B of KernelConfig settings (KA_CONFIGS, space-separated: "none" = the defaults, else key=value,...; results
    # are numbered in that order, config-ab.txt names them): the bench with --check for each, side by side with
    # nccl, then one profiled call per config and KA_PROFILE_TOKENS (its GPU timeline: kernel_timeline). Separate
    # runs drift with the host's load; side by side in one run: KA_VARIANTS="nccl,weave:serial,weave:serial@key=value"
    config-ab) i=0; : > "$W/config-ab.txt"; for cfg in ${KA_CONFIGS:-none}; do i=$((i + 1)); echo "$i $cfg" >> "$W/config-ab.txt"
          kc=$([ "$cfg" = none ] && echo "" || echo "$cfg")
          WEAVE_MOE_KERNEL_CONFIG=$kc timeout "${KA_TIMEOUT:-150}" python3 -m weave_moe.bench --emulate-ep 2 --models "${KA_MODELS:-qwen3-30b-a3b,deepseek-v3}" --tokens "${KA_TOKENS:-1,8,32,2048}" --routing uniform --variants "${KA_VARIANTS:-nccl,weave:serial,weave}" --check --iters 20 --no-progress --timeout $(( ${KA_TIMEOUT:-150} - 10 )) --name "config-ab$i" --out "$W" > "$W/bench-config-ab$i.log" 2>&1; echo "bench $i ($cfg) rc=$?"; tail -14 "$W/bench-config-ab$i.log" | cut -c1-220
          for t in ${KA_PROFILE_TOKENS:-1}; do
            WEAVE_MOE_KERNEL_CONFIG=$kc timeout 100 python3 scripts/profile_layer.py --nproc 1 --emulate-ep 2 --model qwen3-30b-a3b --tokens $t --variants weave:serial --rows 30 > "$W/profile-config-ab$i-$t.txt" 2>&1; echo "profile $i $t rc=$?"; grep -E "^#####.*span" "$W/profile-config-ab$i-$t.txt"
          done
        done;;
    # the task-table kernels alone, per kernel, with and without the serial skip of GEMM task rows (one-off probe)
    tables-probe) timeout "${TP_TIMEOUT:-240}" python3 scripts/tables_probe.py --out "$W/tables_probe.json" > "$W/tables_probe.log" 2>&1; echo "rc=$?"; tail -30 "$W/tables_probe.log" | cut -c1-420;;
    # kernel timelines of one call (scripts/profile_layer.py; KP_VARIANTS, default weave:serial) for each KernelConfig of KP_CONFIGS
    # ("none" = the defaults), model of KP_MODELS and token count of KP_TOKENS; results profile-<i>-<model>-<tokens>.txt,
    # numbered as listed in profile-configs.txt (config names with "=" would come back renamed)
    profile-configs) i=0; : > "$W/profile-configs.txt"; for cfg in ${KP_CONFIGS:-none}; do i=$((i + 1)); echo "$i $cfg" >> "$W/profile-configs.txt"
          kc=$([ "$cfg" = none ] && echo "" || echo "$cfg")
          for model in ${KP_MODELS:-qwen3-30b-a3b}; do for t in ${KP_TOKENS:-1 2048}; do
            WEAVE_MOE_KERNEL_CONFIG=$kc timeout 100 python3 scripts/profile_layer.py --nproc 1 --emulate-ep 2 --model "$model" --tokens $t --variants "${KP_VARIANTS:-weave:serial}" --rows 30 > "$W/profile-$i-$model-$t.txt" 2>&1; echo "profile $i ($cfg) $model $t rc=$?"; grep -E "^#####.*span" "$W/profile-$i-$model-$t.txt"
          done; done
        done;;
    # the bench with each grouped-GEMM table of TA_TABLES (space-separated: "shipped" = the package's table of this
    # device, "off" = the analytical defaults, else a path, e.g. one the tune stage wrote); results numbered as listed
    table-ab) i=0; : > "$W/table-ab.txt"; for tbl in ${TA_TABLES:-shipped off}; do i=$((i + 1)); echo "$i $tbl" >> "$W/table-ab.txt"
          if [ "$tbl" = shipped ]; then unset WEAVE_MOE_TUNED_TABLE; else export WEAVE_MOE_TUNED_TABLE=$tbl; fi
          timeout "${TA_TIMEOUT:-200}" python3 -m weave_moe.bench --emulate-ep 2 --models "${TA_MODELS:-qwen3-30b-a3b,deepseek-v3}" --tokens "${TA_TOKENS:-1,8,32,128,512}" --routing "${TA_ROUTING:-uniform}" --variants "${TA_VARIANTS:-nccl,weave:serial,weave}" --check --iters 20 ${TA_ARGS:-} --no-progress --timeout $(( ${TA_TIMEOUT:-200} - 10 )) --name "table-ab$i" --out "$W" > "$W/bench-table-ab$i.log" 2>&1; echo "bench $i ($tbl) rc=$?"; tail -16 "$W/bench-table-ab$i.log" | cut -c1-220
          for mt in ${TA_PROFILE:-}; do  # model:tokens, weave:serial's kernel timeline with this table
            timeout 100 python3 scripts/profile_layer.py --nproc 1 --emulate-ep 2 --model "${mt%%:*}" --tokens "${mt##*:}" --variants weave:serial --rows 30 > "$W/profile-table-ab$i-${mt%%:*}-${mt##*:}.txt" 2>&1; echo "profile $i $mt rc=$?"; grep -E "^#####.*span" "$W/profile-table-ab$i-${mt%%:*}-${mt##*:}.txt"
          done
        done; unset WEAVE_MOE_TUNED_TABLE;;
    host-primitives) timeout 120 python3 scripts/host_primitives.py --out "$W/host_primitives.json" > "$W/host_primitives.log" 2>&1; echo "rc=$?"; tail -25 "$W/host_primitives.log";;
    # host time of a resident call, piece by piece (scripts/host_cost.py)
    host-cost) timeout "${HC_TIMEOUT:-200}" python3 scripts/host_cost.py --model "${HC_MODEL:-qwen3-30b-a3b}" --tokens "${HC_TOKENS:-1,2048}" ${HC_ARGS:-} --out "$W/host_cost.json" > "$W/host_cost.log" 2>&1; echo "rc=$?"; grep "^{" "$W/host_cost.log" | cut -c1-600;;
    *) echo "unknown stage $stage";;
  esac
  tar czf "$OUT/results.tar.gz" -C "$W" .
done
ls -la "$OUT"
