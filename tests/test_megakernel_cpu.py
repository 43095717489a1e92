"""The megakernel without a GPU: the whole kernel under TRITON_INTERPRET=1 at EP=1, the serial launches at EP=2
between processes at EP 2-4 (each rank's workspace opened by the others through the ipc transport), and its sm_90
PTX.

Under the interpreter programs run one after another, so only schedules in which no CTA waits for a later CTA can
run: the staged launches (`serial`) and a single launch where every CTA is a comm CTA with an unlimited steal budget
(CTA 0 then does every task in DAG order). That still executes every phase, every task table and every flag of the
real kernel.

Tolerance: the interpreter converts fp32 -> bf16 by truncation (checked: 1 + 3/512 -> 1.0), not round-to-nearest as
the GPU does, so each of the three bf16 roundings (h, y, combine row) costs up to one ulp: we allow 2e-2 here; the GPU
tests hold the project's bound of 1e-2 (`reference.DEFAULT_TOLERANCE`).
"""

import re
import textwrap

import pytest
from interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    r"""
    import dataclasses
    import sys
    import torch
    from weave_moe.backends.weave.launch import NO_DESCRIPTORS, MegakernelArgs, MegakernelConstants, launch
    from weave_moe.backends.weave.layout import build_layout
    from weave_moe.plan import MAX_CHUNKS
    from weave_moe.backends.weave.workspace import SymmetricWorkspace
    from weave_moe.reference import reference_moe

    def run(T, E, k, H, I, K, staged, seed, tma=False, ws=None, resident=False, refuse=False, triton_tables=False,
            interleaved=False, hybrid=None, wide=False):
        torch.manual_seed(seed)
        max_tokens = T + 3
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int() if T else torch.zeros(0, k, dtype=torch.int32)
        if T > 2:
            ids[2, -1] = -1
            ids[1, :] = -1
        w = torch.rand(T, k)
        x = torch.randn(T, H).bfloat16()
        w13 = (torch.randn(E, 2 * I, H) / H ** 0.5).bfloat16()
        w2 = (torch.randn(E, H, I) / I ** 0.5).bfloat16()
        all_ids = torch.full((1, max_tokens, k), -1, dtype=torch.int32)
        all_ids[0, :T] = ids
        all_w = torch.zeros(1, max_tokens, k)
        all_w[0, :T] = w
        bn1 = 32 if tma else 16  # the TMA GEMM1 tile runs as two halves of at least 16 columns
        blocks = dict(block_m=16, block_n0=16, block_n1=bn1, dispatch_rows=4, combine_rows=4, reduce_rows=4)
        if triton_tables:  # the resident call's tables (kernels/tables.py): K from the [EP, 4] plans
            from weave_moe.backends.weave.kernels.tables import build_layout_triton
            plan_rows = torch.tensor([[1, K, 0, 0]], dtype=torch.int32)
            lay = build_layout_triton(all_ids, all_w, torch.tensor([T], dtype=torch.int32), plan_rows[:, 1], 0, E,
                                      hidden_size=H, intermediate_size=I, **blocks)
        else:
            lay = build_layout(all_ids, all_w, torch.tensor([T]), torch.tensor([K]), 0, E, hidden_size=H,
                               intermediate_size=I, **blocks)
        if ws is None:
            ws = SymmetricWorkspace(None, 0, 1, torch.device("cpu")).attach(max_tokens, H)
        assert (ws.max_tokens, ws.hidden_size) == (max_tokens, H)
        # the flag protocol of a shared workspace (workspace.py): this call's parity is clean, and the call zeroes
        # the other parity for the next call, whichever layer makes it
        parity = ws.parity
        flags = ws.flags(parity)
        assert not flags.any(), ("flags of this call's parity must be zero", parity, flags)
        ws.flags(1 - parity).fill_(123)  # what a previous call left there
        ws.flags(1 - parity).zero_()
        pairs = lay.max_pairs
        h = torch.full((pairs, I), float("nan")).bfloat16()
        y = torch.full((pairs, H), float("nan")).bfloat16()
        ctrl = torch.zeros(16 + lay.num_mtiles_bound, dtype=torch.int32)
        status = torch.zeros(4, dtype=torch.int32)
        if refuse:  # a call the verdict refused (sync.py: rejections): the kernel does nothing but poison `out`
            status[:] = torch.tensor([16, 0, 5, 0])
        out = torch.full((max(T, 1), H), 7.0).bfloat16()
        grid = 3
        # the device planner's output row of rank 0: c >= grid is the serial schedule inside the one launch
        plans = torch.tensor([[grid + 4, K, 0, 0]], dtype=torch.int32)
        if hybrid == "split":  # a plan with 1 comm CTA that steals every GEMM tile: CTA 0 does the whole call
            plans = torch.tensor([[1, K, 1 << 30, 0]], dtype=torch.int32)
        # the resident call's x / out addresses and T, read by the kernel (the host's x_ptr, out_ptr and num_tokens
        # arguments are then dummies)
        io = torch.tensor([x.data_ptr() if T else 0, out.data_ptr()], dtype=torch.int64)
        tokens = torch.tensor([T], dtype=torch.int32)
        dummy = torch.zeros(1, H).bfloat16()
        # (STAGE, PHASE_FIRST, PHASE_LAST) per launch: staged=True is the serial policy's launches (each compiled for
        # its stage: dispatch, GEMMs, combine + reduce), "phases" each phase through the runtime bounds of the
        # one-launch compile
        stages = ([(0, 0, 3), (1, 0, 3), (4, 0, 3)] if staged is True else [(-1, s, s) for s in range(4)]
                  if staged == "phases" else [(-1, 0, 3)])
        if hybrid:  # GROUPED_SERIAL: the first launch, the GEMMs (here the kernel's own GEMM stage standing in for the
            #         grouped GEMMs), then combine + reduce, which run only under a serial plan
            stages = [((-1, True), 0, 3), ((1, False), 0, 3), ((4, True), 0, 3)]
        descs = NO_DESCRIPTORS
        w13_kernel = w13
        if interleaved:  # the grouped GEMMs' layout, read by the kernel's GEMM0 tiles (W13_INTERLEAVED)
            from weave_moe.backends.weave.kernels.grouped_gemm import interleave_w13
            w13_kernel = interleave_w13(w13)
        if tma:
            from triton.tools.tensor_descriptor import TensorDescriptor as TD
            descs = dict(w13_desc=TD.from_tensor(w13_kernel.view(E * 2 * I, H), [32, 16]) if wide
                         else TD.from_tensor(w13_kernel.view(E * I, 2, H), [16, 1, 16]) if interleaved
                         else TD.from_tensor(w13.view(E * 2 * I, H), [16, 16]),
                         w2_desc=TD.from_tensor(w2.view(E * H, I), [bn1 // 2, 16]))
        constants = MegakernelConstants(
            TOP_K=k, MAX_CHUNKS=MAX_CHUNKS, BLOCK_M=16, BLOCK_N0=16, BLOCK_N1=bn1, BLOCK_K=16, DISPATCH_ROWS=4,
            COMBINE_ROWS=4, REDUCE_ROWS=4, BLOCK_H=32, DOT_FP32=True, TIMELINE=False, MAX_EVENTS=1, STAGES0=3,
            STAGES1=4, BLOCK_K1=16, USE_TMA=tma, RESIDENT=resident, W13_INTERLEAVED=interleaved, WIDE_GEMM0=wide)
        for launch_index, (stage, first, last) in enumerate(stages):
            stage, grouped_serial = stage if isinstance(stage, tuple) else (stage, False)
            args = MegakernelArgs(
                x_ptr=dummy if resident else x if T else out, out_ptr=dummy if resident else out, w13_ptr=w13_kernel, w2_ptr=w2, recv_ptr=ws.recv(), h_ptr=h, y_ptr=y,
                comb_ptr=ws.comb(parity), peer_base_ptr=ws.peer_bases, recv_offset=ws.recv_offset,
                comb_offset=ws.comb_offsets[parity], flags_offset=ws.flags_offsets[parity], arrival_ptr=flags,
                comb_flag_ptr=ws.comb_flags(parity), ctrl_ptr=ctrl, status_ptr=status, meta_ptr=lay.meta,
                plan_ptr=plans, io_ptr=io, tokens_ptr=tokens, timeline_ptr=torch.zeros(1, dtype=torch.int64), dispatch_tasks_ptr=lay.dispatch_tasks,
                send_token_ptr=lay.send_token, send_slot_ptr=lay.send_slot, gemm_tasks_ptr=lay.gemm_tasks,
                gather_ptr=lay.gather_rows, arrival_expected_ptr=lay.arrival_expected,
                gemm1_expected_ptr=lay.gemm1_expected, combine_tasks_ptr=lay.combine_tasks,
                combine_token_ptr=lay.combine_token, combine_pos_ptr=lay.combine_pos,
                combine_weight_ptr=lay.combine_weight, token_mask_ptr=lay.token_dest_mask,
                combine_expected_ptr=lay.combine_expected, rank=0, world_size=1, max_tokens=max_tokens,
                num_tokens=0 if resident else T, H=H, I=I, num_comm_ctas=1 if resident else grid,
                num_steal=0 if resident else 1 << 30, timeout_ns=10 ** 9,
                PHASE_FIRST=first, PHASE_LAST=last)
            # as the backend launches it (the interpreter ignores the launch options)
            launch(grid, args, dataclasses.replace(constants, STAGE=stage, GROUPED_SERIAL=grouped_serial), descs,
                   num_warps=8, num_stages=3)
            if hybrid == "serial" and launch_index == 0 and not refuse:  # the dispatch only
                assert int(ctrl[1]) == 0 and (out == 7.0).all(), "a serial plan's first launch must only dispatch"
        if refuse:
            assert status.tolist() == [16, 0, 5, 0], status
            assert not flags.any() and not ctrl.any(), "a refused call must not run a task"
            assert out[:T].isnan().all(), "a refused call's output must be NaN"
            return
        assert status.tolist() == [0, 0, 0, 0], status
        # every flag reached its expectation
        assert torch.equal(flags[:MAX_CHUNKS], lay.arrival_expected[0]), (flags, lay.arrival_expected)
        assert int(flags[MAX_CHUNKS]) == int(lay.combine_expected[0])
        ws.finish_call()
        if T == 0:
            return
        out = out[:T]
        ref = reference_moe(x, ids, w, w13, w2)
        assert not out.isnan().any(), "unwritten output rows"
        if T > 2:
            assert torch.all(out[1] == 0), "a token with no expert must get a zero row"
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 2e-2, err
        # dispatch is bitwise: the receive buffer holds x's rows
        recv = ws.recv()
        sent = int(lay.combine_expected.sum())  # rows sent; the entries past them are padding
        assert torch.equal(recv[lay.send_slot[:sent].long()].view(torch.int16),
                           x[lay.send_token[:sent].long()].view(torch.int16))

    for case in [(9, 4, 2, 40, 24, 2, True), (9, 4, 2, 40, 24, 3, False), (21, 8, 3, 33, 20, 4, False),
                 (1, 4, 2, 16, 16, 1, False), (0, 4, 2, 16, 16, 1, True), (17, 2, 2, 48, 16, 8, True),
                 (1, 4, 2, 16, 16, 1, True)]:
        run(*case, seed=sum(case))
    run(9, 4, 2, 40, 24, 2, "phases", seed=82)
    # the TMA tiles (KernelConfig.tma) through the whole kernel; H and I multiples of 8 (16-byte strides)
    for case in [(9, 4, 2, 40, 24, 2, True), (17, 2, 2, 48, 16, 8, False), (21, 8, 3, 40, 24, 4, False)]:
        run(*case, seed=sum(case), tma=True)
    # the resident call: c, n_steal, x, out and T from the device. The host's arguments say c = 1, no stealing (which
    # could not finish under the interpreter), dummy x / out and T = 0; the plan row's c >= grid makes it the serial
    # schedule, and the rows land in the real out
    run(9, 4, 2, 40, 24, 2, False, seed=5, resident=True)
    # the interleaved w13 (pointer and TMA tiles), and the resident adaptive call that runs a serial device plan's
    # GEMMs between stage launches (GROUPED_SERIAL): serial plan, another plan, a refused call
    run(9, 4, 2, 40, 24, 2, True, seed=9, interleaved=True)
    run(17, 2, 2, 48, 16, 8, False, seed=10, interleaved=True, tma=True)
    run(9, 4, 2, 40, 24, 1, False, seed=11, resident=True, interleaved=True, hybrid="serial")
    run(21, 8, 3, 40, 24, 1, False, seed=12, resident=True, interleaved=True, tma=True, hybrid="serial")
    run(9, 4, 2, 40, 24, 2, False, seed=13, resident=True, interleaved=True, hybrid="split")
    run(9, 4, 2, 40, 24, 1, False, seed=14, resident=True, hybrid="serial", refuse=True)
    # GEMM0 as one MMA over the interleaved rows (KernelConfig.wide_gemm0), pointer and TMA tiles
    run(9, 4, 2, 40, 24, 2, True, seed=15, interleaved=True, wide=True)
    run(21, 8, 3, 40, 24, 4, False, seed=16, interleaved=True, wide=True, tma=True)
    # the whole kernel on the Triton task tables
    run(21, 8, 3, 33, 20, 4, False, seed=7, resident=True, triton_tables=True)
    run(17, 2, 2, 48, 16, 8, True, seed=8, triton_tables=True)
    run(9, 4, 2, 40, 24, 2, False, seed=6, refuse=True)
    run(9, 4, 2, 40, 24, 2, True, seed=6, refuse=True, resident=True)
    # two layers of different sizes share one workspace (as every layer of a model does): the second attach grows
    # it and re-points the first layer's views; calls alternate the workspace's parity across layers
    shared = SymmetricWorkspace(None, 0, 1, torch.device("cpu"))
    small = shared.attach(5 + 3, 16)
    large = shared.attach(11 + 3, 40)
    assert shared.generation == 2 and small.generation == 2
    assert small.recv().data_ptr() == large.recv().data_ptr() == shared.buffer.data_ptr() + shared.recv_offset
    for case, view in [((5, 4, 2, 16, 16, 2, False), small), ((11, 4, 3, 40, 24, 3, False), large),
                       ((5, 4, 2, 16, 16, 1, False), small)]:
        run(*case, seed=sum(case), ws=view)
    assert shared.calls == 3
    print("MEGAKERNEL INTERPRETER OK")
    """
)


