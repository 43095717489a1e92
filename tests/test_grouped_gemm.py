"""The grouped GEMMs of kernels/grouped_gemm.py without a GPU: under TRITON_INTERPRET=1 against torch, and their sm_90
PTX compiled exactly as a launch specialises them.

Tolerance: fp32 dot operands (the interpreter's bf16 dot is wrong); h and y are rounded to bf16 by truncation in the
interpreter (not round-to-nearest as on the GPU), up to one ulp each: 2e-2 here, the GPU benchmark holds 1e-2.
"""

import re
import textwrap

import pytest
import torch

from weave_moe.backends.weave.kernels import gemm_configs as gc
from weave_moe.backends.weave.kernels import grouped_gemm as gg
from weave_moe.backends.weave.kernels import sm90
from interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    r"""
    import torch
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels import grouped_gemm as gg

    C = gc.GemmConfig
    small = dict(block_m=16, block_n=32, block_k=16, group_m=2)
    CONFIGS = [C(**small, epilogue=gc.EPILOGUE_MASKED), C(**small, epilogue=gc.EPILOGUE_TMA),
               C(**small, epilogue=gc.EPILOGUE_TMA_CLIPPED), C(**small, interleaved=False, flatten=False),
               C(**dict(small, block_m=32), epilogue=gc.EPILOGUE_TMA),
               C(**dict(small, block_m=32), epilogue=gc.EPILOGUE_MASKED, split_tail=True),
               C(**dict(small, block_m=32), epilogue=gc.EPILOGUE_TMA_CLIPPED, split_tail=True, interleaved=False),
               C(**small, epilogue=gc.EPILOGUE_TMA_HALVES),
               # flattened, w13 as given (KernelConfig.interleave_w13 off)
               C(**small, epilogue=gc.EPILOGUE_TMA_CLIPPED, interleaved=False),
               C(**dict(small, block_m=32), epilogue=gc.EPILOGUE_TMA_HALVES, split_tail=True)]
    # (rows per local expert, H, I): empty experts, a single row, a tail of one row past a full tile, no rows at all,
    # I not a multiple of BN/2 (a tile reads into the next expert's weights), H not a multiple of BK (K tail)
    CASES = [([5, 0, 21], 48, 40), ([1], 40, 16), ([17, 33, 16], 32, 24), ([0, 0], 32, 16), ([40, 3], 24, 56),
             ([64, 65, 80, 96, 97], 32, 16)]

    def check(counts, H, I, cfg, seed, gathered=False):
        torch.manual_seed(seed)
        E = len(counts)
        offsets = torch.zeros(E + 1, dtype=torch.int32)
        offsets[1:] = torch.tensor(counts).cumsum(0)
        rows = int(offsets[-1])
        P = rows + 7  # the buffers are sized by a bound; rows past the last expert must stay untouched
        a = torch.randn(P, H).bfloat16()
        if gathered:  # GEMM0 reads row m as source[gather[m]] (the source rows in another order, more of them)
            source = torch.randn(P + 5, H).bfloat16()
            gather = torch.randperm(P + 5)[:P].int()
            a = source[gather.long()]
        w13 = (torch.randn(E, 2 * I, H) / H ** 0.5).bfloat16()
        w2 = (torch.randn(E, H, I) / I ** 0.5).bfloat16()
        scale = torch.rand(P) + 0.5
        tiles = gg.build_tile_table(offsets, cfg.block_m, P, cfg.split_tail)
        ref_tiles = gg.build_tile_table_torch(offsets, cfg.block_m, P, cfg.split_tail)
        assert torch.equal(tiles.num_tiles, ref_tiles.num_tiles), (tiles.num_tiles, ref_tiles.num_tiles)
        for section, n in enumerate(ref_tiles.num_tiles.tolist()):
            cols = slice(section * tiles.max_tiles, section * tiles.max_tiles + n)
            assert torch.equal(tiles.table[:, cols], ref_tiles.table[:, cols]), (section, tiles.table, ref_tiles.table)
        if cfg.split_tail:  # every row in exactly one tile, tails of at most BM/2 rows in section 1
            covered = torch.zeros(P, dtype=torch.int32)
            for section, n in enumerate(ref_tiles.num_tiles.tolist()):
                for j in range(n):
                    _, m_start, m_end = ref_tiles.table[:, section * tiles.max_tiles + j].tolist()
                    height = cfg.block_m >> section
                    covered[m_start:min(m_start + height, m_end)] += 1
            assert torch.equal(covered[:rows], torch.ones(rows, dtype=torch.int32)) and not covered[rows:].any()
        h = torch.full((P, I), float("nan")).bfloat16()
        y = torch.full((P, H), float("nan")).bfloat16()
        w = gg.interleave_w13(w13) if cfg.interleaved else w13
        if gathered:
            gg.grouped_gemm0(source, w, h, tiles, cfg, dot_fp32=True, gather=gather)
        else:
            gg.grouped_gemm0(a, w, h, tiles, cfg, dot_fp32=True)
        gg.grouped_gemm1(h, w2, y, tiles, cfg, scale=scale, dot_fp32=True)
        assert h[rows:].isnan().all() and y[rows:].isnan().all(), "rows past the last expert were written"
        assert not h[:rows].isnan().any() and not y[:rows].isnan().any(), "unwritten rows"
        for e in range(E):
            s, f = int(offsets[e]), int(offsets[e + 1])
            if s == f:
                continue
            gate_up = a[s:f].float() @ w13[e].float().T
            h_ref = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]
            y_ref = (h[s:f].float() @ w2[e].float().T) * scale[s:f, None]
            for out, ref in ((h[s:f], h_ref), (y[s:f], y_ref)):
                err = ((out.float() - ref).norm() / ref.norm()).item()
                assert err < 2e-2, (counts, H, I, cfg, e, err)

    for i, (counts, H, I) in enumerate(CASES):
        for j, cfg in enumerate(CONFIGS):
            check(counts, H, I, cfg, seed=10 * i + j)
        for j in (1, 3, 6):  # the gathered A rows: interleaved, gate and up apart, split tails
            check(counts, H, I, CONFIGS[j], seed=100 + 10 * i + j, gathered=True)
    print("GROUPED GEMM INTERPRETER OK")
    """
)


