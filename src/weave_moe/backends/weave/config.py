"""Configuration of the weave backend: the megakernel's tile shapes and switches, and the wait deadline.

`KernelConfig` is frozen; tests and tuning sweeps override it by passing one to the layer (`config=`) or through
WEAVE_MOE_KERNEL_CONFIG="block_n0=128,tma=off". The deadline of every bounded wait comes from the layer option
`timeout_s` or WEAVE_MOE_TIMEOUT_S. Both variables are parsed strictly: an unknown key or a value that is not a number
or a boolean raises an error naming the variable.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

__all__ = ["KernelConfig", "timeout_s_from_env", "DEFAULT_TIMEOUT_S", "KERNEL_CONFIG_ENV", "TIMEOUT_ENV",
           "DECODE_TOKENS", "DECODE_ROWS", "GEMM0_GATHER_MAX_I", "MIN_CAPABILITY",
           "unsupported_device"]

KERNEL_CONFIG_ENV = "WEAVE_MOE_KERNEL_CONFIG"
TIMEOUT_ENV = "WEAVE_MOE_TIMEOUT_S"
#: Deadline of every wait inside the megakernel. A healthy peer's longest wait (its whole GEMM stage at 8192 tokens
#: of DeepSeek-V3, ~15 ms) is far below it; a first call's compile happens before the kernel's waits (see backend.py).
DEFAULT_TIMEOUT_S = 5.0

#: the oldest GPUs the weave backend's kernels run on: Hopper (compute capability 9.0). Every launch of a call waits
#: for the one before through programmatic dependent launch (`griddepcontrol`, sm_90 and newer; kernels/sync.py), and
#: the GEMMs load their weights with the bulk tensor copies (TMA) of sm_90. Tested on H100 and H200.
MIN_CAPABILITY = (9, 0)


def unsupported_device(device) -> str | None:
    """Why the weave backend cannot run on `device` (a torch.device), or None where it can: a CUDA GPU of compute
    capability MIN_CAPABILITY or newer. The message names the device and the backend to use instead."""
    if device.type != "cuda":
        return (f"the weave backend runs on CUDA GPUs only, not on {device.type}; use backend='nccl' or 'reference' "
                f"there")
    import torch

    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        return (f"the weave backend needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
                f"newer (Hopper: its kernels use programmatic dependent launch and TMA); {device} is "
                f"{torch.cuda.get_device_name(device)} ({capability[0]}.{capability[1]}): use backend='nccl' there")
    return None


#: KernelConfig.decode_stages: calls of at most this many tokens per rank use the decode compiles of the launches
#: without GEMM, whose tasks hold DECODE_ROWS rows, copied in steps of `decode_block_h(H)` elements
DECODE_TOKENS = 64
DECODE_ROWS = 1


def decode_block_h(hidden_size: int) -> int:
    """Elements per step of the decode compiles' row tasks: the whole row (a power of two), at most 4096 (a step of
    the combine holds top-k such rows in registers)."""
    return min(4096, 1 << max(hidden_size - 1, 1).bit_length())

#: KernelConfig.chain_pairs chains paired calls of at most this many tokens per rank. Replayed from a caller's CUDA
#: graph on an H100 (docs/perf-notes.md entry 61: Qwen3-30B-A3B, Qwen3.5-35B-A3B, DeepSeek-V2-Lite, one rank's work
#: of EP=2) the chain won at 1 token in all three (44.8 -> 43.7, 39.0 -> 36.6, 51.6 -> 48.2 us) and was mixed at 8
#: tokens (-2.8 to +2.8 us) and 32 (-2.8 to +11.9 us): those calls keep the default chain
CHAIN_PAIRS_MAX_TOKENS = 1
#: the values of the str fields
_CHOICES = {"resident": ("auto", "on", "off"), "gemm0_gather": ("auto", "on", "off"),
            "chain_pairs": ("off", "on", "capture")}
#: KernelConfig.gemm0_gather="auto": GEMM0 reads its rows through the gather rows for intermediate sizes up to this
GEMM0_GATHER_MAX_I = 1024
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes and launch settings of the megakernel.

    Attributes:
        block_m: rows of one local expert per GEMM tile (the planner's profile must use the same; see `check_profile`).
        block_n0: columns of h per GEMM0 tile (gate and up together: 2 * block_n0 output columns).
        block_n1: columns of H per GEMM1 tile.
        block_k, block_k1: K step of GEMM0 (over H) and GEMM1 (over I, often short).
        stages0, stages1: software-pipeline depth of the GEMM0 / GEMM1 K loops.
        dispatch_rows, combine_rows, reduce_rows: rows per dispatch / combine / final-reduce task.
        block_h: hidden elements copied per step by the row-moving tasks.
        num_warps, num_stages: Triton launch settings of the megakernel.
        dot_fp32: fp32 MMA operands (the interpreter's bf16 dot is wrong; tests set it).
        fused_serial: the serial schedule (c = N) as ONE launch, ordered by flags instead of launch boundaries.
            Off: on the H200 pair it measured 1.002x the staged launches (fef48c7, bench/results/ab/summary.json).
        tma: expert weights through the bulk tensor copy engine (host-built descriptors, once per layer); used when
            H and I are multiples of 8 (16-byte rows) and block_n1 >= 256. On: 1.027x faster weave calls on the H200
            pair (geomean of 12 rows, every row faster; fef48c7, bench/results/ab/summary.json).
        compile_layout: the task tables through torch.compile (Inductor fuses the elementwise chains into a few
            kernels), then captured as a CUDA graph. Costs a compile per layer shape and rank on the first call
            (~22 s cold for a fresh process, ~5 s per further shape). On: 1.19x faster weave calls on the H200 pair
            (1.35x at 2048 tokens; fef48c7).
        grouped_gemm: the `serial` policy runs its GEMM stage as two persistent grouped-GEMM launches
            (kernels/grouped_gemm.py: TMA for every operand, one wide MMA over an interleaved w13) instead of the
            megakernel's GEMM tiles; the received rows are first gathered into expert order. Needs H and I multiples
            of 8 and a Hopper GPU; w13 is then held interleaved (gate j, up j neighbours).
        device_plan: every rank's plan computed on the GPU from the counts (kernels/planner.py, one small kernel
            after the counts, read back with them) instead of by the Python planner on the host. Off until measured
            on the GPU (scripts/device_planner_check.py); its choices match the Python planner's up to fp32 near-ties
            (tests/test_device_planner.py).
        fused_planner: the device planner (an adaptive policy's plan, `device_plan` or a resident call) is
            evaluated by the counts kernel's last program, right after it has written the counts vector
            (kernels/counts.py, "Planning in the same launch"), instead of by its own launch after the counts: one
            dependent launch fewer before the task tables. Where that link stood, a resident call of the default
            policy measured ~11 us more than the serial policy's at 1 token (Qwen3-30B-A3B, one rank's work of EP=2,
            81.8 vs 70.7 us; bench/results/h200-de378c8). The counts' last program then plans the EP ranks one after
            another: the planner measured 3.15 us per rank in-kernel and ~4.0 us per launch in a graph (one program
            per rank; 5.6 us for one program planning EP=2; bench/results/eval6-emu-h200-2b24350), so this should
            save ~1 us at EP = 1 and may cost ~1.5 us at EP = 2. Off until measured on the GPU
            (`scripts/device_run.sh fused-planner planner`); the plans are the planner launch's, bit for bit, under
            the interpreter (tests/test_counts.py).
        resident: "auto" (default: on at every EP size), "on" or "off" (the host-driven call, kept for A/B).
            The device-resident call: the host never waits for the GPU. The counts, the checks of every
            rank's header and expert ids, the plan (the device planner, for the adaptive policies) and the task
            tables are device work behind the routing exchange (one CUDA-graph replay at EP = 1), the kernel reads its
            plan from the device, and errors found there surface as named exceptions at the next call or at
            `synchronize()` (the refused call returns NaN rows). The layer can then be captured in a caller's CUDA
            graph after one eager call. Adaptive policies run their kernel as one launch.
        wide_gemm0: the megakernel's GEMM0 tiles as ONE MMA over the tile's 2 * block_n0 interleaved w13 rows (gate j
            next to up j; the accumulator's gate and up columns separated by `tl.split`), as the grouped GEMMs do,
            instead of two MMAs (gate, up). Applies where the layer holds the interleaved w13 (`grouped_gemm` with the
            serial policy or a resident adaptive call). On: where such a call's plan runs the megakernel's tiles it
            measured 1.4-4.7% faster than two MMAs in 9 of 9 configurations on an H200 (three models x 1 / 32 / 512
            tokens, one rank's work of EP=2; bench/results/wide-gemm0-h200-f9bb464/).
        decode_stages: a resident call of at most `decode_tokens` tokens runs its launches without GEMM (dispatch;
            combine + reduce) compiled for one row per task and a whole row per step (`DECODE_ROWS`,
            `decode_block_h`), with task tables cut to match: at decode sizes those launches are chains of dependent
            loads (a task's rows in BLOCK_H-wide steps), not bandwidth, and one row per task spreads the few rows
            over as many CTAs. The launch that may run every phase (an adaptive policy's first) keeps its compile:
            tasks of fewer rows than its blocks are valid for it.
        decode_tokens: the most tokens per rank of a `decode_stages` call (DECODE_TOKENS, 64). Above it a call's
            dispatch, copy by received row and combine tasks hold `dispatch_rows` / `combine_rows` (16) rows, so a
            call of 65-512 tokens has 5-32 of them for 132 SMs (docs/perf-notes.md entry 62: at 128 tokens the
            dispatch launch took 10.0 us and the combine + reduce 17.9 for 4 MB each).
        fork_prologue: a fixed serial plan's grouped-GEMM tile tables (grouped_tiles.fill_tile_tables) are built on a
            side stream beside the dispatch launch, which they do not depend on, instead of after it; the gather of
            the received rows waits for both.
        gemm_early_release: the grouped GEMMs let the next launch's CTAs be scheduled (programmatic dependent
            launch) from their start, as every other kernel does, instead of after their tiles, where the waiting
            CTAs share the SMs with the GEMM's tiles for the whole GEMM (grouped_gemm's module docstring; measured
            neutral in calls, 0.97-1.03x).
        triton_tables: the resident call builds its task tables with three Triton kernels (kernels/tables.py)
            instead of the torch op chain of layout.py (~40 kernels); both give the same entries
            (tests/test_tables.py). The host-driven call always uses layout.py.
        independent_scan: under a fixed plan (no device planner), the first table kernel runs beside the counts
            kernel launched just before it, which writes nothing it reads (`build_layout_triton(independent=)`),
            instead of after it.
        early_scan: with an adaptive policy, the first table kernel (`tables_scan.scan_kernel`) does all its work that
            does not need the chunk counts (the planner's K) beside the launch before it (the planner's, or the
            counts launch with `fused_planner`), which writes nothing else it reads, and waits for it only before
            it reads them (`build_layout_triton(previous_writes="chunks")`); its pairs per (expert, chunk) are then
            counted in a second pass over its token block. Off: it waits first. The adaptive counterpart of
            `independent_scan`, for the link by which the default policy's resident call was ~11 us slower than the
            serial policy's at 1 token (see `fused_planner`). Off until measured on the GPU; the tables are the
            same bit for bit under the interpreter (tests/test_tables.py).
        gemm0_gather: "auto" (default), "on" or "off": the grouped GEMM0 reads its A rows from the receive buffer
            through the layout's gather rows (pointer loads, `grouped_gemm0(gather=)`) instead of a gather launch
            first copying them into expert order for TMA reads: one launch and the rows' copy (2 x rows x H x 2
            bytes) fewer, but A without TMA in every K step. The copy's share of GEMM0 falls as 1 / I, so "auto"
            turns it on for I <= GEMM0_GATHER_MAX_I (`gathers_in_gemm0`). Measured side by side on an H200 (one
            rank's work of EP=2, six models x 1 / 32 / 2048 / 8192 tokens; bench/results/h200-46bbb84, h200-84f1b8b):
            on is 0.91-0.95x the time for I = 512 (Qwen3.5-35B-A3B) at 2048-8192 tokens; for I = 768 (Qwen3-30B-A3B)
            0.95-0.98x at 8192 and 0.94-1.02x at 2048 (mixed between runs); 1.02-1.12x for I >= 1408
            (DeepSeek-V2-Lite, -V2, -V3, Phi-3.5-MoE); within noise at 1-32 tokens.
        grouped_pdl: the grouped GEMMs are launched with programmatic dependent launch, as every other kernel of a
            call is (sync.PDL). Off by default: an ordinary launch, whose CTAs reach the SMs only once the kernel
            before it has ended. Launched programmatically after the gather, a prefill GEMM0 ran 1.4-1.6x its time
            alone (DeepSeek-V2 at 2048 tokens, one rank's work of EP=2: 1432 us in the call, 920 alone or with
            this off; DeepSeek-V3 2570 -> 2331 us; the GEMM1 after it unchanged), for a cause not pinned down (not two
            of its CTAs on one SM: 176 KB of shared memory each). Side by side on an H200 (six models x 1 / 32 / 2048 /
            8192 tokens, bench/results/h200-de378c8): off is 0.963x the serial policy's time in geomean at
            2048-8192 tokens (DeepSeek-V2 2048 0.84x, -V3 2048 0.90x, none slower than 1.001x) and 1.001x at 1-32.
        interleave_w13: a layer that runs grouped GEMMs (`grouped_gemm`) holds w13 re-laid with gate row j next to up
            row j (a copy of it, made by `load_experts`), so that GEMM0 is one wide MMA per K step, in the grouped
            GEMMs and (`wide_gemm0`) the megakernel's tiles. Off: w13 is used as given, with no copy, and GEMM0 runs
            gate and up as two MMAs on the same tiles (the tuned configs with `GemmConfig.interleaved` off; their
            stream-K schedule dropped). For callers that hold the experts' weights themselves, such as the Hugging
            Face integration's per-module layers (weave_moe.hf). The megakernel's wide GEMM0 tiles measured 1.4-4.7%
            faster than two MMAs (`wide_gemm0`); the grouped GEMMs' two-MMA form is unmeasured.
        vector_rows: the row copies of the megakernel (dispatch, combine, reduce) read x and write out and the peers'
            regions with 16-byte vector accesses (their addresses, read from device memory, declared aligned:
            kernels/peers.py, ROW_ALIGNMENT), and the dispatch launch of the serial stages issues a step's loads
            before the previous step's stores (tiles.dispatch_rows PIPELINED). Off: one access per bf16 element and
            steps in series, as before 2323dbc; for A/B (`scripts/device_run.sh vector-rows`), unmeasured on a GPU.
        early_dispatch: a resident call of at most `decode_tokens` tokens dispatches its rows right after the counts
            (and the plan), on a side stream beside the task tables (kernels/early_dispatch.py: each row's slot and
            flag follow from the ids alone), instead of in a launch after the tables, which then runs from its GEMM
            phase on or not at all; the call's GEMMs wait for both. At decode sizes the dispatch launch was one
            ~3.6 us link of the call's chain (Qwen3-30B-A3B at 1 token, one rank's work of EP=2,
            bench/results/h200-39eda33). Needs `decode_stages` and H a multiple of 8. On an H200 (one pass of 5
            calls, bench/results/h200-3ec8976): every check passed and every decode size was faster (Qwen3-30B-A3B
            at 1 token 58.7 -> 53.8 us, DeepSeek-V3 206.9 -> 205.2). Off until the resident check passes with it
            (its run there found the bug of layers under 64 tokens, since fixed) and EP=2 on two GPUs; the rows
            and counters are the torch tables', bit for bit, under the interpreter (tests/test_megakernel_cpu.py).
        dispatch_beside_emit: a resident call that is not a decode call (more than `decode_tokens` tokens, or any
            call without `decode_stages`) dispatches its rows right after the bases kernel of its task tables, on a
            side stream beside the emit (kernels/early_dispatch.py, `tables_dispatch_kernel`: each row's slot from
            the scan's and the bases' entries, a few release atomics per 16-token step), instead of in a launch
            after the emit, which then runs from its GEMM phase on or not at all; the call's GEMMs wait for both.
            At 2048 tokens the dispatch launch's CTAs (one per SM, every register) are resident from the emit's
            start and keep the grouped GEMMs' tile tables, forked beside the emit, off the SMs until they leave:
            DeepSeek-V2, one rank's work of EP=2, emit ends 42.3 us, dispatch 63.8, tile tables 69.4, GEMM0 (after
            the row gather) 115.3 (bench/results/h200-ee75b53). Needs `triton_tables` and H a multiple of 8. Off
            until measured on the GPU; an adaptive plan that splits the SMs then overlaps its GEMMs with the tables,
            not with its dispatch.
        pair_dispatch: at EP = 1 (one GPU, or `--emulate-ep`), a resident decode call of a fixed serial plan (the
            grouped GEMMs) sends its rows right after the counts once per (token, expert) pair, straight to the
            pair's row in expert order in y (kernels/early_dispatch.py, `pair_dispatch_kernel`, which also writes
            each pair's row into a [T, k] table); the grouped GEMMs' tile tables are built beside it from the counts'
            pairs per expert, GEMM0 reads the rows contiguously through TMA, and the combine sums y by the pairs'
            rows (kernels/pair_combine.py): no task tables (scan, bases, emit) and no megakernel launch. The chain
            to GEMM0 becomes pack -> counts -> pair dispatch instead of pack -> counts -> bases -> emit (Qwen3-30B-A3B
            at 1 token: counts end at 8.3 us, emit at 19.2; bench/results/h200-39eda33). Takes the place of
            `early_dispatch` on those calls. Needs top_k <= E_local. At EP > 1 each rank would pick the row layout
            by its own T, which its peers must agree with, so it is used there only by a rule of the layer's
            (`pair_peers`). On since 8019eb3: on an H100
            (bench/results/h100-8019eb3) the resident check passed 21/21 and validate quick 28/28 with it, every
            bench check passed, and it was the fastest serial variant at every size measured (Qwen3-30B-A3B, one
            rank's work of EP=2, at 1 / 8 / 32 tokens 89.0 / 178.8 / 253.4 us -> 77.5 / 166.0 / 243.4; DeepSeek-V3
            288.8 / 1640.5 / 3451.2 -> 279.9 / 1622.1 / 3441.7; 5 rounds).
        pair_tokens: the most tokens per rank a `pair_dispatch` call serves (longer calls make the resident call with
            task tables). Every program of its pair dispatch holds the whole call's ids in registers, so it is meant
            for decode and small batches, not prefill. Above `decode_tokens` the calls longer than that take a pair
            dispatch of their own, compiled for `pair_tokens` tokens (each program walks one contiguous range of the
            pairs, four per step, each expert's rows counted once by a histogram), and the decode calls keep the one
            a layer of `decode_tokens` paired tokens has (each pair's row found by a reduction over the call's ids).
            512 since this default was set (64 before): on an H100 at 36ff1fe (bench/results/h100-36ff1fe, one
            rank's work of EP=2, replayed) the paired calls of 128 / 256 tokens against the call with task tables,
            as a fraction of nccl's time: Qwen3-30B-A3B 0.91 / 0.92 -> 0.83 / 0.87, Qwen3.5-35B-A3B 0.89 / 0.90 ->
            0.83 / 0.87, DeepSeek-V2-Lite 0.89 / 0.91 -> 0.81 / 0.84, DeepSeek-V3 equal (its GEMMs are the call);
            1-32 token calls unchanged (their own class); the resident check 22 / 22 with `pair_tokens=256`. At 512
            the paired call lost there (its combine: 38.7 us on one program per SM); with the combine's grid per
            call (d7d48b9, bench/results/h200-d7d48b9, an H200) it wins at 512 too: Qwen3-30B-A3B 0.84 -> 0.78,
            DeepSeek-V2-Lite 0.93 -> 0.83 (span 225.9 -> 210.6 us, the pair combine 8.3 us).
        pair_programs: programs per SM of the long paired calls' pair dispatch (the class above `decode_tokens`,
            which walks four pairs per step): 1 gives a 512-token call's program ~31 pairs, eight steps of one load
            round trip each (12.2 us on an H200 at d7d48b9 for 16 MB of rows); more programs share the pairs (each
            counts the ids tile once). The decode class's pair dispatch keeps its programs (one per SM at most). Not
            measured above 1.
        pair_peers: `pair_dispatch` at EP > 1, for a layer sized for decode: where the layer's max_tokens_per_rank
            is at most `pair_tokens` (the same on every rank, which `LayerMismatchError` checks, so the ranks agree
            without looking at each other's T, as DeepEP's low-latency buffers are sized by
            num_max_dispatch_tokens_per_rank), every resident call of a fixed serial plan is paired: after the
            routing exchange and the counts, each (token, expert) pair's row goes straight to its row in expert
            order in the destination's receive region (which the workspace then sizes for EP * T_max * top_k rows,
            `attach(recv_rows=)`), the grouped GEMMs read it there, and the combine is
            `pair_combine.PeerPairCombine` (each destination sums its rows of a source's token and sends them, the
            source reduces what its destinations sent) and `copy_status`. No task tables, no megakernel launch.
            Calls never take `chain_pairs`' chain. Off: such a layer's calls make the call with task tables, as
            every EP > 1 call did before. Off by default until two GPUs time it: one rank's work of EP=2 on one GPU
            (an EP = 1 layer, which already runs the paired call) measured the paired call 13-15% faster than the
            call with task tables at 128-256 tokens (docs/perf-notes.md entry 64), but the peer combine's cost at
            EP = 2 is unmeasured.
        chain_pairs: a paired call (`pair_dispatch`) starts its GEMM0's weight loads while its rows are sent: the
            counts launch also writes the grouped GEMMs' tile tables of this rank's experts (no tile-table launch
            beside the pair dispatch, no fork), the pair dispatch is launched programmatically after it, and a
            GEMM0 of the warp-specialised decode form programmatically after the pair dispatch, its producer loading
            its first weight blocks before it waits for the rows (kernels/ws_decode.py, PRELOAD; what `ws_chain` does
            for GEMM1); the pair combine is launched programmatically after GEMM1 (it copies the status words to
            the host in either chain: no `copy_status` kernel at a paired call's end). On an H100 at 1 token
            (Qwen3-30B-A3B, dfac10b's timeline) GEMM0 began at 13.2 us, after the tile-table launch (ending 12.7) and the pair dispatch (12.2);
            its weights stream at the HBM rate from then on. Only calls of at most CHAIN_PAIRS_MAX_TOKENS tokens
            (1) take it. "capture" (default): those made under a caller's CUDA-graph capture (serving engines'
            decode; the host's time per call is then not in the call), eager calls keeping the plain chain (both
            compiled at the first call); "on": every such call; "off": none. Eagerly it loses: on an H100
            (159b784, docs/perf-notes.md entries 53 and 55) its 1-token GPU span was 1.7 us shorter (43.0 against
            44.7: the counts launch took ~3 us more for the tables), but the eager call 6-8 us slower end to end
            (the host's time per call rose). Replayed from a caller's graph it wins at 1 token (entry 61, H100,
            bc11158: 1.1-3.4 us on three models; the resident check's capture case passed with "capture").
        serial_at_ep1: at EP = 1 a resident layer (`resident`) of the adaptive policy ("weave") whose serial plans
            run the grouped GEMMs (`grouped_gemm`, a Hopper GPU) takes the serial plan, fixed when the layer is
            built, and is then the `serial` policy's layer (no planning per call; the paired decode call of
            `pair_dispatch`), if the planner picks the serial plan for balanced routing at 1, 8, 64, ... tokens up
            to T_max (`weave_moe.plan.plans_serial`, with the layer's profile). Nothing crosses GPUs at EP = 1 and a
            split plan runs the megakernel's GEMM tiles, slower than the grouped GEMMs (cost_model A8): with the
            shipped profile the planner picks the serial plan for every workload tried (tests/test_plan.py: seven
            models, 1 to 16384 tokens, uniform and skewed routing, the model's own E and its share at EP 2 / 4 / 8),
            while planning on the device costs each call a launch and gates the others: the default policy measured
            0.83 x nccl against the serial policy's 0.77 at 1-512 tokens, 86.2 against 59.2 us on Qwen3-30B-A3B at
            1 token (one rank's work of EP=2, an H100, bench/results/h100-dfac10b). Off: plan on the device every
            call as an EP > 1 rank does; `weave-moe bench --emulate-ep N` turns it off for its weave variants
            (their rows stand for a rank of EP = N), as do the GPU checks of the device planner.
        ws_gemm: the grouped GEMMs of a layer that runs them (serial plans, paired calls) as the warp-specialised Gluon
            kernels: a TMA producer warp, wgmma consumer warpgroups; kernels/ws_gemm.py from 64 rows per expert on
            (`ws_gemm.default_config`), below that kernels/ws_decode.py with the weights as the MMA's rows
            (`ws_decode.default_config`). GEMM0 then reads its rows in expert order (a gather launch first where
            `gemm0_gather` would have it read the receive buffer). Needs the interleaved w13 (`interleave_w13`) and
            an sm_90 GPU (other GPUs keep the Triton kernels). On: in calls (one rank's work of EP=2, an H100,
            bench/results/h100-167aeb5) the serial policy measured 0.48 against 0.51 x nccl at 1-32 tokens and 0.92
            against 0.95 at 2048 (DeepSeek-V3 / V2, Qwen3.5-35B-A3B), each GEMM alone 0.75-0.96 x the Triton kernel
            where the weights stream (scripts/ws_gemm_probe.py, the `ws-gemm` and `ws-decode` stages).
        ws_gather: with `ws_gemm`, the warp-specialised GEMM0 (kernels/ws_gemm.py, not the decode form) reads the
            received rows through the layout's gather rows itself: its producer warpgroup copies A's rows with
            cp.async while the weights stay on TMA (kernels/ws_ring.py, "Gathered A rows"), so a call makes no
            gather launch and no copy of its rows (2 x rows x H x 2 bytes; the gather launch took 82 of DeepSeek-V2's
            1975 us at 2048 tokens on an H100, bench/results/h100-167aeb5). The Gluon GEMM0 then also runs where the
            Triton one reads the gather rows (`gemm0_gather`), at 64-256 rows per expert as without it
            (gemm_configs.ws_rule). Off: in calls on an H100 (bench/results/h100-5af6fb0, one rank's work of EP=2)
            DeepSeek-V2 / V3 at 2048 tokens 0.973 / 0.984 x without it, a tie at 512 tokens, and where the rule
            then took 128x256x64 tiles through the gather rows above 256 rows per expert, slower (8192 tokens: 1.016
            / 1.127; since dropped); with the band only and the re-tuned table, DeepSeek-V2 at 2048 tokens 1.060
            (bench/results/h100-1eee06e); issue 14's record with and without it, three times each on one host
            (bench/results/h100-f012e48, 24 configurations): geomean 1.004 x without it, DeepSeek-V2 at 2048
            tokens skewed 0.972, Qwen3-30B-A3B and Qwen3.5-35B-A3B at 2048 tokens 1.015-1.034 (10^3 resident calls
            with it checked there).
        ws_chain: with `ws_gemm`, where both GEMMs of a call run the warp-specialised decode form, GEMM1 is launched
            programmatically after GEMM0 (with programmatic dependent launch on: sync.PDL): GEMM0 lets it start as
            soon as each of its CTAs has begun, so GEMM1's CTAs take the SMs that GEMM0's last wave leaves idle and
            load their first weight blocks into their rings before waiting for GEMM0 to end (kernels/ws_ring.py,
            "Chained launches"). Decode calls only (`WeaveBackend._chains`): their GEMM0
            runs 1.45 waves of weight tiles on Qwen3-30B-A3B at 1 token (192 tiles of 64 rows over 132 SMs) and
            their GEMM1 then starts cold. In calls on an H100 (bench/results/h100-5af6fb0, one rank's work of EP=2):
            at 1 token Qwen3-30B-A3B 55.3 -> 53.3 us, DeepSeek-V2 129.0 -> 124.3, -V3 255.3 -> 252.5, 8-32 tokens
            0.99-1.00x; at 2048 tokens (the 64x256x64 kernels chained) DeepSeek-V3 5.16 -> 5.61 ms, hence decode
            only. On: a second host measured Qwen3-30B-A3B at 1 token 68.9 -> 78.6 us (bench/results/h100-1eee06e,
            a 1-token row that spread widely there), a third, 5 rounds, 101.2 -> 91.1 us, DeepSeek-V2 147.6 -> 139.7,
            -V3 279.1 -> 272.2, 8-32 tokens 0.99-1.00x (bench/results/h100-c787491); the resident check with it and
            scatter_rows passed 22 of 22 (1000 calls).
        scatter_rows: where a serial call's GEMM0 reads its rows after the gather launch, that launch copies by
            received row instead of by pair (`grouped_tiles.scatter_rows`): each received row is read once and
            written to its pairs' rows (the combine tables list them), where the gather reads it once per pair
            (k times on one rank's work of EP = 2). At DeepSeek-V3's 8192 tokens the receive buffer (117 MB) does not
            stay in L2, so the gather moves ~1.9 GB and the scatter ~1.1 GB (an estimate: the probe's gather of
            DeepSeek-V2's 49152 rows at 8192 tokens took 344 us for 1.0 GB on an H100, bench/results/h100-5af6fb0);
            where the received rows fit in L2 the two read about the same bytes from memory. On: in calls on an H100
            (bench/results/h100-c787491, one rank's work of EP=2, 3 rounds; call / library GEMMs) at 8192 tokens
            DeepSeek-V3 1.000 -> 0.969, -V2 1.004 -> 0.981, V2-Lite 0.929 -> 0.908, Phi-3.5-MoE 0.993 -> 0.972; at
            2048 tokens a tie on DeepSeek-V3, V2-Lite and Phi-3.5-MoE, DeepSeek-V2 1.147 -> 1.178 (a row that spread
            1.10-1.26 over this week's runs); the resident check with it passed 22 of 22 (1000 calls).
    """

    block_m: int = 128
    block_n0: int = 128
    block_n1: int = 256
    block_k: int = 64
    block_k1: int = 64
    stages0: int = 4
    stages1: int = 4
    dispatch_rows: int = 16
    combine_rows: int = 16
    reduce_rows: int = 16
    block_h: int = 512
    num_warps: int = 8
    num_stages: int = 3
    dot_fp32: bool = False
    fused_serial: bool = False
    tma: bool = True
    compile_layout: bool = True
    grouped_gemm: bool = True
    device_plan: bool = False
    fused_planner: bool = False
    resident: str = "auto"
    triton_tables: bool = True
    decode_stages: bool = True
    decode_tokens: int = DECODE_TOKENS
    wide_gemm0: bool = True
    fork_prologue: bool = True
    gemm_early_release: bool = False
    independent_scan: bool = True
    early_scan: bool = False
    gemm0_gather: str = "auto"
    grouped_pdl: bool = False
    interleave_w13: bool = True
    vector_rows: bool = True
    early_dispatch: bool = False
    dispatch_beside_emit: bool = False
    pair_dispatch: bool = True
    pair_tokens: int = 512
    pair_programs: int = 1
    pair_peers: bool = False
    serial_at_ep1: bool = True
    ws_gemm: bool = True
    ws_gather: bool = False
    ws_chain: bool = True
    chain_pairs: str = "capture"
    scatter_rows: bool = True

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "bool":
                if not isinstance(value, bool):
                    raise TypeError(f"KernelConfig.{field.name} must be a bool, got {value!r}")
            elif field.type == "str":
                if value not in _CHOICES[field.name]:
                    raise ValueError(f"KernelConfig.{field.name} must be one of {', '.join(_CHOICES[field.name])}, "
                                     f"got {value!r}")
            else:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"KernelConfig.{field.name} must be a positive int, got {value!r}")

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Each field's description, from this class's docstring ("Attributes:"; a line may document several
        fields: "block_k, block_k1: ..."), whitespace joined. `weave-moe kernel-config` prints them."""
        docs, names = {}, []
        lines = (cls.__doc__ or "").split("Attributes:", 1)[-1].splitlines()
        for line in lines:
            head = re.match(r"^ {8}([a-z_0-9]+(?:, [a-z_0-9]+)*): (.*)$", line)
            if head:
                names = head.group(1).split(", ")
                for name in names:
                    docs[name] = head.group(2).strip()
            elif line.startswith(" " * 12) and names:
                for name in names:
                    docs[name] += " " + line.strip()
            elif line.strip():
                names = []
        return docs

    def as_text(self) -> str:
        """The fields that differ from the defaults as "key=value,..." (`from_text`'s format: `from_text(c.as_text())`
        equals c; "" for the defaults)."""
        default = type(self)()
        changed = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                   if getattr(self, f.name) != getattr(default, f.name)]
        return ",".join(f"{name}={('on' if value else 'off') if isinstance(value, bool) else value}"
                        for name, value in changed)

    @classmethod
    def from_env(cls) -> "KernelConfig":
        """Defaults, overridden by WEAVE_MOE_KERNEL_CONFIG="key=value,..." (ints; booleans as 1/0, true/false,
        yes/no, on/off). Raises ValueError naming the variable on an unknown key or a malformed value."""
        return cls.from_text(os.environ.get(KERNEL_CONFIG_ENV, ""), KERNEL_CONFIG_ENV)

    @classmethod
    def from_text(cls, text: str, source: str) -> "KernelConfig":
        """Defaults, overridden by "key=value,..." (the format of WEAVE_MOE_KERNEL_CONFIG; a later key wins); errors
        name `source` (where the text came from)."""
        fields = {field.name: field.type for field in dataclasses.fields(cls)}
        values = {}
        for item in filter(None, (part.strip() for part in text.strip().split(","))):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep or key not in fields:
                raise ValueError(f"{source}: {item!r} is not key=value with a key of "
                                 f"{', '.join(fields)}")
            if fields[key] == "str":
                if value.lower() not in _CHOICES[key]:
                    raise ValueError(f"{source}: {key}={value!r} must be one of {'/'.join(_CHOICES[key])}")
                values[key] = value.lower()
            elif fields[key] == "bool":
                if value.lower() not in _TRUE + _FALSE:
                    raise ValueError(f"{source}: {key}={value!r} must be one of {'/'.join(_TRUE)} or "
                                     f"{'/'.join(_FALSE)}")
                values[key] = value.lower() in _TRUE
            else:
                try:
                    values[key] = int(value)
                except ValueError:
                    raise ValueError(f"{source}: {key}={value!r} must be an integer") from None
        return cls(**values)

    def resident_at(self, world_size: int) -> bool:
        """Whether a layer of `world_size` ranks makes the device-resident call (`resident`)."""
        # auto was off at EP > 1 until the resident call's EP = 2 failure was found (a rank-specialised table kernel
        # that did not compile on rank 1, kernels/tables.py); since, validate passes at EP = 2 (two ranks sharing one
        # GPU, bench/results/shared-gpu-ep2-e9a5fca)
        return self.resident in ("on", "auto")

    def chains_pairs(self, captured: bool, tokens: int) -> bool:
        """Whether a paired call of `tokens` tokens takes `chain_pairs`' chain: one of at most CHAIN_PAIRS_MAX_TOKENS
        tokens, made at all ("on") or under a caller's CUDA-graph capture (`captured`) with "capture"; none with
        "off"."""
        return tokens <= CHAIN_PAIRS_MAX_TOKENS and (
            self.chain_pairs == "on" or (captured and self.chain_pairs == "capture"))

    def gathers_in_gemm0(self, intermediate_size: int) -> bool:
        """Whether the grouped GEMM0 of a layer of this intermediate size reads its rows through the gather rows
        (`gemm0_gather`)."""
        if self.gemm0_gather == "auto":
            return intermediate_size <= GEMM0_GATHER_MAX_I
        return self.gemm0_gather == "on"

    def gemm0_gathers(self, intermediate_size: int) -> tuple[str, ...]:
        """The kernels (gemm_configs.KERNELS) whose GEMM0 reads the received rows through the gather rows in a layer
        of this intermediate size, instead of after the gather launch's copy: "triton" where `gathers_in_gemm0`,
        "ws" (the warp-specialised GEMM0, not its decode form) where `ws_gather`."""
        return (("triton", ) if self.gathers_in_gemm0(intermediate_size) else ()) + (("ws", ) if self.ws_gather
                                                                                     else ())

    def check_profile(self, profile) -> None:
        """Raise ValueError unless the planner's HardwareProfile counts tiles of this config's shape: the cost model
        and the kernel must cut the same tiles."""
        ours = (self.block_m, self.block_n0, self.block_n1)
        theirs = (profile.block_m, profile.block_n0, profile.block_n1)
        if ours != theirs:
            raise ValueError(f"HardwareProfile {profile.name!r} has tiles (block_m, block_n0, block_n1) = {theirs} "
                             f"but the kernel runs {ours}; calibrate a profile for this KernelConfig or pass a "
                             f"config that matches")


def timeout_s_from_env(default: float = DEFAULT_TIMEOUT_S) -> float:
    """WEAVE_MOE_TIMEOUT_S as a positive float (seconds), or `default` when unset; ValueError naming it otherwise."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={text!r} must be a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{TIMEOUT_ENV}={text!r} must be a positive, finite number of seconds")
    return value