def test_megakernel_under_interpreter():
    run_interpreted(SCRIPT, "MEGAKERNEL INTERPRETER OK")


#: the default KernelConfig's constants at top-k 8
SM90_CONSTANTS = dict(TOP_K=8, MAX_CHUNKS=8, BLOCK_M=128, BLOCK_N0=128, BLOCK_N1=256, STAGES0=4, BLOCK_K=64,
                      DISPATCH_ROWS=16, COMBINE_ROWS=16, REDUCE_ROWS=16, BLOCK_H=512, DOT_FP32=False, TIMELINE=False,
                      MAX_EVENTS=1)


@pytest.fixture(scope="module")
def ptx():
    from weave_moe.backends.weave.launch import compile_ptx

    return compile_ptx(SM90_CONSTANTS)


def _has_release_add(ptx: str, scope: str) -> bool:
    """A release-ordered global add at `scope` ("sys" or "gpu"), in either form Triton emits: `atom` (Triton 3.6) or
    `red` (later Triton, when the old value is unused; same ordering), with the modifiers in any order."""
    for match in re.finditer(r"\b(?:atom|red)((?:\.[a-z0-9_:]+)+)", ptx):
        if {"global", scope, "release", "add"} <= set(match.group(1).split(".")):
            return True
    return False


@pytest.mark.parametrize("text, scope, found", [
    ("atom.global.sys.release.add.u32 %r1, [%rd1], 1;", "sys", True),
    ("red.global.sys.release.add.u32 [%rd1], 1;", "sys", True),
    ("red.release.gpu.global.add.u32 [%rd1], 1;", "gpu", True),
    ("atom.global.sys.relaxed.add.u32 %r1, [%rd1], 1;", "sys", False),
    ("red.global.gpu.release.add.u32 [%rd1], 1;", "sys", False),
])
def test_release_add_accepts_both_forms(text, scope, found):
    assert _has_release_add(text, scope) is found


def test_megakernel_ptx_has_the_memory_ordering_it_relies_on(ptx):
    # peers' flags: release adds (dispatch arrival, combine rows) and acquire polls at system scope
    assert _has_release_add(ptx, "sys")
    assert re.search(r"ld\.global\.sys\.acquire", ptx)
    # same-GPU flags (GEMM0 -> GEMM1 -> combine): release adds and acquire polls at GPU scope
    assert _has_release_add(ptx, "gpu")
    assert re.search(r"ld\.global\.gpu\.acquire", ptx)
    # bounded waits read the global timer; the timeout report uses a CAS on the status word
    assert "%globaltimer" in ptx
    assert re.search(r"atom\.global\.[a-z.]*cas", ptx)


def test_megakernel_spin_loops_steer_on_cta_uniform_values(ptx):
    """A per-thread load that decides whether a CTA leaves a spin loop splits its warps when the value changes
    between two warps' loads; the warps that stay then wait forever in the next poll's bar.sync (seen on the H200
    pair with a stalled peer). The status word is read with atomics (broadcast to the CTA), never a volatile load,
    and the clock through a CTA-wide reduction."""
    assert "ld.volatile" not in ptx
    timer = ptx.index("%globaltimer")
    window = ptx[timer:timer + 20000]
    assert "shfl.sync.bfly" in window and "bar.sync" in window  # the CTA-wide max right after the clock reads


def test_megakernel_ptx_with_tma_tiles_uses_the_bulk_tensor_copy_engine():
    from weave_moe.backends.weave.launch import compile_ptx

    # with the timeline on, so that its wait/work stamps compile for sm_90 too (the interpreter has no %globaltimer)
    ptx = compile_ptx(dict(SM90_CONSTANTS, TIMELINE=True, MAX_EVENTS=2048, USE_TMA=True))
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx


def test_megakernel_ptx_with_wide_gemm0_has_one_n256_mma_per_k_step():
    """KernelConfig.wide_gemm0: GEMM0 as m64n256 wgmma (BLOCK_N0 = 128 gate-up pairs per MMA) beside GEMM1's n128
    halves, weights through 2-D bulk tensor loads, no local memory in the PTX."""
    from weave_moe.backends.weave.launch import compile_ptx

    ptx = compile_ptx(dict(SM90_CONSTANTS, USE_TMA=True, W13_INTERLEAVED=True, WIDE_GEMM0=True))
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx))
    assert shapes == {"128", "256"}, shapes
    assert "cp.async.bulk.tensor.2d" in ptx and ".local" not in ptx


def test_megakernel_ptx_of_the_resident_grouped_serial_launches():
    """The resident adaptive call's compiles (GROUPED_SERIAL, the interleaved w13 through a 3-D descriptor): the first
    launch keeps the TMA GEMM tiles, with 3-D bulk tensor loads; the combine + reduce launch has no GEMM code; the
    first uses no local memory (the combine + reduce launch spills a few registers: test below)."""
    from weave_moe.backends.weave.launch import compile_ptx

    base = dict(SM90_CONSTANTS, USE_TMA=True, RESIDENT=True, W13_INTERLEAVED=True, GROUPED_SERIAL=True)
    first = compile_ptx(dict(base, STAGE=-1))
    assert "cp.async.bulk.tensor.3d" in first and "wgmma.mma_async" in first and ".local" not in first
    ptx = compile_ptx(dict(base, STAGE=4))
    assert "wgmma" not in ptx and "cp.async.bulk.tensor" not in ptx and ".local" not in ptx


def test_megakernel_ptx_uses_hopper_tensor_cores(ptx):
    assert "wgmma.mma_async" in ptx


def _cubin_resources(compiled) -> dict:
    """REG (registers per thread) and STACK (bytes of stack frame per thread) of the cubin Triton built, as
    `cuobjdump -res-usage` reports them (Triton's own cuobjdump)."""
    import subprocess
    import tempfile

    from triton import knobs

    try:
        tool = knobs.nvidia.cuobjdump.path
    except Exception as error:  # noqa: BLE001 - a Triton build without the NVIDIA tools
        pytest.skip(f"no cuobjdump in this Triton: {error}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK):(\d+)", report)}


@pytest.fixture(scope="module")
def stage_kernels():
    """The sm_90 compiles of the one-launch kernel (STAGE -1) and of each serial stage, with the TMA tiles on (the
    default KernelConfig)."""
    from weave_moe.backends.weave.launch import compile_sm

    return {stage: compile_sm(dict(SM90_CONSTANTS, USE_TMA=True, STAGE=stage)) for stage in (-1, 0, 1, 2, 3, 4)}