def test_grouped_gemms_under_interpreter():
    run_interpreted(SCRIPT, "GROUPED GEMM INTERPRETER OK", timeout=900)


STREAM_K_SCRIPT = textwrap.dedent(
    r"""
    import torch
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels import grouped_gemm as gg
    from weave_moe.backends.weave.kernels import sync

    def run(a, w, h, tiles, cfg, num_sms, gather=None, scratch=None, status=None):
        kernel, grid, args, kwargs = gg._gemm0_launch(a, w, h, tiles, cfg, dot_fp32=True, num_sms=num_sms,
                                                      gather=gather, stream_k_scratch=scratch, status=status)
        kernel[grid](*args, **kwargs)

    cases = 0
    # (rows per local expert, H, I, block_k): K steps per tile 3, 1 (H = BK), 4 with a K tail, 6
    for counts, H, I, bk in [([5, 0, 21], 48, 40, 16), ([1], 16, 16, 16), ([17, 33, 16], 56, 24, 16),
                             ([0, 0], 32, 16, 16), ([40, 3, 1, 9], 96, 32, 16)]:
        cfg = gc.GemmConfig(block_m=16, block_n=32, block_k=bk, group_m=2, epilogue=gc.EPILOGUE_MASKED,
                            stream_k=True)
        torch.manual_seed(len(counts) + H)
        E = len(counts)
        offsets = torch.zeros(E + 1, dtype=torch.int32)
        offsets[1:] = torch.tensor(counts).cumsum(0)
        rows = int(offsets[-1])
        P = rows + 5
        w13 = (torch.randn(E, 2 * I, H) / H ** 0.5).bfloat16()
        w = gg.interleave_w13(w13)
        source = torch.randn(P + 3, H).bfloat16()
        gather = torch.randperm(P + 3)[:P].int()
        a = source[gather.long()].contiguous()
        tiles = gg.build_tile_table(offsets, cfg.block_m, P, False)
        plain = torch.full((P, I), float("nan")).bfloat16()
        gg.grouped_gemm0(a, w, plain, tiles, cfg.with_(stream_k=False), dot_fp32=True)
        # GEMM1's inputs and its whole-tile result (32-wide tiles of y; K = I)
        cfg1 = gc.GemmConfig(block_m=16, block_n=32, block_k=bk, group_m=2, epilogue=gc.EPILOGUE_MASKED, stream_k=True)
        w2 = (torch.randn(E, H, I) / I ** 0.5).bfloat16()
        h_in = torch.randn(P, I).bfloat16()
        scale = torch.rand(P) + 0.5
        y_plain = torch.full((P, H), float("nan")).bfloat16()
        gg.grouped_gemm1(h_in, w2, y_plain, tiles, cfg1.with_(stream_k=False), scale=scale, dot_fp32=True)
        parts1, flags1 = gg.stream_k_buffers(64, cfg1.block_m * cfg1.block_n, "cpu")
        # 1 CTA (one range: no parts), ranges shorter than a tile (a tile over 3 CTAs), longer, more CTAs than steps
        parts, flags = gg.stream_k_buffers(64, cfg.block_m * cfg.block_n, "cpu")
        for num_sms in (1, 2, 3, 5, 7, 16, 64):
            for gathered in (False, True):
                status = torch.zeros(4, dtype=torch.int32)
                h = torch.full((P, I), float("nan")).bfloat16()
                run(source if gathered else a, w, h, tiles, cfg, num_sms, gather=gather if gathered else None,
                    scratch=lambda slots, elements: (parts[:slots * elements], flags[:slots]), status=status)
                assert not status.any() and not flags.any(), (status, flags)   # flags left zero for the next launch
                assert h[rows:].isnan().all(), "rows past the last expert were written"
                assert not h[:rows].isnan().any(), ("unwritten rows", counts, num_sms)
                for e in range(E):
                    s, f = int(offsets[e]), int(offsets[e + 1])
                    if s == f:
                        continue
                    gate_up = a[s:f].float() @ w13[e].float().T
                    ref = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]
                    err = ((h[s:f].float() - ref).norm() / ref.norm()).item()
                    assert err < 2e-2, (counts, H, num_sms, e, err)
                # the same sums as whole tiles up to the fp32 order of the parts (bf16 outputs: a rounding apart)
                assert ((h[:rows].float() - plain[:rows].float()).abs()
                        <= 1e-2 * plain[:rows].float().abs() + 1e-3).all(), (counts, num_sms)
                cases += 1
            # GEMM1 on the same tiles (K = I), with the routing weights
            status = torch.zeros(4, dtype=torch.int32)
            y = torch.full((P, H), float("nan")).bfloat16()
            kernel, grid, args, kwargs = gg._gemm1_launch(
                h_in, w2, y, tiles, cfg1, scale=scale, dot_fp32=True, num_sms=num_sms, status=status,
                stream_k_scratch=lambda slots, elements: (parts1[:slots * elements], flags1[:slots]))
            kernel[grid](*args, **kwargs)
            assert not status.any() and not flags1.any() and y[rows:].isnan().all() and not y[:rows].isnan().any()
            assert ((y[:rows].float() - y_plain[:rows].float()).abs()
                    <= 1e-2 * y_plain[:rows].float().abs() + 1e-3).all(), (counts, num_sms)
            for e in range(E):
                s, f = int(offsets[e]), int(offsets[e + 1])
                if s < f:
                    ref = (h_in[s:f].float() @ w2[e].float().T) * scale[s:f, None]
                    assert ((y[s:f].float() - ref).norm() / ref.norm()).item() < 2e-2, (counts, num_sms, e)
            cases += 1
    print("STREAM K OK", cases)
    """
)