def test_serial_stage_kernels_compile_only_their_stage(stage_kernels):
    """The serial policy's dispatch and combine + reduce launches (STAGE 0, 4; and 2, 3 alone) compile none of the
    GEMM phase: no wgmma, no TMA, none of its shared memory, and far fewer registers. Registers and spills are read
    from the cubin (`_cubin_resources`); the PTX declares no `.local` array, so a stack frame there holds register
    spills.

    Measured with Triton 3.6 on `compile_sm`'s unspecialised compiles (REG / STACK bytes / dynamic shared bytes): the
    one-launch kernel 255 / 136 / 147520 (248 bytes of stack before GEMM0's epilogue addressed its rows from the
    tile's first, tiles._rows_of), STAGE 0 244 / 0 / 4, STAGE 2 255 / 40 / 64, STAGE 3 206 / 0 / 64, STAGE 4
    255 / 40 / 64. As launched the stacks are smaller and the rows move in 16-byte vectors (STAGE 0: 83 registers,
    STAGE 4: 221, none spilled; test_megakernel_as_launched_on_sm90). The combine stage's registers are its own
    tile's (combine_rows: TOP_K gathers of COMBINE_ROWS x BLOCK_H in flight at once), not the GEMM's.
    """
    full = stage_kernels[-1]
    full_ptx, full_resources = full.asm["ptx"], _cubin_resources(full)
    tensor_map_param = r"\.param \.align 64 \.b8 \w+\[128\]"  # a host-built TMA descriptor (CUtensorMap)
    assert "wgmma.mma_async" in full_ptx and "cp.async.bulk.tensor" in full_ptx
    assert re.search(tensor_map_param, full_ptx)
    assert full.metadata.shared > 64 * 1024 and full_resources["STACK"] > 0
    gemm = stage_kernels[1]  # the GEMM stage keeps its tiles and descriptors
    assert "wgmma.mma_async" in gemm.asm["ptx"] and "cp.async.bulk.tensor" in gemm.asm["ptx"]
    for stage in (0, 2, 3, 4):
        compiled = stage_kernels[stage]
        ptx, resources = compiled.asm["ptx"], _cubin_resources(compiled)
        assert "wgmma" not in ptx and "cp.async" not in ptx and not re.search(tensor_map_param, ptx), stage
        assert ".local" not in ptx, stage
        assert compiled.metadata.shared <= 1024, (stage, compiled.metadata.shared)
        assert len(ptx) < len(full_ptx) / 2, stage
        if stage in (2, 4):  # the combine tile's own pressure: a few spilled registers (today's figure; the compiles
            #                 as launched spill none, test_megakernel_as_launched_on_sm90)
            assert resources["STACK"] <= 40, resources
        elif stage in (0, 3):  # unspecialised, their two steps (dispatch) or ranks (reduce) of rows in flight are
            #                   per-element loads, each with its own address: registers are read as launched
            #                   (test_megakernel_as_launched_on_sm90)
            assert resources["STACK"] == 0, (stage, resources)
        else:
            assert resources["STACK"] == 0 and resources["REG"] <= full_resources["REG"] * 0.6, (stage, resources)
    # each stage kept the ordering of its flags: dispatch and combine release onto peers' flags, reduce waits on the
    # peers' combine flags; only the one-launch kernel's combine waits on this GPU's GEMM1 counters (a combine launch
    # starts after the GEMM launches have ended: no acquire of them on its chain)
    assert _has_release_add(stage_kernels[0].asm["ptx"], "sys")
    # the dispatch-only launch also waits (system scope) until the peers' rows have arrived before it ends: the grouped
    # GEMMs' row gather after it reads them unguarded (a wrong answer at EP=2 on an H200 pair until fba7568)
    # (its flags polled as one vector of atomics, sync.wait_all_at_least: an acquire add of 0 at system scope)
    assert re.search(r"ld\.global\.sys\.acquire|atom\.global\.sys\.acquire\.add", stage_kernels[0].asm["ptx"])
    assert _has_release_add(stage_kernels[2].asm["ptx"], "sys")
    assert not re.search(r"ld\.global\.gpu\.acquire", stage_kernels[2].asm["ptx"])
    assert re.search(r"ld\.global\.gpu\.acquire", full_ptx)
    # (the reduce polls every destination's flag at once, sync.wait_all_at_least: acquire adds of 0 at system scope)
    acquire_sys = r"ld\.global\.sys\.acquire|atom\.global\.sys\.acquire\.add"
    assert re.search(acquire_sys, stage_kernels[3].asm["ptx"])
    # the combine + reduce launch does both
    combine_reduce = stage_kernels[4].asm["ptx"]
    assert _has_release_add(combine_reduce, "sys") and not re.search(r"ld\.global\.gpu\.acquire", combine_reduce)
    assert re.search(acquire_sys, combine_reduce)


def _as_launched(stage_key, interleaved: bool, resident: bool, H: int = 2048, cfg=None):
    """The sm_90 compile of one of the backend's launches (`stage_constants` key) for `cfg` (default: the default
    KernelConfig) at the
    per-rank shape of Qwen3-30B-A3B at EP 2 (H 2048, I 768, T_max 2048), specialised exactly as the launch is:
    16-byte-aligned pointers (as every torch allocation), H / I / max_tokens as passed, the backend's TMA descriptors.
    The pointer arguments are small stand-ins (two experts' weights: E_local is not part of the compile): only their
    alignment and dtype reach it."""
    import dataclasses

    import torch

    from weave_moe.backends.weave.backend import stage_constants
    from weave_moe.backends.weave.config import KernelConfig
    from weave_moe.backends.weave.launch import (MegakernelArgs, MegakernelConstants, compile_as_launched,
                                                 tma_descriptors)

    cfg, E, I = cfg or KernelConfig(), 2, 768
    constants = stage_constants(MegakernelConstants.from_config(cfg, 8, 8, 0, True, resident=resident,
                                                                interleaved=interleaved), H)[stage_key]
    w13, w2 = torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, I, dtype=torch.bfloat16)
    pointers = {f.name: (w13 if f.name == "w13_ptr" else w2 if f.name == "w2_ptr" else
                         torch.zeros(64, dtype={"*i32": torch.int32, "*i64": torch.int64, "*fp32": torch.float32,
                                                "*bf16": torch.bfloat16}[f.metadata["type"]]))
                for f in dataclasses.fields(MegakernelArgs) if f.metadata["type"].startswith("*")}
    args = MegakernelArgs(**pointers, recv_offset=1 << 20, comb_offset=1 << 24, flags_offset=1 << 26, rank=0,
                          world_size=2, max_tokens=2048, num_tokens=2048, H=H, I=I, num_comm_ctas=20, num_steal=0,
                          timeout_ns=10 ** 10, PHASE_FIRST=0, PHASE_LAST=3)
    return compile_as_launched(args, constants, tma_descriptors(cfg, constants, w13, w2), cfg.num_warps,
                               cfg.num_stages)


@pytest.mark.parametrize("name, stage_key, interleaved, resident, max_stack, H", [
    # the default policy's resident call: the one launch that runs any split plan (and a serial plan's dispatch)
    ("resident one-launch", (-1, "grouped serial"), True, True, 16, 2048),
    # ... and its combine + reduce launch under a serial plan
    ("resident combine + reduce", (4, "grouped serial"), True, True, 0, 2048),
    # ... at decode sizes (KernelConfig.decode_stages: one row per task, whole rows of 2048 / 4096-wide steps)
    ("resident decode combine + reduce", ("decode", (4, "grouped serial")), True, True, 0, 2048),
    ("resident decode combine + reduce, H 7168", ("decode", (4, "grouped serial")), True, True, 0, 7168),
    # the fixed serial policy's dispatch and combine + reduce launches at decode sizes
    ("serial decode dispatch", ("decode", 0), True, True, 0, 2048),
    # ... and at prefill sizes (the dispatch's steps pipelined: tiles.dispatch_rows PIPELINED; the combine + reduce
    # spilled at 128 registers before its compile allowed more, launch.MAXNREG)
    ("serial dispatch", 0, True, True, 0, 2048),
    ("serial combine + reduce", 4, True, True, 0, 2048),
    ("serial decode combine + reduce", ("decode", 4), True, True, 0, 7168),
    # the host-driven call (EP > 1 by default): the one-launch kernel on the plain w13
    ("host-driven one-launch", -1, False, False, 0, 2048),
])
def test_megakernel_as_launched_on_sm90(name, stage_key, interleaved, resident, max_stack, H):
    """The kernels that run, compiled as launched (`compile_as_launched`), not `compile_sm`'s unspecialised variant:
    their registers, stack and shared memory. Measured with Triton 3.6 (REG / STACK bytes / shared KB): resident
    one-launch 255 / 16 / 192, resident combine + reduce 221 / 0 / 8, host-driven one-launch 255 / 0 / 192 (40
    bytes of stack before GEMM0's epilogue addressed its rows from the tile's first row, tiles._rows_of)
    (`compile_sm`, unspecialised: 255 / 136 / 144 and 255 / 40 / 0). Spills are register spills (no `.local`
    array in the PTX); the bounds are today's figures, so a change that spills more fails here. Not yet met: no
    spills at all in the GEMM path: the resident one-launch kernel keeps four loop-invariant words, set at its start
    from its plan and arguments, on the stack (sm_90 SASS: stored once, reloaded a few times per phase or tile).
    The launches without GEMM move rows with 16-byte vector accesses, not one access per bf16 element: x and out
    through their addresses in `io` and the peers' regions through `peer_base` are declared aligned
    (peers.ROW_ALIGNMENT), which the compiler cannot infer from an address loaded from memory."""
    compiled = _as_launched(stage_key, interleaved, resident, H)
    resources, ptx = _cubin_resources(compiled), compiled.asm["ptx"]
    assert ".local" not in ptx, name
    # programmatic dependent launch: the kernel waits for its predecessor before anything else (sync.pdl_enter)
    assert "griddepcontrol.wait" in ptx and ptx.index("griddepcontrol.wait") < ptx.index("ld.global"), name
    assert resources["STACK"] <= max_stack, (name, resources)
    assert compiled.metadata.shared <= 227 * 1024, (name, compiled.metadata.shared)
    gemm = stage_key in (-1, (-1, "grouped serial"))
    assert ("wgmma.mma_async" in ptx) == gemm, name
    if not gemm:
        assert not re.search(r"(ld|st)\.global\.b16", ptx), (name, "a row copied one element per access")
        assert re.search(r"st\.global\.v4", ptx), (name, "no 16-byte vector store")
    if gemm:  # the weights by TMA, GEMM0 as one m64n256 MMA where the w13 is interleaved (KernelConfig.wide_gemm0)
        assert "cp.async.bulk.tensor" in ptx
        shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx))
        assert shapes == ({"128", "256"} if interleaved else {"128"}), (name, shapes)