def test_stream_k_gemms_under_interpreter():
    """GemmConfig.stream_k: the GEMMs' tiles split over CTAs by K steps (1-64 CTAs: ranges inside one tile, across
    several, CTAs without steps); GEMM0 with A through TMA or the gather rows, GEMM1 with the routing weights; against
    torch and against whole tiles; every row written once, rows past the experts untouched, the flags zero again
    after each launch, the status word clean."""
    out = run_interpreted(STREAM_K_SCRIPT, "STREAM K OK", timeout=900)
    assert int(out.split("STREAM K OK")[1].split()[0]) == 5 * 7 * 3


def test_interleave_w13_pairs_gate_and_up_rows():
    import torch

    w13 = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)
    out = gg.interleave_w13(w13)
    assert torch.equal(out[:, 0::2], w13[:, :3]) and torch.equal(out[:, 1::2], w13[:, 3:])


def test_default_config_picks_64_row_tiles_only_where_they_pad_much_less():
    assert gc.default_config(0, 154 * 80, 80).block_m == 64  # 2 tiles of 128 for 154 rows: 66% padding
    assert gc.default_config(1, 174 * 80, 80).block_m == 64
    for mean in (109, 128, 255, 381, 513, 2034):
        assert gc.default_config(0, mean * 64, 64).block_m == 128, mean
    with pytest.raises(ValueError, match="gemm"):
        gc.default_config(2, 100, 4)


def test_default_config_of_gemm0_at_decode_sizes_is_the_16_row_tile():
    """At most DECODE_ROWS_PER_EXPERT rows per expert on average: GEMM0 takes 16x128 tiles with BLOCK_K 128 (the
    third analytical config); above it, and for GEMM1 at any size, the 64 / 128-row rule."""
    decode = gc.analytical_configs(0)[2]
    assert (decode.block_m, decode.block_n, decode.block_k, decode.num_warps) == (16, 128, 128, 4)
    for rows, experts in ((1, 64), (8, 64), (64, 64), (8 * 128, 128), (gc.DECODE_ROWS_PER_EXPERT * 80, 80)):
        assert gc.analytical_config(0, rows, experts) == decode, (rows, experts)
        assert gc.analytical_config(1, rows, experts).block_m in (64, 128), (rows, experts)
    assert gc.analytical_config(0, (gc.DECODE_ROWS_PER_EXPERT + 1) * 80, 80).block_m in (64, 128)


def test_bad_arguments_name_what_was_expected():
    import torch

    offsets = torch.tensor([0, 4], dtype=torch.int32)
    cfg = gc.GemmConfig(block_m=16, block_n=32, block_k=16)
    tiles = gg.build_tile_table_torch(offsets, 16, 4)
    a = torch.zeros(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="split_tail"):
        gg.grouped_gemm0(a, torch.zeros(1, 32, 32, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16),
                         tiles, cfg.with_(split_tail=True))
    with pytest.raises(ValueError, match="h: expected contiguous"):
        gg.grouped_gemm0(a, torch.zeros(1, 32, 32, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16),
                         tiles, cfg)
    with pytest.raises(ValueError, match="tiles.block_m"):
        gg.grouped_gemm0(a, torch.zeros(1, 32, 32, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16),
                         tiles, cfg.with_(block_m=32))
    with pytest.raises(ValueError, match="gather: expected contiguous int32"):
        gg.grouped_gemm0(a, torch.zeros(1, 32, 32, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16),
                         tiles, cfg, gather=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="expert_offsets"):
        gg.build_tile_table(offsets.long(), 16, 4)