def test_decode_combine_prefetches_its_row_before_its_task_row():
    """The decode combine (one row per task: task j is row j, megakernel.ONE_ROW_TASKS) starts its row's token, pair
    positions and weights into L1 before it loads its task row, whose source the destination's address needs first;
    the launches of tasks of several rows do not. Every launch without GEMM prefetches the peers' bases (one line, a
    second past 16 ranks), which a row task reads right after its task row."""
    decode = _as_launched(("decode", 4), True, True).asm["ptx"]
    # the peers' bases' lines (every launch without GEMM: below) and the row's three lines
    assert decode.count("prefetch.global.L1") == 2 + 3
    assert decode.index("griddepcontrol.wait") < decode.index("prefetch.global.L1")
    for stage_key in (4, ("decode", 0), 0):
        assert _as_launched(stage_key, True, True).asm["ptx"].count("prefetch.global.L1") == 2, stage_key
    # the one-launch kernel (GEMM tiles) prefetches nothing
    assert "prefetch.global" not in _as_launched(-1, True, True).asm["ptx"]


@pytest.mark.parametrize("stage_key", [0, ("decode", 0), (4, "grouped serial")])
def test_vector_rows_off_keeps_the_element_copies_for_ab(stage_key):
    """KernelConfig.vector_rows off compiles the row copies as before it (one access per bf16 element), so that a
    benchmark can run both side by side; on (the default), 16-byte vectors (test_megakernel_as_launched_on_sm90)."""
    from weave_moe.backends.weave.config import KernelConfig

    ptx = _as_launched(stage_key, True, True, cfg=KernelConfig(vector_rows=False)).asm["ptx"]
    assert re.search(r"st\.global\.b16", ptx) and not re.search(r"st\.global\.v4", ptx), stage_key


def _workspace_args(ws, parity: int) -> dict:
    """The megakernel arguments that come from a WorkspaceView (as backend.py's `_launch` passes them)."""
    return dict(recv_ptr=ws.recv(), comb_ptr=ws.comb(parity), peer_base_ptr=ws.peer_bases, recv_offset=ws.recv_offset,
                comb_offset=ws.comb_offsets[parity], flags_offset=ws.flags_offsets[parity],
                arrival_ptr=ws.flags(parity), comb_flag_ptr=ws.comb_flags(parity))


def _table_args(lay) -> dict:
    """The megakernel arguments that come from the task tables (layout.Layout)."""
    return dict(meta_ptr=lay.meta, dispatch_tasks_ptr=lay.dispatch_tasks, send_token_ptr=lay.send_token,
                send_slot_ptr=lay.send_slot, gemm_tasks_ptr=lay.gemm_tasks, gather_ptr=lay.gather_rows,
                arrival_expected_ptr=lay.arrival_expected, gemm1_expected_ptr=lay.gemm1_expected,
                combine_tasks_ptr=lay.combine_tasks, combine_token_ptr=lay.combine_token,
                combine_pos_ptr=lay.combine_pos, combine_weight_ptr=lay.combine_weight,
                token_mask_ptr=lay.token_dest_mask, combine_expected_ptr=lay.combine_expected)