#: SMs of the GPU the runtime specialises NUM_SMS for when a table does not say (H200; its tables record "sms").
H200_SMS = 132
#: Layer shapes (H, I) whose analytical configs are compiled: DeepSeek-V3 and Qwen3-30B-A3B.
ANALYTICAL_SHAPES = ((7168, 2048), (2048, 768))


def _runtime_compile_cases():
    """(gemm, config, H, I, sms) of every configuration the weave backend can launch: `default_configs` for each
    shape of each shipped tuned table (the analytical pair and every tuned entry), and the analytical pair at
    ANALYTICAL_SHAPES. Only the specialisation matters (E_local and rows are runtime values the kernel is not
    specialised on), so repeats of one (config, H % 16, I % 16, sms) are dropped."""
    cases, seen = [], set()

    def add(gemm, config, hidden, inter, sms):
        key = (gemm, config, hidden % 16 == 0, inter % 16 == 0, sms)
        if key not in seen:
            seen.add(key)
            cases.append((gemm, config, hidden, inter, sms))

    for path in sorted(gc.TUNED_DIR.glob("*.json")):
        table = gc.load_tuned_table(path)
        sms = table["data"].get("meta", {}).get("sms", H200_SMS)
        for gemm, experts, hidden, inter in sorted(table["shapes"]):
            for config in gc.default_configs(gemm, experts, hidden, inter, table=path):
                add(gemm, config, hidden, inter, sms)
    for hidden, inter in ANALYTICAL_SHAPES:
        for gemm in (0, 1):
            for config in gc.default_configs(gemm):
                add(gemm, config, hidden, inter, H200_SMS)
    return cases


def _runtime_launch(gemm, cfg, hidden, inter, sms, scale=False, gathered=False):
    """The launch the weave backend makes (backend._grouped_gemms: workspace h / y of max_pairs rows, a tile table
    with the config's split tails, GEMM1 without routing weights), on CPU tensors of 16-byte aligned storage like the
    GPU's."""
    import torch

    experts, rows = 2, 512
    offsets = torch.tensor([0, rows // 2, rows], dtype=torch.int32)
    tiles = gg.build_tile_table_torch(offsets, cfg.block_m, rows, cfg.split_tail)
    h = torch.empty(rows, inter, dtype=torch.bfloat16)
    if gemm == 0:
        a = torch.empty(rows, hidden, dtype=torch.bfloat16)
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16)
        # gathered: the receive buffer and the layout's gather rows (KernelConfig.gemm0_gather)
        gather = torch.empty(rows, dtype=torch.int32) if gathered else None
        return gg._gemm0_launch(a, w13, h, tiles, cfg, num_sms=sms, gather=gather)
    w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16)
    y = torch.empty(rows, hidden, dtype=torch.bfloat16)
    return gg._gemm1_launch(h, w2, y, tiles, cfg, scale=torch.empty(rows) if scale else None, num_sms=sms)


def _check_hopper_ptx(cfg, compiled, tmp_path):
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx, "operands not loaded by the bulk tensor copy engine"
    assert not re.search(r"\.local\b", ptx), "local memory in the GEMM kernel"
    if cfg.block_m < 64:
        # tiles under one warpgroup's 64 rows (the tuned table's decode entries: 16-row tiles) run on the tensor
        # cores' synchronous MMA; wgmma needs 64 rows per warpgroup
        assert "mma.sync.aligned" in ptx and "wgmma" not in ptx, "not on the tensor cores"
    else:
        assert "wgmma.mma_async" in ptx, "not on Hopper's tensor cores"
        # one wide MMA per k16 step and warpgroup row block (GEMM0: no separate gate and up MMAs): BLOCK_K / 16
        # wgmma per K step, twice that where one warpgroup covers 128 rows
        heights = (cfg.block_m, 64) if cfg.split_tail else (cfg.block_m,)   # split tails: a 64-row loop too
        expected = sum(cfg.block_k // 16 * max(1, rows // (16 * cfg.num_warps)) for rows in heights)
        assert ptx.count("wgmma.mma_async") == expected, (ptx.count("wgmma.mma_async"), expected)
    # programmatic dependent launch: wait for the predecessor before anything, release the next launch after the
    # tiles (every MMA issued), not at the start (grouped_gemm's module docstring)
    waits, releases = ptx.find("griddepcontrol.wait"), ptx.rfind("griddepcontrol.launch_dependents")
    last_mma = max(ptx.rfind("wgmma.mma_async"), ptx.rfind("mma.sync.aligned"))
    assert 0 <= waits < last_mma < releases, (waits, last_mma, releases)
    report = sm90.ptxas_report(ptx, tmp_path)
    assert "0 bytes stack frame" in report and "0 bytes spill stores" in report, report


# Every configuration the runtime may launch, compiled for sm_90 exactly as the runtime specialises it: Triton's own
# binder on the launch's arguments (pointer alignment and the integers' divisibility by 16 -> tt.divisibility, the
# host TMA descriptors' block types), NUM_SMS of the GPU, GEMM1 without routing weights as the backend calls it.
@pytest.mark.parametrize("gemm,cfg,hidden,inter,sms", _runtime_compile_cases(),
                         ids=lambda v: repr(v) if not isinstance(v, gc.GemmConfig) else
                         f"{v.block_m}x{v.block_n}x{v.block_k}w{v.num_warps}s{v.num_stages}e{v.epilogue}")
def test_runtime_configs_compile_for_hopper_without_local_memory(gemm, cfg, hidden, inter, sms, tmp_path):
    kernel, grid, args, kwargs = _runtime_launch(gemm, cfg, hidden, inter, sms)
    assert grid == (sms,) and kwargs["NUM_SMS"] == sms
    source, _, _ = sm90.specialize_for_sm90(kernel, args, kwargs)
    names = list(source.signature)
    divisible = {names[i] for (i,), attrs in source.attrs.items() if ["tt.divisibility", 16] in attrs}
    pointers = {n for n, ty in source.signature.items() if ty.startswith("*")}
    assert pointers <= divisible, ("pointers without 16-byte alignment", pointers - divisible)
    assert {"H", "I"} <= divisible, ("H / I not specialised divisible by 16", divisible)
    assert "max_tiles" not in divisible  # do_not_specialize: one compile for every buffer size
    assert all(source.signature[n].startswith("tensordesc<bf16[") for n in names if n.endswith("_desc"))
    _check_hopper_ptx(cfg, sm90.compile_for_sm90(kernel, args, kwargs), tmp_path)


# GEMM0 reading its A rows through the gather index (KernelConfig.gemm0_gather): every GEMM0 configuration the runtime
# may launch, weights still through TMA, no local memory
@pytest.mark.parametrize("gemm,cfg,hidden,inter,sms", [case for case in _runtime_compile_cases() if case[0] == 0],
                         ids=lambda v: repr(v) if not isinstance(v, gc.GemmConfig) else
                         f"{v.block_m}x{v.block_n}x{v.block_k}w{v.num_warps}s{v.num_stages}e{v.epilogue}")
def test_gathered_gemm0_configs_compile_for_hopper_without_local_memory(gemm, cfg, hidden, inter, sms, tmp_path):
    kernel, _, args, kwargs = _runtime_launch(gemm, cfg, hidden, inter, sms, gathered=True)
    assert kwargs["GATHER_A"]
    _check_hopper_ptx(cfg, sm90.compile_for_sm90(kernel, args, kwargs), tmp_path)


# A layer that keeps w13 as given (KernelConfig.interleave_w13 off) runs every GEMM0 configuration of the runtime
# with gate and up as two MMAs (GemmConfig.interleaved off): each compiles without local memory or spills too
@pytest.mark.parametrize("gemm,cfg,hidden,inter,sms", [case for case in _runtime_compile_cases() if case[0] == 0],
                         ids=lambda v: repr(v) if not isinstance(v, gc.GemmConfig) else
                         f"{v.block_m}x{v.block_n}x{v.block_k}w{v.num_warps}s{v.num_stages}e{v.epilogue}")
def test_gemm0_configs_on_w13_as_given_compile_for_hopper_without_local_memory(gemm, cfg, hidden, inter, sms,
                                                                               tmp_path):
    cfg = cfg.with_(interleaved=False, stream_k=False)
    kernel, _, args, kwargs = _runtime_launch(gemm, cfg, hidden, inter, sms, gathered=inter <= 1024)
    assert not kwargs["INTERLEAVED"]
    compiled = sm90.compile_for_sm90(kernel, args, kwargs)
    from weave_moe.commands.tune import HOPPER_SMEM_BYTES

    assert compiled.metadata.shared <= HOPPER_SMEM_BYTES, compiled.metadata.shared
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and not re.search(r"\.local\b", ptx)
    report = sm90.ptxas_report(ptx, tmp_path)
    assert "0 bytes stack frame" in report and "0 bytes spill stores" in report, report


# The clipped TMA epilogue in column halves (EPILOGUE_TMA_HALVES): GEMM1's 128x256 tiles with 4 pipeline stages fit
# Hopper's shared memory only this way (one 128x128 buffer; the whole-tile clipped store needs 262 KB), and compile
# without local memory, both GEMMs, split tails too.
@pytest.mark.parametrize("gemm,split_tail", [(0, False), (1, False), (1, True)])
def test_halves_epilogue_fits_four_stages_of_wide_tiles(gemm, split_tail, tmp_path):
    cfg = gc.analytical_configs(gemm)[1].with_(epilogue=gc.EPILOGUE_TMA_HALVES, num_stages=4, split_tail=split_tail)
    kernel, _, args, kwargs = _runtime_launch(gemm, cfg, 7168, 2048, H200_SMS)
    compiled = sm90.compile_for_sm90(kernel, args, kwargs)
    from weave_moe.commands.tune import HOPPER_SMEM_BYTES

    assert compiled.metadata.shared <= HOPPER_SMEM_BYTES, compiled.metadata.shared
    _check_hopper_ptx(cfg, compiled, tmp_path)
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared") >= 2 * (1 + split_tail)  # two stores per tile


# Stream-K GEMM0 (GemmConfig.stream_k) as the decode configurations would run it: 16-row tiles on the synchronous
# MMA and 64-row ones on wgmma, A through TMA or the gather rows; no local memory, the parts read past L1 and
# published with one release exchange per CTA, the waits acquire
@pytest.mark.parametrize("cfg,hidden,inter,gathered", [
    (gc.GemmConfig(block_m=16, block_n=128, block_k=128, num_stages=4, num_warps=4, epilogue=0, stream_k=True),
     2048, 768, True),
    (gc.GemmConfig(block_m=16, block_n=256, block_k=64, num_stages=4, num_warps=4, epilogue=0, stream_k=True),
     7168, 2048, False),
    (gc.GemmConfig(block_m=64, block_n=128, block_k=64, num_stages=4, num_warps=4, epilogue=0, stream_k=True),
     2048, 1408, False)], ids=["qwen3-16-gather", "dsv3-16", "v2lite-64"])
def test_stream_k_gemm0_compiles_for_hopper_without_local_memory(cfg, hidden, inter, gathered, tmp_path):
    kernel, _, args, kwargs = _runtime_launch(0, cfg, hidden, inter, H200_SMS, gathered=gathered)
    assert kwargs["STREAM_K"]
    compiled = sm90.compile_for_sm90(kernel, args, kwargs)
    _check_hopper_ptx(cfg, compiled, tmp_path)
    ptx = compiled.asm["ptx"]
    assert "ld.global.cg" in ptx, "the parts must be read past L1"
    assert re.search(r"atom\.release\.gpu\.global\.exch|atom\.global\.gpu\.release\.exch", ptx), "no release"
    # the acquire poll (an atomic add of 0) is emitted as an acquire load
    assert re.search(r"(atom|ld)\.global\.gpu\.acquire", ptx), "no acquire"


@pytest.mark.parametrize("cfg,hidden,inter,scale", [
    (gc.GemmConfig(block_m=16, block_n=128, block_k=128, num_stages=4, num_warps=4, epilogue=0, stream_k=True),
     7168, 2048, False),
    (gc.GemmConfig(block_m=64, block_n=128, block_k=64, num_stages=4, num_warps=4, epilogue=0, stream_k=True),
     2048, 768, True)], ids=["dsv3-16", "qwen3-64-scaled"])
def test_stream_k_gemm1_compiles_for_hopper_without_local_memory(cfg, hidden, inter, scale, tmp_path):
    kernel, _, args, kwargs = _runtime_launch(1, cfg, hidden, inter, H200_SMS, scale=scale)
    assert kwargs["STREAM_K"]
    compiled = sm90.compile_for_sm90(kernel, args, kwargs)
    _check_hopper_ptx(cfg, compiled, tmp_path)
    assert "ld.global.cg" in compiled.asm["ptx"]


def test_stream_k_scratch_is_one_pair_per_size():
    scratch = gg.StreamKScratch("cpu")
    parts, flags = scratch(4, 16)
    assert parts.shape == (64,) and parts.dtype == torch.float32 and flags.shape == (4,) and not flags.any()
    assert scratch(4, 16)[0] is parts and scratch(4, 32)[0] is not parts


def test_stream_k_is_not_with_split_tails_or_tma_stores():
    gc.check_config(0, gc.GemmConfig(stream_k=True, epilogue=0))
    gc.check_config(1, gc.GemmConfig(stream_k=True, epilogue=0))
    for gemm, cfg in ((1, gc.GemmConfig(stream_k=True, epilogue=0, split_tail=True)),
                      (0, gc.GemmConfig(stream_k=True, epilogue=0, split_tail=True)),
                      (0, gc.GemmConfig(stream_k=True, epilogue=0, warp_specialize=2)),
                      (1, gc.GemmConfig(stream_k=True, epilogue=2)),
                      (0, gc.GemmConfig(stream_k=True, epilogue=0, interleaved=False, flatten=False))):
        with pytest.raises(ValueError, match="stream_k"):
            gc.check_config(gemm, cfg)


def test_halves_epilogue_needs_16_byte_halves():
    gc.check_config(0, gc.GemmConfig(block_n=32, epilogue=gc.EPILOGUE_TMA_HALVES))
    with pytest.raises(ValueError, match="TMA halves"):
        gc.check_config(0, gc.GemmConfig(block_n=16, epilogue=gc.EPILOGUE_TMA_HALVES))
    gc.check_config(1, gc.GemmConfig(block_n=16, epilogue=gc.EPILOGUE_TMA_HALVES))


# GEMM1 with routing weights in its epilogue (scripts/gemm_bench.py's pipeline; not the backend's call).
@pytest.mark.parametrize("block_m", [64, 128])
def test_gemm1_with_routing_weights_compiles_without_local_memory(block_m, tmp_path):
    cfg = next(c for c in gc.analytical_configs(1) if c.block_m == block_m)
    kernel, _, args, kwargs = _runtime_launch(1, cfg, 7168, 2048, H200_SMS, scale=True)
    assert kwargs["HAS_SCALE"]
    _check_hopper_ptx(cfg, sm90.compile_for_sm90(kernel, args, kwargs), tmp_path)


def test_default_config_only_picks_from_default_configs():
    """The weave backend compiles `default_configs` before its first-call barrier: nothing else may be picked."""
    for gemm in (0, 1):
        allowed = gc.default_configs(gemm)
        for experts in (1, 8, 80, 128):
            for rows in (0, 1, 63, 64, 154 * experts, 174 * experts, 4096 * experts):
                assert gc.default_config(gemm, rows, experts) in allowed


PROLOGUE_SCRIPT = textwrap.dedent(
    r"""
    import torch
    from weave_moe.backends.weave.kernels import grouped_tiles as gt

    H, NUM_SMS = 40, 4
    # rows per local expert: empty experts, one row, tails of one row and of half a tile, no rows at all
    CASES = [[5, 0, 21], [1], [17, 33, 16], [0, 0], [64, 65, 80]]
    KEYS = [((16, False),), ((16, False), (32, True)), ((32, False), (64, False))]
    for i, counts in enumerate(CASES):
        torch.manual_seed(i)
        offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
        offsets[1:] = torch.tensor(counts).cumsum(0)
        rows = int(offsets[-1])
        P = rows + 9
        src = torch.randn(P + 3, H).bfloat16()
        index = torch.randperm(P + 3)[:P].int()
        for keys in KEYS:
            for plan_c in (None, NUM_SMS, NUM_SMS - 1):  # no plan, a serial plan, a split plan
                plan = None if plan_c is None else torch.tensor([plan_c], dtype=torch.int32)
                on = plan_c is None or plan_c >= NUM_SMS
                dst = torch.full((P, H), float("nan")).bfloat16()
                tables = gt.grouped_prologue(offsets, keys, P, src, index, dst, 3, plan=plan, num_sms=NUM_SMS)
                assert sorted(tables) == sorted(keys), (tables.keys(), keys)
                # the same tables from rows per expert (form "counts", the paired decode call's)
                other, total = gt.empty_tile_tables(offsets, keys, P), torch.full((1,), -5, dtype=torch.int32)
                gt.fill_tile_tables(other, torch.tensor(counts, dtype=torch.int32), total, plan=plan, num_sms=NUM_SMS,
                                    form="counts")
                assert int(total) == (rows if on else 0), (counts, keys, plan_c, int(total))
                for key, got in other.items():
                    assert torch.equal(got.num_tiles, tables[key].num_tiles), (counts, keys, plan_c)
                    for section, n in enumerate(got.num_tiles.tolist()):
                        cols = slice(section * got.max_tiles, section * got.max_tiles + n)
                        assert torch.equal(got.table[:, cols], tables[key].table[:, cols]), (counts, plan_c)
                for (block_m, split_tail), got in tables.items():
                    ref = gt.build_tile_table_torch(offsets if on else torch.zeros_like(offsets), block_m, P,
                                                    split_tail)
                    assert torch.equal(got.num_tiles, ref.num_tiles), (counts, keys, plan_c, got.num_tiles)
                    for section, n in enumerate(ref.num_tiles.tolist()):
                        cols = slice(section * got.max_tiles, section * got.max_tiles + n)
                        assert torch.equal(got.table[:, cols], ref.table[:, cols]), (counts, keys, plan_c, section)
                n = rows if on else 0
                assert torch.equal(dst[:n], src[index[:n].long()]), (counts, keys, plan_c, "gathered rows")
                assert dst[n:].isnan().all(), (counts, keys, plan_c, "rows past the count were written")
    # the gather alone, its count read ahead of its wait or after it: one step per program, several, a partial one
    src = torch.randn(300, H).bfloat16()
    index = torch.randperm(300)[:250].int()
    for count in (0, 1, 47, 48, 49, 97, 250):
        for ready in (False, True):
            dst = torch.full((260, H), float("nan")).bfloat16()
            gt.gather_rows(src, index, dst, torch.tensor([count], dtype=torch.int32), 3, count_ready=ready)
            assert torch.equal(dst[:count], src[index[:count].long()]), (count, ready)
            assert dst[count:].isnan().all(), (count, ready, "rows past the count were written")
    for bad in [(), ((16, False), (16, False)), ((16, False), (32, False), (64, False))]:
        try:
            gt.grouped_prologue(offsets, bad, P, src, index, dst, 3)
        except ValueError as error:
            assert "distinct" in str(error)
        else:
            raise AssertionError(f"no error for tiles={bad}")
    print("GROUPED PROLOGUE INTERPRETER OK")
    """
)


@pytest.mark.parametrize("count_ready", [False, True])
def test_gather_loads_its_indices_before_its_wait_only_when_the_count_is_ready(count_ready):
    """The row gather (sync.pdl_ahead): with its count written on a joined stream it loads the count and its first
    indices before it waits for the launch before it (sm_90 PTX); otherwise, the launch before may be the one that
    writes the count, it waits first."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from weave_moe.backends.weave.kernels import grouped_tiles

    fn = grouped_tiles._gather_rows_kernel
    constants = dict(ROWS=16, BLOCK_H=512, COUNT_AHEAD=count_ready)
    signature = {name: "constexpr" if name in constants else ("*bf16" if name in ("src_ptr", "dst_ptr") else "*i32")
                 if name.endswith("_ptr") else "i32" for name in fn.arg_names}
    ptx = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    before = ptx[:ptx.index("griddepcontrol.wait")].count("ld.global")
    assert before == (1 + 16 if count_ready else 0), before   # the count, one index per row of the first step
    assert ".local" not in ptx


@pytest.mark.parametrize("top_k", [6, 8])
def test_scatter_rows_compiles_for_sm90_without_local_memory(top_k):
    """The copy by received row (KernelConfig.scatter_rows) compiled for sm_90 as a launch specialises it (DeepSeek-V3's
    H): it waits for the launch before it first (its tables come from it), holds no local memory, and stores each
    16-byte piece of a row it loads to its top-k pairs' rows (K vector stores per vector load)."""
    from weave_moe.backends.weave.kernels import grouped_tiles, sync

    H = 7168
    src, dst = torch.empty(100, H, dtype=torch.bfloat16), torch.empty(800, H, dtype=torch.bfloat16)
    words = torch.zeros(2000, dtype=torch.int32)
    args = (src, words[:800], words[:100 * top_k].view(100, top_k), dst, words[:40].view(10, 4), words[2:3],
            words[4:5], H)
    kwargs = dict(K=top_k, KP=8, TASK_WORDS=4, START=2, COUNT=3, ROWS=16, BLOCK_H=512, num_warps=8, **sync.LAUNCH)
    ptx = sm90.compile_for_sm90(grouped_tiles._scatter_rows_kernel, args, kwargs).asm["ptx"]
    assert ".local" not in ptx
    if sync.PDL:
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    loads, stores = ptx.count("ld.global.v4.b32"), ptx.count("st.global.v4.b32")
    assert loads and stores == top_k * loads, (loads, stores)


SCATTER_SCRIPT = textwrap.dedent(
    r"""
    import torch
    from weave_moe.backends.weave.kernels import grouped_tiles as gt
    from weave_moe.backends.weave.layout import COMBINE_COLUMNS, META_FIELDS, build_layout

    H, E, K = 40, 8, 3
    for world_size, tokens, seed in ((1, [9], 0), (2, [7, 5], 1), (2, [0, 6], 2), (1, [0], 3)):
        torch.manual_seed(seed)
        max_tokens = max(tokens) + 2
        all_ids = torch.full((world_size, max_tokens, K), -1, dtype=torch.int32)
        for r, t in enumerate(tokens):
            if t:
                all_ids[r, :t] = torch.stack([torch.randperm(E)[:K] for _ in range(t)]).int()
                all_ids[r, :t:3, 0] = -1   # some slots without an expert
        all_w = torch.rand(world_size, max_tokens, K)
        for rank in range(world_size):
            lay = build_layout(all_ids, all_w, torch.tensor(tokens), torch.ones(world_size, dtype=torch.long), rank,
                               E, hidden_size=H, intermediate_size=16, block_m=4, block_n0=8, block_n1=8,
                               dispatch_rows=3, combine_rows=3, reduce_rows=3)
            src = torch.randn(world_size * max_tokens, H).bfloat16()
            pairs = lay.expert_offsets[-1:].clone()
            num_tasks = lay.meta[META_FIELDS.index("num_combine_tasks"):][:1].clone()
            columns = (COMBINE_COLUMNS.index("start"), COMBINE_COLUMNS.index("count"))
            want = torch.full((lay.max_pairs + 2, H), float("nan")).bfloat16()
            gt.gather_rows(src, lay.gather_rows, want, pairs, 3)
            # one column block (H <= 512) and three (16 columns, the last partial), on 3, 5 and 8 programs: whole
            # tasks per item, or their blocks in groups of two (the last of one) or of one
            for count, block_h, programs in ((pairs, 512, 3), (pairs, 16, 3), (pairs, 16, 5), (pairs, 16, 8),
                                             (torch.zeros(1, dtype=torch.int32), 16, 8)):
                got = torch.full_like(want, float("nan"))
                gt.scatter_rows(src, lay.gather_rows, lay.combine_pos, got, lay.combine_tasks, num_tasks, count,
                                programs, *columns, block_h=block_h)
                n = int(count)
                assert torch.equal(got[:n], want[:n]), (world_size, tokens, rank, n, block_h, programs)
                assert got[n:].isnan().all(), (world_size, tokens, rank, n, "rows past the pairs were written")
    print("SCATTER ROWS INTERPRETER OK")
    """
)


def test_scatter_rows_writes_what_the_gather_writes_under_interpreter():
    """KernelConfig.scatter_rows: the received rows copied by row (each read once) into the pairs' rows, bit for bit
    the gather launch's result on the torch layout's tables, at EP = 1 and 2, with empty ranks and slots without an
    expert, items of one and of several column blocks; nothing when the count is 0."""
    run_interpreted(SCATTER_SCRIPT, "SCATTER ROWS INTERPRETER OK", timeout=600)


def test_grouped_prologue_under_interpreter():
    """The grouped GEMMs' one-launch prologue: tile tables equal build_tile_table_torch's, rows gathered bitwise,
    rows past the count untouched; under a split plan nothing at all (no tile, no row); the tables made from rows per
    expert (`fill_tile_tables(form="counts")`) equal those made from their prefix sum. The gather alone too, with
    its count read before or after its wait, over one, several and partial steps of its programs."""
    run_interpreted(PROLOGUE_SCRIPT, "GROUPED PROLOGUE INTERPRETER OK", timeout=600)