def _ep_worker(rank: int, world_size: int, tokens: list, E: int, k: int, H: int, I: int, K: int, seed: int,
                staged: bool = True, decode: bool = False) -> dict:
    """One rank of test_megakernel_across_processes (TRITON_INTERPRET=1 inherited from the test). `decode`: tables
    of one row per task (KernelConfig.decode_stages), the staged launches without GEMM as their decode compiles
    (whole rows per step), the GEMM stage and the one launch of every phase as they are."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from weave_moe.backends.weave.launch import NO_DESCRIPTORS, MegakernelArgs, MegakernelConstants, launch
    from weave_moe.backends.weave.layout import build_layout
    from weave_moe.backends.weave.workspace import SymmetricWorkspace
    from weave_moe.plan import MAX_CHUNKS
    from weave_moe.reference import reference_moe

    max_tokens = max(tokens) + 3
    g = torch.Generator().manual_seed(seed)
    # every rank draws every rank's routing and tokens from one seed: what the routing exchange gives each rank
    all_ids = torch.full((world_size, max_tokens, k), -1, dtype=torch.int32)
    all_w = torch.zeros(world_size, max_tokens, k)
    xs = []
    for source, count in enumerate(tokens):
        if count:
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(count)]).int()
            if count > 2:
                ids[1, :] = -1   # a token with no expert
                ids[2, -1] = -1
            all_ids[source, :count] = ids
        all_w[source, :count] = torch.rand(count, k, generator=g)
        xs.append(torch.randn(count, H, generator=g).bfloat16())
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    local = E // world_size
    T, x = tokens[rank], xs[rank]
    rows = 1 if decode else 4
    blocks = dict(block_m=16, block_n0=16, block_n1=16, dispatch_rows=rows, combine_rows=rows, reduce_rows=rows)
    lay = build_layout(all_ids, all_w, torch.tensor(tokens), torch.tensor([K] * world_size), rank, E, hidden_size=H,
                       intermediate_size=I, **blocks)
    ws = SymmetricWorkspace(dist.group.WORLD, rank, world_size, torch.device("cpu")).attach(max_tokens, H)
    parity = ws.parity
    flags = ws.flags(parity)
    h = torch.full((lay.max_pairs, I), float("nan")).bfloat16()
    y = torch.full((lay.max_pairs, H), float("nan")).bfloat16()
    ctrl = torch.zeros(16 + lay.num_mtiles_bound, dtype=torch.int32)
    status = torch.zeros(4, dtype=torch.int32)
    out = torch.full((max(T, 1), H), 7.0).bfloat16()
    grid = 3
    constants = MegakernelConstants(
        TOP_K=k, MAX_CHUNKS=MAX_CHUNKS, BLOCK_M=16, BLOCK_N0=16, BLOCK_N1=16, BLOCK_K=16, DISPATCH_ROWS=4,
        COMBINE_ROWS=4, REDUCE_ROWS=4, BLOCK_H=32, DOT_FP32=True, TIMELINE=False, MAX_EVENTS=1, STAGES0=3, STAGES1=4,
        BLOCK_K1=16, USE_TMA=False, RESIDENT=False)
    dist.barrier()
    # the serial policy's launches (dispatch, GEMMs, combine + reduce), or the one launch of every phase (all CTAs
    # comm CTAs with an unlimited steal budget: CTA 0 claims every task in DAG order, module docstring)
    for stage in ((0, 1, 4) if staged else (-1,)):
        args = MegakernelArgs(
            x_ptr=x if T else out, out_ptr=out, w13_ptr=w13[rank * local:(rank + 1) * local],
            w2_ptr=w2[rank * local:(rank + 1) * local], h_ptr=h, y_ptr=y, ctrl_ptr=ctrl, status_ptr=status,
            plan_ptr=torch.tensor([[grid, K, 0, 0]] * world_size, dtype=torch.int32),
            io_ptr=torch.zeros(2, dtype=torch.int64), tokens_ptr=torch.tensor([T], dtype=torch.int32),
            timeline_ptr=torch.zeros(1, dtype=torch.int64), **_workspace_args(ws, parity), **_table_args(lay),
            rank=rank, world_size=world_size, max_tokens=max_tokens,
            num_tokens=T, H=H, I=I, num_comm_ctas=grid, num_steal=1 << 30, timeout_ns=10 ** 9,
            PHASE_FIRST=0, PHASE_LAST=3)
        compile_ = dataclasses.replace(constants, STAGE=stage)
        if decode and stage in (0, 4):
            from weave_moe.backends.weave.config import DECODE_ROWS, decode_block_h

            compile_ = dataclasses.replace(compile_, DISPATCH_ROWS=DECODE_ROWS, COMBINE_ROWS=DECODE_ROWS,
                                           REDUCE_ROWS=DECODE_ROWS, BLOCK_H=decode_block_h(H))
        launch(grid, args, compile_, NO_DESCRIPTORS, num_warps=8, num_stages=3)
    dist.barrier()   # no rank frees its buffers while a peer may still write them
    ref = reference_moe(x, all_ids[rank, :T], all_w[rank, :T], w13, w2) if T else None
    # dispatch is bitwise: source s's tokens with an expert on this rank, in token order, from row s * T_max on
    owner = torch.where(all_ids >= 0, all_ids // local, -1)
    recv_ok = all(
        torch.equal(ws.recv()[s * max_tokens: s * max_tokens + int(hit.sum())].view(torch.int16),
                    xs[s][hit[:tokens[s]]].view(torch.int16))
        for s in range(world_size) for hit in [(owner[s] == rank).any(dim=1)])
    return dict(status=status.tolist(), unwritten=bool(out[:T].isnan().any()) or bool((out[:T] == 7.0).all(1).any()),
                error=float(((out[:T].float() - ref.float()).norm() / ref.float().norm())) if T else 0.0,
                arrivals=torch.equal(flags[:world_size * MAX_CHUNKS].view(world_size, MAX_CHUNKS),
                                     lay.arrival_expected.view(world_size, MAX_CHUNKS)),
                combines=flags[world_size * MAX_CHUNKS:].tolist() == lay.combine_expected.view(-1).tolist(),
                recv_ok=recv_ok)


@pytest.mark.parametrize("tokens, E, k, H, I, K, staged, decode", [
    ([9, 6], 4, 2, 40, 24, 1, True, False), ([5, 0], 8, 3, 33, 20, 2, True, False),
    ([1, 12], 4, 2, 16, 16, 3, True, False), ([9, 6], 4, 2, 40, 24, 2, False, False),
    ([0, 7], 8, 3, 33, 20, 4, False, False), ([6, 0, 9], 6, 2, 24, 16, 2, True, False),
    ([5, 7, 0, 3], 8, 3, 24, 16, 1, True, False), ([4, 6, 2, 0], 8, 2, 24, 16, 2, False, False),
    # decode calls (KernelConfig.decode_stages): one-row tasks, the launches without GEMM compiled for them; the one
    # launch of every phase on such tables (its blocks of 4 rows hold tasks of 1)
    ([6, 3], 4, 2, 40, 24, 1, True, True), ([2, 0, 5], 6, 3, 33, 16, 2, True, True),
    ([5, 4], 4, 2, 40, 24, 2, False, True)])
def test_megakernel_across_processes(monkeypatch, tokens, E, k, H, I, K, staged, decode):
    """The serial policy's launches, and the one launch of every phase with K chunks, at EP 2, 3 and 4 between real
    processes: each rank's workspace opened by the others
    through the ipc transport (shared memory on the CPU), the kernels under the interpreter, both ranks at once.
    Rows go to the peer's receive buffer (checked bitwise), arrivals and combine rows come back through the peer's
    flags, the dispatch launch waits for every peer's rows before it ends; every output row matches the reference
    (2e-2: the interpreter's bf16 rounding, module docstring)."""
    from weave_moe.testing import run_distributed

    monkeypatch.setenv("TRITON_INTERPRET", "1")   # inherited by the spawned ranks, before they import triton
    results = run_distributed(_ep_worker, len(tokens), tokens, E, k, H, I, K, sum(tokens) + E, staged, decode,
                              backend="gloo",
                              timeout_s=600,
                              env=dict(TRITON_INTERPRET="1"), shared_device=True)
    for rank, result in enumerate(results):
        assert result["status"] == [0, 0, 0, 0], (rank, result)
        assert result["arrivals"] and result["combines"] and result["recv_ok"], (rank, result)
        assert not result["unwritten"] and result["error"] < 2e-2, (rank, result)


def _call_inputs(call: int, rank: int, T: int, E: int, k: int, H: int) -> tuple:
    """(ids, weights, x) of `rank` in call `call` of `_resident_worker`: every rank can make any rank's."""
    import torch

    cg = torch.Generator().manual_seed(100 * call + rank)
    ids = torch.stack([torch.randperm(E, generator=cg)[:k] for _ in range(T)]).int() if T else \
        torch.zeros(0, k, dtype=torch.int32)
    weights = torch.rand(T, k, generator=cg)
    x = torch.randn(T, H, generator=cg).bfloat16()
    return ids, weights, x


def _check_dispatched(ws, all_ids, all_tokens, plans, rank: int, E: int, call: int, H: int) -> None:
    """The receive rows and arrival counters after `EarlyDispatch`, bitwise against the torch tables
    (`layout.build_layout`): every row owed to this rank is its source's x row at its slot, and each (source, chunk)
    counter holds the rows owed from it."""
    import torch

    from weave_moe.backends.weave.exchange import hit_matrix
    from weave_moe.backends.weave.layout import build_layout
    from weave_moe.plan import MAX_CHUNKS

    world_size, max_tokens, k = all_ids.shape
    ref = build_layout(all_ids, torch.zeros(all_ids.shape), all_tokens, plans[:, 1], rank, E, hidden_size=H,
                       intermediate_size=16, block_m=16, block_n0=16, block_n1=16, dispatch_rows=1, combine_rows=1,
                       reduce_rows=1)
    assert torch.equal(ws.flags(0)[:world_size * MAX_CHUNKS].view(world_size, MAX_CHUNKS), ref.arrival_expected), \
        (rank, ws.flags(0).tolist(), ref.arrival_expected.tolist())
    hit = hit_matrix(all_ids, E // world_size)          # [EP, T_max, EP]: token t of source s goes to rank d
    recv = ws.recv()
    for source in range(world_size):
        T = int(all_tokens[source])
        _, _, x = _call_inputs(call, source, T, E, k, H)
        slot = 0
        for t in range(T):
            if hit[source, t, rank]:
                row = recv[source * max_tokens + slot]
                assert torch.equal(row.view(torch.int16), x[t].view(torch.int16)), (rank, source, t, slot)
                slot += 1
        assert recv[source * max_tokens + slot:(source + 1) * max_tokens].isnan().all(), (rank, source, slot)


def _resident_worker(rank: int, world_size: int, calls: list, stall: tuple | None = None,
                     slots: bool = False, decode: bool = False, plan_in_counts: bool = False,
                     early_dispatch: str = "", dies_before_dispatch: tuple | None = None) -> list:
    """One rank of test_resident_call_sequence_across_processes: the device-resident call's launches in
    the backend's order (WeaveBackend._forward_resident, _resident_tables, _launch), without the CUDA graph.
    `slots`: the pack as an eager call makes it (CallSlots: the arguments through a ring of two slots, which the
    calls wrap), else as a captured call makes it (`pack_call`, the arguments in the launch). `decode`: the tables
    of a decode call (one row per task, KernelConfig.decode_stages) into the layer's persistent counters, as the
    backend builds them (`_resident_tables`), read by the one-launch kernel of 4-row blocks. `plan_in_counts`: the
    plan is not the layer's but written by the counts launch (KernelConfig.fused_planner, with a device planner of
    the serial policy on a profile of `grid` SMs), read by the tables after their early scan (`early_scan`) and by
    the kernel. `early_dispatch`: the rows dispatched beside the tables, "counts": by `EarlyDispatch` right after
    the counts, "bases": by `TablesDispatch` right after the bases kernel (`build_layout_triton(beside_emit=)`)
    (receive rows and arrival counters checked bitwise against the torch tables: every row owed here, each at its
    slot, in a receive region poisoned before the call), and the kernel from its GEMM phase on (PHASE_FIRST 1);
    "mixed": even ranks as "counts", odd ranks as "bases" (a decode call on some ranks, a longer one on others: the
    senders must agree on the rows' slots and counts).
    `dies_before_dispatch` (rank, call), with `early_dispatch`: that rank makes the call's exchange and counts, then
    stops before its dispatch."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from weave_moe.backends.coordination import HEADER_WORDS
    from weave_moe.backends.weave.exchange import CallSlots, CountsFormat, RoutingMessage
    from weave_moe.backends.weave.kernels import sync
    from weave_moe.backends.weave.kernels.counts import DeviceCounts
    from weave_moe.backends.weave.kernels.routing_exchange import exchange_routing
    from weave_moe.backends.weave.kernels.tables import TableBuffers, build_layout_triton, counter_words
    from weave_moe.backends.weave.launch import NO_DESCRIPTORS, MegakernelArgs, MegakernelConstants, launch
    from weave_moe.backends.weave.workspace import SymmetricWorkspace
    from weave_moe.plan import MAX_CHUNKS
    from weave_moe.reference import reference_moe

    E, k, H, I, max_tokens, grid = 4, 2, 40, 24, 12, 3
    local = E // world_size
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    message = RoutingMessage(max_tokens, k)
    planner = None
    if plan_in_counts:
        from weave_moe.backends.weave.kernels.planner import DevicePlanner
        from weave_moe.models import MoESpec
        from weave_moe.plan import HardwareProfile

        profile = HardwareProfile(name="tiny", source="test", num_sms=grid, comm_sms=[1, 2], comm_gbps=[9, 18],
                                  local_sms=[1, grid], local_gbps=[30, 90], gemm_sms=[1, grid],
                                  gemm_tflops=[4.0, 12.0], gemm_tile_efficiency=0.7, block_m=16, block_n0=16,
                                  block_n1=16, launch_us=3.0, flag_round_trip_us=0.7, role_switch_us=0.4,
                                  per_tile_overhead_us=0.3, call_overhead_us=0.0)
        planner = DevicePlanner(MoESpec(E, k, H, I), world_size, profile, "serial")
    counts = DeviceCounts(CountsFormat(world_size, E, sync.STATUS_WORDS), message, torch.device("cpu"),
                          planner=planner)
    ws = SymmetricWorkspace(dist.group.WORLD, rank, world_size, torch.device("cpu")).attach(
        max_tokens, H, routing_words=message.words)
    send = torch.empty(message.words, dtype=torch.int32)
    all_routing = torch.zeros(world_size, message.words, dtype=torch.int32)
    status = torch.zeros(2 * sync.STATUS_WORDS, dtype=torch.int32)
    header = torch.tensor([77, 0, 0, 0], dtype=torch.int32)[:HEADER_WORDS]   # identity, index, call, code
    io = torch.zeros(2, dtype=torch.int64)
    plans = torch.tensor([[grid, 1, 0, 0]] * world_size, dtype=torch.int32)   # serial, K = 1 (a fixed policy)
    if plan_in_counts:
        plans.fill_(-7)   # written by every call's counts launch before the tables and the kernel read it
    if early_dispatch:   # chunk counts of 2-4, another per rank: each row's flag is its destination's chunk of it
        plans[:, 1] = torch.arange(world_size) % 3 + 2
    h = torch.empty(world_size * max_tokens * k, I).bfloat16()
    y = torch.empty(world_size * max_tokens * k, H).bfloat16()
    constants = MegakernelConstants(
        TOP_K=k, MAX_CHUNKS=MAX_CHUNKS, BLOCK_M=16, BLOCK_N0=16, BLOCK_N1=16, BLOCK_K=16, DISPATCH_ROWS=4,
        COMBINE_ROWS=4, REDUCE_ROWS=4, BLOCK_H=32, DOT_FP32=True, TIMELINE=False, MAX_EVENTS=1, STAGES0=3, STAGES1=4,
        BLOCK_K1=16, USE_TMA=False, RESIDENT=True)
    # the control block, sized from the tables' static bound (as the backend sizes it)
    probe = build_layout_triton(*message.unpack(all_routing), plans[:, 1], rank, E, hidden_size=H, intermediate_size=I,
                                block_m=16, block_n0=16, block_n1=16, dispatch_rows=4, combine_rows=4, reduce_rows=4)
    ctrl = torch.zeros(16 + probe.num_mtiles_bound, dtype=torch.int32)
    ring = CallSlots(message, torch.device("cpu"), num_slots=2)
    mode = ("counts" if rank % 2 == 0 else "bases") if early_dispatch == "mixed" else early_dispatch
    if mode == "counts":
        from weave_moe.backends.weave.kernels.early_dispatch import EarlyDispatch
        early = EarlyDispatch(world_size, E, k, H, max_tokens, max_call_tokens=4, num_programs=grid)   # blocks of 4
    elif mode == "bases":
        from weave_moe.backends.weave.kernels.early_dispatch import TablesDispatch
        # steps of 2 tokens in scan blocks of 4 (block_tokens below): several steps per program and per block, and
        # block bases that are not 0
        early = TablesDispatch(world_size, H, max_tokens, num_programs=2, rows=2)
    block_tokens = 4 if mode == "bases" else None
    rows = 1 if decode else 4
    counters = torch.zeros(counter_words(world_size, E), dtype=torch.int32) if decode else None
    # one set of tables rewritten by every call, as the backend keeps them (tables.TableBuffers)
    buffers = TableBuffers.for_layer(world_size, max_tokens, k, E, hidden_size=H, intermediate_size=I, block_m=16,
                                     block_n0=16, block_n1=16, dispatch_rows=rows, combine_rows=rows,
                                     device=torch.device("cpu"), block_tokens=block_tokens)
    results = []
    dist.barrier()
    for call, (tokens, bad_rank) in enumerate(calls):
        dying = dies_before_dispatch is not None and call == dies_before_dispatch[1]
        stalled_call = stall is not None and call == stall[1] or dying
        if stall is not None and call == stall[1] and rank == stall[0]:
            results.append(dict(status=None, error=None, nan=None))   # this rank never makes the call
            break
        # the waits of a call with a stalled peer end after 2 * 10^4 polls (the interpreter counts 100 ns a poll)
        timeout_ns = 2 * 10**6 if stalled_call else 120 * 10**9
        T = tokens[rank]
        ids, weights, x = _call_inputs(call, rank, T, E, k, H)
        if rank == bad_rank and T:
            ids[0, 0] = E + 3   # an id out of range: every rank's verdict refuses the call
        out = torch.full((max(T, 1), H), float("nan")).bfloat16()
        if early_dispatch:   # no peer writes this call's rows before this rank's routing message leaves (the pack)
            ws.recv().fill_(float("nan"))
        if slots:
            ring.write(x if T else out, out, ids, weights, 0, wait=None)
            ring.launch(send, header, io, status, ctrl, ws.flags(0), E)
        else:
            message.pack_call(send, ids, weights, header, io, x if T else out, out, 0, status, ctrl, ws.flags(0), E)
        exchange_routing(ws, message, send, all_routing, status[:sync.STATUS_WORDS], timeout_ns=timeout_ns, parts=1,
                         block=8)
        counts.build(all_routing, status[:sync.STATUS_WORDS], rank, verdict=True,
                     plans=plans if plan_in_counts else None)
        if plan_in_counts:
            assert plans[:, :3].tolist() == [[grid, 1, 0]] * world_size, plans.tolist()
        all_ids, all_weights, all_tokens = message.unpack(all_routing)
        if dying and rank == dies_before_dispatch[0]:
            results.append(dict(status=None, error=None, nan=None))   # this rank never dispatches
            break

        def dispatch(tables=None):
            if mode == "counts":
                early.launch(all_ids, all_tokens, plans[:, 1], io, ws, status[:sync.STATUS_WORDS], rank,
                             min(timeout_ns, 10 ** 9))
            else:
                early.launch(tables, all_tokens, plans[:, 1], io, ws, status[:sync.STATUS_WORDS], rank,
                             min(timeout_ns, 10 ** 9))
            if dying:   # the rows of the rank that died never arrive
                assert status[0] == sync.ERROR_ARRIVAL_TIMEOUT.value, (rank, status.tolist())
            elif bad_rank is None:
                _check_dispatched(ws, all_ids, all_tokens, plans, rank, E, call, H)
            else:   # refused: nothing sent, nothing waited for
                assert not ws.flags(0)[:world_size * MAX_CHUNKS].any() and ws.recv().isnan().all(), rank

        if mode == "counts":
            dispatch()
        layout = build_layout_triton(all_ids, all_weights, all_tokens, plans[:, 1], rank, E, hidden_size=H,
                                     intermediate_size=I, block_m=16, block_n0=16, block_n1=16, dispatch_rows=rows,
                                     combine_rows=rows, reduce_rows=rows, counters=counters, buffers=buffers,
                                     previous_writes="chunks" if plan_in_counts else "any",
                                     beside_emit=dispatch if mode == "bases" else None,
                                     block_tokens=block_tokens)
        dummy = y[:1]
        args = MegakernelArgs(
            x_ptr=dummy, out_ptr=dummy, w13_ptr=w13[rank * local:(rank + 1) * local],
            w2_ptr=w2[rank * local:(rank + 1) * local], h_ptr=h, y_ptr=y, ctrl_ptr=ctrl,
            status_ptr=status[:sync.STATUS_WORDS], plan_ptr=plans, io_ptr=io,
            tokens_ptr=send[2 * message.id_words:2 * message.id_words + 1],
            timeline_ptr=torch.zeros(1, dtype=torch.int64), **_workspace_args(ws, 0), **_table_args(layout),
            rank=rank, world_size=world_size, max_tokens=max_tokens,
            num_tokens=0, H=H, I=I, num_comm_ctas=1, num_steal=0, timeout_ns=min(timeout_ns, 10 ** 9),
            PHASE_FIRST=1 if early_dispatch else 0, PHASE_LAST=3)
        launch(grid, args, dataclasses.replace(constants, STAGE=-1), NO_DESCRIPTORS, num_warps=8, num_stages=3)
        error = None
        if T and bad_rank is None:
            ref = reference_moe(x, ids, weights, w13, w2)
            error = float((out[:T].float() - ref.float()).norm() / ref.float().norm())
        results.append(dict(status=status.tolist(), error=error, nan=bool(out[:T].isnan().all()) if T else True))
    dist.barrier()   # no rank frees its buffers while a peer may still write them
    return results


@pytest.mark.parametrize("calls, slots, decode, plan_in_counts, early_dispatch", [
    ([([9, 6], None), ([4, 11], None), ([7, 5], 1), ([6, 9], None), ([3, 0], None)], False, False, False, False),
    ([([9, 6], None), ([4, 11], None), ([7, 5], 1), ([6, 9], None), ([3, 0], None)], True, False, False, False),
    ([([9, 6], None), ([4, 11], None), ([7, 5], 1), ([6, 9], None), ([3, 0], None)], True, True, False, False),
    ([([9, 6], None), ([4, 11], None), ([7, 5], 1), ([6, 9], None), ([3, 0], None)], True, False, True, False),
    ([([5, 2, 0, 7], None), ([3, 6, 4, 1], 1), ([2, 5, 6, 0], None)], False, False, False, False),
    ([([1, 1], None), ([4, 11], None), ([7, 5], 1), ([0, 9], None), ([12, 1], None)], True, True, False, "counts"),
    ([([5, 2, 0, 7], None), ([3, 6, 4, 1], 1), ([1, 1, 1, 1], None)], False, True, False, "counts"),
    ([([1, 1], None), ([4, 11], None), ([7, 5], 1), ([0, 9], None), ([12, 10], None)], True, False, False, "bases"),
    ([([5, 2, 0, 7], None), ([3, 6, 4, 1], 1), ([9, 12, 1, 0], None)], False, False, False, "bases"),
    ([([1, 9, 0, 12], None), ([3, 6, 4, 1], 1), ([4, 12, 1, 7], None)], False, False, False, "mixed")],
    ids=["ep2", "ep2-slots", "ep2-slots-decode", "ep2-plan-in-counts", "ep4", "ep2-early-dispatch",
         "ep4-early-dispatch", "ep2-dispatch-beside-emit", "ep4-dispatch-beside-emit", "mixed-dispatches"])
def test_resident_call_sequence_across_processes(monkeypatch, calls, slots, decode, plan_in_counts, early_dispatch):
    """The device-resident call's launches at EP 2 and 4 between real processes (ipc transport on the CPU, kernels
    under the interpreter): pack (with the carried rejection, the zeroed control block and flags, the next call
    number), routing exchange, counts + verdict, task tables, the one-launch kernel reading its plan, T, x and out
    from the device. Calls: two good ones, one where rank 1 sends an id out of range (both ranks refuse it: NaN rows,
    the rejection in the live word), then good ones again, which must be correct on BOTH ranks: the rejection was
    carried out of the live word by the next pack (without that, the refusing ranks' next call did no work). At EP 2
    once with the pack of a captured call (arguments in the launch) and once with an eager call's (CallSlots), and
    with the eager pack once more on a decode call's tables (one-row tasks in the layer's persistent counters, which
    must be zero again after every call, the refused one included); and once with the plan written by each call's
    counts launch (KernelConfig.fused_planner, a serial device plan) and the tables' early scan; and with the rows
    dispatched right after the counts (KernelConfig.early_dispatch, `EarlyDispatch`) at EP 2 and 4, checked bitwise,
    with 2-4 chunks per rank, the kernel starting at its GEMM phase (calls of one token per rank, of none on one
    rank, of all 12 rows of T_max); and with the dispatch beside the emit (after the bases kernel) at EP 2 and 4,
    and at EP 4 with the two dispatches mixed (even ranks after the counts, odd ranks after the bases)."""
    from weave_moe.backends.weave.kernels import sync
    from weave_moe.testing import run_distributed

    monkeypatch.setenv("TRITON_INTERPRET", "1")   # inherited by the spawned ranks, before they import triton
    world_size = len(calls[0][0])
    results = run_distributed(_resident_worker, world_size, calls, None, slots, decode, plan_in_counts, early_dispatch,
                              backend="gloo", timeout_s=600, env=dict(TRITON_INTERPRET="1"), shared_device=True)
    refused = [index for index, (_, bad_rank) in enumerate(calls) if bad_rank is not None]
    for rank in range(world_size):
        for index, ((tokens, bad_rank), got) in enumerate(zip(calls, results[rank])):
            if bad_rank is not None:
                assert got["status"][0] == sync.REJECT_BAD_IDS and got["status"][1] == bad_rank, (rank, index, got)
                assert got["nan"], (rank, index, got)
                continue
            if index - 1 in refused:  # the call after the refused one: the rejection moved to the reported word
                assert got["status"][:4] == [0, 0, 0, 0] and got["status"][4] == sync.REJECT_BAD_IDS, (rank, got)
            else:
                assert got["status"][:4] == [0, 0, 0, 0], (rank, index, got)
            if tokens[rank]:
                assert got["error"] is not None and got["error"] < 2e-2, (rank, index, got)


def test_stalled_peer_at_ep4_ends_in_a_timeout_on_every_waiting_rank(monkeypatch):
    """EP 4 between real processes, the device-resident call's launches: rank 3 never makes call 1. Every other rank's
    routing exchange gives up at its deadline and records [timeout of the exchange, source 3, seen, expected] in its
    status word, its kernel then does nothing and leaves NaN rows (the caller's tensors are not written), and no rank
    hangs: what the host turns into WeaveTimeoutError."""
    from weave_moe.backends.weave.kernels import sync
    from weave_moe.testing import run_distributed

    monkeypatch.setenv("TRITON_INTERPRET", "1")   # inherited by the spawned ranks, before they import triton
    calls = [([4, 2, 5, 3], None), ([3, 6, 1, 2], None)]
    results = run_distributed(_resident_worker, 4, calls, (3, 1), backend="gloo", timeout_s=600,
                              env=dict(TRITON_INTERPRET="1"), shared_device=True)
    for rank in range(3):
        first, stalled = results[rank]
        assert first["status"][:4] == [0, 0, 0, 0] and first["error"] < 2e-2, (rank, first)
        assert stalled["status"][:2] == [sync.ERROR_EXCHANGE_TIMEOUT.value, 3], (rank, stalled)
        assert stalled["status"][2] < stalled["status"][3], (rank, stalled)   # seen below expected
        assert stalled["nan"], (rank, stalled)
    assert results[3][1]["status"] is None


@pytest.mark.parametrize("early_dispatch", ["counts", "bases"])
def test_peer_dying_before_its_dispatch_ends_in_a_timeout_of_the_dispatch_beside_the_tables(monkeypatch,
                                                                                          early_dispatch):
    """EP 2 between real processes: rank 1 makes call 1's routing exchange and counts, then never dispatches. Rank
    0's dispatch beside the tables (the early dispatch after the counts, or the one after the bases) gives up at its
    deadline with [arrival timeout, a flag of source 1, seen, expected] in its status word, and its kernel, started
    after it, does nothing and leaves NaN rows: no hang, the caller's tensors not written."""
    from weave_moe.backends.weave.kernels import sync
    from weave_moe.testing import run_distributed

    monkeypatch.setenv("TRITON_INTERPRET", "1")   # inherited by the spawned ranks, before they import triton
    calls = [([3, 2], None), ([4, 3], None)]
    results = run_distributed(_resident_worker, 2, calls, None, False, early_dispatch == "counts", False,
                              early_dispatch, (1, 1), backend="gloo", timeout_s=600, env=dict(TRITON_INTERPRET="1"),
                              shared_device=True)
    first, stalled = results[0]
    assert first["status"][:4] == [0, 0, 0, 0] and first["error"] < 2e-2, first
    assert stalled["status"][0] == sync.ERROR_ARRIVAL_TIMEOUT.value and stalled["status"][1] // 16 == 1, stalled
    assert stalled["status"][2] < stalled["status"][3], stalled   # seen below expected
    assert stalled["nan"], stalled
    assert results[1][1]["status"] is None


class _PairRig:
    """One rank's share of the pair tests (under the interpreter, across processes): the routing exchange and counts
    as the resident call makes them, then `PairDispatch` into the peers' receive regions. `call` makes one call:
    the call's inputs (`_call_inputs`, a token naming one expert twice in call 1 on rank 0, a bad id on rank 0 when
    `bad_id`), the receive region poisoned, the pack, the exchange, the counts, the dispatch into poisoned offsets
    (-7) and rows (-9) tables. The layer is one the backend pairs at EP > 1 (KernelConfig.pair_peers): its calls
    of up to T_max tokens, its receive region sized for EP * T_max * k pairs (`attach(recv_rows=)`)."""

    H, MAX_TOKENS, MAX_CALL_TOKENS = 40, 4, 4

    def __init__(self, rank: int, world_size: int, E: int, k: int, programs: int = 5):
        """`programs`: the pair dispatch's (5: one pair per step; 2: four, the long calls' walk, `_peer_pairs`)."""
        import torch
        import torch.distributed as dist

        from weave_moe.backends.coordination import HEADER_WORDS
        from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage
        from weave_moe.backends.weave.kernels import sync
        from weave_moe.backends.weave.kernels.counts import DeviceCounts
        from weave_moe.backends.weave.kernels.early_dispatch import PairDispatch
        from weave_moe.backends.weave.workspace import SymmetricWorkspace

        self.rank, self.world_size, self.E, self.k = rank, world_size, E, k
        self.message = RoutingMessage(self.MAX_TOKENS, k)
        self.fmt = CountsFormat(world_size, E, sync.STATUS_WORDS)
        self.counts = DeviceCounts(self.fmt, self.message, torch.device("cpu"))
        self.ws = SymmetricWorkspace(dist.group.WORLD, rank, world_size, torch.device("cpu")).attach(
            self.MAX_TOKENS, self.H, routing_words=self.message.words, recv_rows=world_size * self.MAX_TOKENS * k)
        self.send = torch.empty(self.message.words, dtype=torch.int32)
        self.all_routing = torch.zeros(world_size, self.message.words, dtype=torch.int32)
        self.status = torch.zeros(2 * sync.STATUS_WORDS, dtype=torch.int32)
        self.live_status = self.status[:sync.STATUS_WORDS]
        self.header = torch.tensor([77, 0, 0, 0], dtype=torch.int32)[:HEADER_WORDS]
        self.io = torch.zeros(2, dtype=torch.int64)
        self.ctrl = torch.zeros(64, dtype=torch.int32)
        self.dispatch = PairDispatch(world_size, E, k, self.H, self.MAX_TOKENS, self.MAX_CALL_TOKENS,
                                     num_programs=programs, recv_rows=self.ws.recv_rows)
        assert (self.dispatch.pipe > 1) == (programs == 2), (programs, self.dispatch.pipe)

    def call(self, call: int, T: int, out, bad_id: bool):
        """One call of T tokens on this rank with `out` as its output; returns a namespace of its ids, weights and x,
        the unpacked routing (all_ids, all_weights, all_tokens), the counts' pairs per expert, offsets and rows."""
        import types

        import torch

        from weave_moe.backends.weave.kernels.routing_exchange import exchange_routing

        E, rank = self.E, self.rank
        ids, weights, x = _call_inputs(call, rank, T, E, self.k, self.H)
        if call == 1 and rank == 0 and T >= 2:   # a token with the same expert twice: two pairs, by top-k slot
            ids[1, 1] = ids[1, 0]
        if bad_id and rank == 0:
            ids[0, 0] = E
        self.ws.recv().fill_(float("nan"))
        self.ws.pair_rows().fill_(-5)
        self.message.pack_call(self.send, ids, weights, self.header, self.io, x if T else out, out, 0, self.status,
                               self.ctrl, self.ws.flags(0), E)
        exchange_routing(self.ws, self.message, self.send, self.all_routing, self.live_status,
                         timeout_ns=120 * 10**9, parts=1, block=8)
        vector = self.counts.build(self.all_routing, self.live_status, rank, verdict=True)
        all_ids, all_weights, all_tokens = self.message.unpack(self.all_routing)
        pairs = vector[self.fmt.expert_pairs_offset:self.fmt.expert_pairs_offset + E]
        offsets = torch.full((E // self.world_size + 1,), -7, dtype=torch.int32)
        rows = torch.full(self.dispatch.rows_shape, -9, dtype=torch.int32)
        self.dispatch.launch(all_ids, all_tokens, pairs, self.io, self.ws, self.live_status, rank, 10 ** 9, offsets,
                             rows)
        return types.SimpleNamespace(ids=ids, weights=weights, x=x, all_ids=all_ids, all_weights=all_weights,
                                     all_tokens=all_tokens, pairs=pairs, offsets=offsets, rows=rows)


def _pair_dispatch_worker(rank: int, world_size: int, calls: list, E: int, k: int, programs: int) -> list:
    """One rank of test_pair_dispatch_sends_each_pair_to_its_row_in_expert_order (`_PairRig`): the receive region
    (poisoned first) against the torch tables: row p holds the x row of the pair the tables put at p (`gather_rows[p]`
    names its dedup receive row, i.e. its source and token), bitwise, and nothing past the pairs is written; each
    source's flag holds its pairs; the expert offsets it writes equal the tables' `expert_offsets`. The last call has
    a bad expert id on rank 0, which the counts' verdict refuses on every rank: then nothing is sent and the offsets
    are zeros (no tile)."""
    import torch
    import torch.distributed as dist

    from weave_moe.backends.weave.exchange import hit_matrix
    from weave_moe.backends.weave.layout import build_layout
    from weave_moe.plan import MAX_CHUNKS

    rig = _PairRig(rank, world_size, E, k, programs)
    H, max_tokens, local, status, ws = rig.H, rig.MAX_TOKENS, E // world_size, rig.status, rig.ws
    results = []
    dist.barrier()
    for call, tokens in enumerate(calls):
        T = tokens[rank]
        refused = call == len(calls) - 1
        got = rig.call(call, T, torch.empty(max(T, 1), H).bfloat16(), bad_id=refused)
        all_ids, all_tokens, pairs, offsets, rows = got.all_ids, got.all_tokens, got.pairs, got.offsets, got.rows
        ref = build_layout(all_ids, torch.zeros(all_ids.shape), all_tokens, torch.ones(world_size, dtype=torch.int32),
                           rank, E, hidden_size=H, intermediate_size=16, block_m=16, block_n0=16, block_n1=16,
                           dispatch_rows=1, combine_rows=1, reduce_rows=1)
        recv = ws.recv()
        flags = ws.flags(0)[:world_size * MAX_CHUNKS].view(world_size, MAX_CHUNKS)
        if refused:
            results.append(dict(refused=True, status=status[:4].tolist(), offsets=offsets.tolist(),
                                unwritten=bool(recv.isnan().all()), flags=int(flags.abs().sum()),
                                rows_untouched=bool((rows == -9).all())))
            break
        total = int(pairs[rank * local:(rank + 1) * local].sum())
        hit = hit_matrix(all_ids, local)
        wrong, placed = [], []
        for p in range(total):
            source, slot = divmod(int(ref.gather_rows[p]), max_tokens)
            token = int(hit[source, :, rank].nonzero()[slot])
            placed.append((p, source, token))
            _, _, x_source = _call_inputs(call, source, int(all_tokens[source]), E, k, H)
            if not torch.equal(recv[p].view(torch.int16), x_source[token].view(torch.int16)):
                wrong.append((p, source, token))
        owed = [int(((all_ids[s, :int(all_tokens[s])] >= rank * local)
                     & (all_ids[s, :int(all_tokens[s])] < (rank + 1) * local)).sum()) for s in range(world_size)]
        results.append(dict(refused=False, rows=rows[:T].tolist(), ids=all_ids[rank, :T].tolist(), placed=placed,
                            pair_rows=ws.pair_rows().tolist(),
                            rows_past=bool((rows[T:] == -9).all()), status=status[:4].tolist(), wrong=wrong, total=total,
                            offsets=offsets.tolist(), expert_offsets=ref.expert_offsets.tolist(),
                            unwritten_past=bool(recv[total:].isnan().all()),
                            flags=flags[:, 0].tolist(), owed=owed, other_chunks=int(flags[:, 1:].abs().sum())))
        dist.barrier()   # every rank has checked its rows before any rank's next call overwrites them
    dist.barrier()
    return results


@pytest.mark.parametrize("calls, E, k", [([[3], [4], [0], [2]], 8, 2),
                                         ([[3, 2], [4, 1], [0, 4], [1, 1]], 8, 2),
                                         ([[2, 1, 3, 0], [4, 4, 1, 2], [1, 2, 1, 1]], 16, 3)],
                         ids=["ep1", "ep2", "ep4"])
@pytest.mark.parametrize("programs", [5, 2], ids=["pair-per-step", "four-per-step"])
def test_pair_dispatch_sends_each_pair_to_its_row_in_expert_order(monkeypatch, calls, E, k, programs):
    """`PairDispatch` (KernelConfig.pair_dispatch; docs/perf-notes.md entry 36's rows in expert order) at EP 1 (where
    the backend uses it), 2 and 4 between real processes, under the interpreter: every pair row of every rank lands
    at the row the torch tables' expert order gives it (bitwise), nothing else is written, each source's flag counts
    the pairs it owes and the expert offsets are the tables'; calls with a rank of no tokens and a token naming one
    expert twice; a refused last call (a bad id on rank 0) sends nothing and writes zero offsets on every rank."""
    from weave_moe.testing import run_distributed

    monkeypatch.setenv("TRITON_INTERPRET", "1")   # inherited by the spawned ranks, before they import triton
    results = run_distributed(_pair_dispatch_worker, len(calls[0]), calls, E, k, programs, backend="gloo",
                              timeout_s=600,
                              env=dict(TRITON_INTERPRET="1"), shared_device=True)
    for rank, per_call in enumerate(results):
        assert len(per_call) == len(calls), (rank, per_call)
        *served, refused = per_call
        assert refused["refused"] and refused["status"][0] != 0, (rank, refused)
        assert refused["offsets"] == [0] * (E // len(calls[0]) + 1) and refused["unwritten"], (rank, refused)
        assert refused["flags"] == 0 and refused["rows_untouched"], (rank, refused)
        for call, got in enumerate(served):
            assert got["status"] == [0, 0, 0, 0] and not got["wrong"] and got["unwritten_past"], (rank, call, got)
            assert got["flags"] == got["owed"] and got["other_chunks"] == 0, (rank, call, got)
            assert sum(got["owed"]) == got["total"], (rank, call, got)
            assert got["offsets"] == got["expert_offsets"], (rank, call, got)   # the tile tables' input
    # the rows table: each pair (t, j) of source s names the row at its destination d where d placed (s, t)'s row
    # (as many rows there as s's token has slots on d); no expert: -1; past T: not written
    local = E // len(calls[0])
    for call in range(len(calls) - 1):
        for source, per_call in enumerate(results):
            got = per_call[call]
            assert got["rows_past"], (source, call)
            for t, (ids, rows) in enumerate(zip(got["ids"], got["rows"])):
                for dest in range(len(calls[0])):
                    named = sorted(r for e, r in zip(ids, rows) if e >= 0 and e // local == dest)
                    placed = sorted(p for p, s, token in results[dest][call]["placed"] if (s, token) == (source, t))
                    assert named == placed, (source, call, t, dest, named, placed)
                assert all(r == -1 for e, r in zip(ids, rows) if e < 0), (source, call, t)
    # the destinations' pair rows regions: entry (s * T_max + t) * k + j holds the row of source s's pair (t, j)
    # where its expert is the destination's (the source's rows table names the same row), every other entry as
    # poisoned (-5)
    max_tokens = _PairRig.MAX_TOKENS
    for call in range(len(calls) - 1):
        for dest, per_call in enumerate(results):
            expected = [-5] * len(per_call[call]["pair_rows"])
            for source, theirs in enumerate(results):
                for t, (ids, rows) in enumerate(zip(theirs[call]["ids"], theirs[call]["rows"])):
                    for j, (e, r) in enumerate(zip(ids, rows)):
                        if e >= 0 and e // local == dest:
                            expected[(source * max_tokens + t) * k + j] = r
            assert per_call[call]["pair_rows"] == expected, (dest, call)


def _peer_pair_combine_worker(rank: int, world_size: int, calls: list, E: int, k: int, stall: bool) -> list:
    """One rank of test_peer_pair_combine_after_the_pair_dispatch (`_PairRig`'s calls): after the pair dispatch, a
    per-expert stand-in for the GEMMs (y row p of expert e = bf16(recv[p] * (e + 1) / 8), e read off the offsets),
    then `PeerPairCombine.send` and `.reduce` into a poisoned out. Returns out, this rank's ids, weights and x for
    the parent's reference; the last call has a bad id on rank 0 (refused on every rank), or with `stall` rank 1
    sends nothing in it (every rank that waits for it gives up at the reduce's deadline)."""
    import torch
    import torch.distributed as dist

    from weave_moe.backends.weave.kernels.pair_combine import PeerPairCombine

    rig = _PairRig(rank, world_size, E, k, programs=2)   # the long calls' walk (the other: the dispatch test)
    H, max_tokens, local, ws = rig.H, rig.MAX_TOKENS, E // world_size, rig.ws
    combine = PeerPairCombine(world_size, E, k, H, max_tokens, rig.MAX_CALL_TOKENS, num_programs=3)
    results = []
    dist.barrier()
    for call, tokens in enumerate(calls):
        T = tokens[rank]
        last = call == len(calls) - 1
        refused = last and not stall
        out = torch.full((T + 1, H), -3.0).bfloat16()
        ws.comb(0).fill_(float("nan"))
        got = rig.call(call, T, out, bad_id=refused)
        recv = ws.recv()
        y = torch.full((ws.recv_rows, H), float("nan")).bfloat16()
        for e in range(local):
            lo, hi = int(got.offsets[e]), int(got.offsets[e + 1])
            y[lo:hi] = (recv[lo:hi].float() * (rank * local + e + 1) / 8).bfloat16()
        if not (stall and last and rank == 1):
            combine.send(got.all_ids, got.all_weights, got.all_tokens, y, ws, rig.live_status, rank)
        # the interpreter's deadline counts polls (100 ns each): 10^6 ns is 10^4 polls
        combine.reduce(got.all_ids, got.all_tokens, rig.io, ws, rig.live_status, rank, 10 ** 6)
        owed_by_1 = bool(((got.ids >= local) & (got.ids < 2 * local)).any())
        results.append(dict(out=out.float().tolist(), ids=got.ids.tolist(), weights=got.weights.tolist(),
                            x=got.x.float().tolist(), refused=refused, stalled=stall and last and owed_by_1,
                            status=rig.status[:4].tolist()))
        dist.barrier()   # every rank has reduced before any rank's next call zeroes the flags
    dist.barrier()
    return results


def _truncated(values):
    """fp32 -> bf16 as the interpreter converts (truncation), back to fp32."""
    import torch

    return (values.view(torch.int32) & -65536).view(torch.float32)


@pytest.mark.parametrize("calls, E, k, stall", [([[3, 2], [4, 1], [0, 4], [1, 1]], 8, 2, False),
                                                ([[2, 1, 3, 0], [4, 4, 1, 2], [1, 2, 1, 1]], 16, 3, False),
                                                ([[2, 3], [3, 2]], 8, 2, True)], ids=["ep2", "ep4", "ep2-stalled"])
def test_peer_pair_combine_after_the_pair_dispatch(monkeypatch, calls, E, k, stall):
    """`PeerPairCombine` (docs/perf-notes.md entry 41, the paired call's combine at EP > 1) at EP 2 and 4 between real
    processes, under the interpreter, after `PairDispatch` and a per-expert stand-in for the GEMMs: every rank's out
    row is, bitwise, the sum over the destinations of its token (ascending) of that destination's slot-ordered fp32
    sum of weight x (expert's row), each rounded as the megakernel's combine and reduce round; rows past T are not
    written; a token naming one expert twice counts it twice; a rank with no tokens; a refused last call writes NaN
    rows on every rank and hangs nowhere; a destination that never sends (rank 1, "stalled") makes every rank it owes
    rows give up at the reduce's deadline with the combine timeout and NaN rows, no hang."""
    import torch

    from weave_moe.testing import run_distributed

    monkeypatch.setenv("TRITON_INTERPRET", "1")   # inherited by the spawned ranks, before they import triton
    world = len(calls[0])
    results = run_distributed(_peer_pair_combine_worker, world, calls, E, k, stall, backend="gloo", timeout_s=600,
                              env=dict(TRITON_INTERPRET="1"), shared_device=True)
    local = E // world
    for rank, per_call in enumerate(results):
        for call, got in enumerate(per_call):
            T = calls[call][rank]
            out = torch.tensor(got["out"])
            assert (out[T] == -3.0).all(), (rank, call)   # past T: not written
            if got["refused"]:
                assert out[:T].isnan().all() and got["status"][0] != 0, (rank, call, got["status"])
                continue
            if got["stalled"]:
                assert out[:T].isnan().all() and got["status"][0] == 4, (rank, call, got["status"])   # COMBINE
                continue
            ids, weights, x = torch.tensor(got["ids"]), torch.tensor(got["weights"]), torch.tensor(got["x"])
            for t in range(T):
                total = torch.zeros(x.shape[1])
                for d in range(world):
                    part = torch.zeros(x.shape[1])
                    for j in range(k):
                        e = int(ids[t, j])
                        if d * local <= e < (d + 1) * local:
                            part += weights[t, j] * (x[t] * (e + 1) / 8).bfloat16().float()
                    if any(d * local <= int(e) < (d + 1) * local for e in ids[t]):
                        total += _truncated(part)
                assert torch.equal(out[t], _truncated(total)), (rank, call, t)


TAKE_SCRIPT = textwrap.dedent(
    r"""
    import torch
    import triton
    import triton.language as tl
    from weave_moe.backends.weave.kernels import megakernel

    @triton.jit
    def take_probe(counter_ptr, hits_ptr, owner_ptr, n, STATIC: tl.constexpr):
        pid = tl.program_id(0)
        own = tl.full([], -1, tl.int32)
        if STATIC:
            own = pid
        offset = tl.where(own >= 0, tl.num_programs(0), 0)
        task = tl.full([], 0, tl.int32)
        while task < n:
            task, t_start, own = megakernel._take(counter_ptr, own, offset, n, STATIC, False)
            if task < n:
                tl.atomic_add(hits_ptr + task, 1)
                tl.store(owner_ptr + task, pid)

    grid = 5
    for static in (True, False):
        for n in (1, 3, 5, 6, 17):
            counter = torch.zeros(1, dtype=torch.int32)
            hits = torch.zeros(n, dtype=torch.int32)
            owner = torch.full((n,), -1, dtype=torch.int32)
            take_probe[(grid,)](counter, hits, owner, n, STATIC=static)
            assert hits.tolist() == [1] * n, (static, n, hits.tolist())
            if static:   # tasks [0, grid) went to their own CTAs, without the queue
                assert owner[:min(n, grid)].tolist() == list(range(min(n, grid))), (n, owner.tolist())
                # no task past the grid: no CTA claimed from the queue (its atomic skipped); otherwise the n - grid
                # claims that got a task and one empty claim per CTA
                assert counter.item() == (0 if n <= grid else n - grid + grid), (n, counter.item())
    print("TAKE OK")
    """
)


def test_take_hands_every_task_out_once():
    """`megakernel._take`, the task queues of the launches without GEMM: with every CTA's first task its own (pid) and
    the queue counting from the grid size after them, and without (every task from the queue), each task of 1 to
    17 runs exactly once on a grid of 5 (the interpreter runs the programs one after another, so program 0 takes
    every task past the grid)."""
    run_interpreted(TAKE_SCRIPT, "TAKE OK", timeout=300)
