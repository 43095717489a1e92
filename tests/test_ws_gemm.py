"""The warp-specialised Gluon grouped GEMMs (kernels/ws_gemm.py) on the CPU: their configs and argument checks, and
the kernels compiled for sm_90 exactly as a launch specialises them (Gluon has no interpreter: what runs is checked
on a GPU by scripts/ws_gemm_probe.py). The PTX must hold the split the module describes: a producer that issues the
TMA loads and gives its registers back, consumers that issue wgmma as wide as the tile and wait only on mbarriers and
on their own warps, no local memory, shared memory within Hopper's."""

import re

import pytest
import torch

from weave_moe.backends.weave.kernels import sm90
from weave_moe.backends.weave.kernels import ws_gemm as ws
from weave_moe.backends.weave.kernels.grouped_tiles import build_tile_table_torch
from ws_operands import operands

#: Hopper's shared memory per CTA (227 KB)
HOPPER_SHARED = 232448


def _operands(gemm, hidden, inter, rows=512, experts=2, block_m=128, split_tail=False, scale=False):
    return operands(gemm, hidden, inter, rows, block_m, split_tail, experts, scale)


def test_configs_refuse_what_cannot_run():
    ws.WsConfig()
    assert (ws.WsConfig().registers, ws.WsConfig(block_m=64, num_warps=4).registers,
            ws.WsConfig(block_n=128, num_warps=4, consumers=2).registers) == (168, 248, 168)
    parts = ws.WsConfig(block_m=192, block_n=128, num_warps=4)   # three row parts: 16 warps, 128 registers each
    assert (parts.row_parts, parts.warps, parts.registers, parts.part_regs) == (3, 16, 128, 152)
    assert ws.WsConfig.parse(parts.short) == parts and ws.WsConfig().row_parts == 1
    halves = ws.WsConfig.parse("128x256x64w4s4h")   # two row parts: 12 warps, 168 registers; a 64x256 accumulator
    assert (halves.row_parts, halves.warps, halves.registers, halves.part_regs) == (2, 12, 168, 232)
    assert halves.row_split and halves.short == "128x256x64w4s4h" and str(halves).endswith(" halves")
    grouped = ws.WsConfig.parse("192x128x64w4s4g2")   # group_m in the compact name where not the default
    assert grouped.group_m == 2 and grouped.short == "192x128x64w4s4g2" and " g2 " in str(grouped)
    for bad, message in ((dict(block_m=32), "block_m"), (dict(block_n=512), "block_n"), (dict(num_warps=2), "warps"),
                         (dict(stages=1), "stages"), (dict(producer_regs=30), "producer_regs"),
                         (dict(maxnreg=200), "registers of an SM"), (dict(consumers=3), "consumers"),
                         (dict(consumers=2), "ping-pong"), (dict(consumer_regs=300), "consumer_regs"),
                         (dict(block_m=128, block_n=256, num_warps=4), "accumulator"),
                         (dict(block_m=64, num_warps=4, split_tail=True), "split_tail"),
                         (dict(block_n=128, num_warps=4, consumers=2, split_tail=True), "split_tail"),
                         (dict(block_m=256, num_warps=4), "block_m"),
                         (dict(block_m=192, block_n=128, num_warps=8), "192-row tiles"),
                         (dict(block_m=192, block_n=128, num_warps=4, split_tail=True), "192-row tiles"),
                         (dict(block_m=192, block_n=256, num_warps=4, stages=3), "block_n=128"),
                         (dict(block_m=192, block_n=128, num_warps=4, stages=6), "shared memory"),
                         (dict(block_m=64, num_warps=4, row_split=True), "row_split"),
                         (dict(block_m=128, num_warps=8, row_split=True), "128-row tiles are 2 consumers")):
        with pytest.raises(ValueError, match=message):
            ws.WsConfig(**bad)


def test_launch_arguments_are_checked():
    a, w, out, tiles, _ = _operands(0, 256, 128)
    config = ws.WsConfig()
    for args, message in (((2, a, w, out, tiles), "gemm"),
                          ((0, a.float(), w, out, tiles), "a: expected contiguous bf16"),
                          ((0, a, w[:, :8], out, tiles), "w: expected"),
                          ((0, a, w, out[:, :8], tiles), "out: expected"),
                          ((0, a, w, out, build_tile_table_torch(torch.tensor([0, 256, 512], dtype=torch.int32),
                                                                 64, 512, False)), "block_m = 128")):
        with pytest.raises(ValueError, match=message):
            ws.ws_launch(*args, config, num_sms=4)
    with pytest.raises(ValueError, match="GEMM1 only"):
        ws.ws_launch(0, a, w, out, tiles, config, scale=torch.empty(512), num_sms=4)
    h, w2, y, tiles, _ = _operands(1, 256, 128)
    with pytest.raises(ValueError, match="scale: expected fp32"):
        ws.ws_launch(1, h, w2, y, tiles, config, scale=torch.empty(8), num_sms=4)


CASES = [  # (gemm, config, H, I, scale): DeepSeek-V3's and Qwen3-30B-A3B's shapes
    (0, ws.WsConfig(), 7168, 2048, False),
    (1, ws.WsConfig(), 7168, 2048, True),
    (1, ws.WsConfig(stages=3), 7168, 2048, False),
    (0, ws.WsConfig(block_m=64, num_warps=4), 2048, 768, False),
    (0, ws.WsConfig(block_n=128, num_warps=4, consumers=2), 7168, 2048, False),
    (1, ws.WsConfig(block_n=128, num_warps=4, consumers=2, stages=5), 2048, 768, True),
    (0, ws.WsConfig(split_tail=True), 7168, 2048, False),
    (1, ws.WsConfig(split_tail=True, stages=3), 2048, 768, True),
    (1, ws.WsConfig(block_m=64, block_n=128, num_warps=8), 2048, 768, True),
    (0, ws.WsConfig(block_n=128, block_k=128, stages=3), 2048, 768, False),
    (0, ws.WsConfig(block_m=192, block_n=128, num_warps=4, stages=5), 5120, 1536, False),   # DeepSeek-V2's
    (1, ws.WsConfig(block_m=192, block_n=128, num_warps=4, stages=3), 5120, 1536, True),
    (0, ws.WsConfig(num_warps=4, row_split=True), 7168, 2048, False),   # two row parts of 64x256
    (1, ws.WsConfig(num_warps=4, row_split=True, stages=3), 7168, 2048, True),
]


@pytest.mark.parametrize("gemm,config,hidden,inter,scale", CASES, ids=lambda v: str(v))
def test_kernels_compile_for_hopper_as_warp_specialised_pipelines(gemm, config, hidden, inter, scale, tmp_path):
    a, w, out, tiles, scale_t = _operands(gemm, hidden, inter, block_m=config.block_m, scale=scale,
                                          split_tail=config.split_tail)
    kernel, grid, args, kwargs = ws.ws_launch(gemm, a, w, out, tiles, config, scale=scale_t, num_sms=132)
    assert grid == (132, )
    compiled = sm90.compile_for_sm90(kernel, args, kwargs)
    ptx = compiled.asm["ptx"]
    # the producer's loads: A and W through the bulk tensor copy engine, completing the stage's mbarrier (a block
    # row of more than the 128-byte swizzle is copied as several boxes; row parts: an A box each)
    boxes = max(1, 2 * config.block_k // 128)
    loads = (config.row_parts + 1) * boxes * (2 if config.split_tail else 1)   # the tails': their own instructions
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx") == loads
    # the partitions' registers: the producer's warpgroup gives registers back, the consumer takes them
    counts = {int(v) for v in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx)}
    assert config.producer_regs in counts and max(counts) > config.producer_regs, counts
    # the consumer's MMAs: one wgmma as wide as a warpgroup's columns per k16 step
    # per tile height (the tails: half of it), the warpgroups over rows first, then over columns
    expected = {}
    for rows in (config.block_m, config.block_m // 2) if config.split_tail else (config.block_m, ):
        warps_n = 2 if (rows, config.num_warps) == (64, 8) else 1
        rows_per_warpgroup = rows // config.row_parts // max(1, config.num_warps // 4 // warps_n)
        # per consumer (each row part its own): BLOCK_K / 16 steps, each over the warpgroup's rows in m64 slices
        expected[f"m64n{config.block_n // warps_n}k16"] = config.block_k // 16 * (rows_per_warpgroup // 64)
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)
    assert {shape: shapes.count(shape) for shape in set(shapes)} == {
        shape: count * config.consumers * config.row_parts for shape, count in expected.items()}
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    # no CTA-wide barrier in the loops: the partitions meet only through mbarriers and named barriers of their own
    # warps (`bar.sync 0, <threads>`), after the start (`barrier.sync 1`, the warp-specialize dispatch)
    assert not re.search(r"\bbar\.sync\s+\d+;", ptx), "a CTA-wide bar.sync"
    assert not re.search(r"\.local\b", ptx), "local memory"
    assert 0 < compiled.metadata.shared <= HOPPER_SHARED, compiled.metadata.shared
    report = sm90.ptxas_report(ptx, tmp_path)
    assert "0 bytes stack frame" in report and "0 bytes spill stores" in report, report


def _layer_ws_configs():
    """(gemm, config, H, I): every Gluon config a layer may compile without a table (gemm_configs.default_configs
    with the Gluon kernels) on Qwen3-30B-A3B's shape, and every Gluon config of the shipped tuned tables (192-row
    tiles among them) on its own shape."""
    from weave_moe.backends.weave.kernels import gemm_configs as gc

    found = [(gemm, config, 2048, 768) for gemm in (0, 1) for config in gc.default_configs(gemm, warp_specialized=True)
             if not isinstance(config, gc.GemmConfig)]
    for path in sorted(gc.TUNED_DIR.glob("*.json")):
        for (gemm, _, hidden, inter), buckets in gc.load_tuned_table(path)["shapes"].items():
            found += [(gemm, entry.config, hidden, inter) for entry in buckets.values()
                      if isinstance(entry.config, ws.WsConfig)]
    return list(dict.fromkeys(found))


@pytest.mark.parametrize("gemm,config,hidden,inter", _layer_ws_configs(), ids=lambda v: str(v))
def test_every_gluon_config_a_layer_may_pick_compiles_without_spills(gemm, config, hidden, inter, tmp_path):
    """What the layer compiles before its first call on an sm_90 GPU (the rule's configs, the shipped tables'),
    compiled here for sm_90 as launched on its shape: no stack frame, no spills, shared memory within Hopper's."""
    from weave_moe.backends.weave.kernels import ws_decode

    if isinstance(config, ws_decode.WsDecodeConfig):
        a, w, out, tiles, scale = _operands(gemm, hidden, inter, block_m=config.block_t, scale=gemm == 1)
        kernel, _, args, kwargs = ws_decode.ws_decode_launch(gemm, a, w, out, tiles, config, scale=scale,
                                                             num_sms=132)
    else:
        a, w, out, tiles, scale = _operands(gemm, hidden, inter, block_m=config.block_m, scale=gemm == 1,
                                            split_tail=config.split_tail)
        kernel, _, args, kwargs = ws.ws_launch(gemm, a, w, out, tiles, config, scale=scale, num_sms=132)
    compiled = sm90.compile_for_sm90(kernel, args, kwargs)
    assert 0 < compiled.metadata.shared <= HOPPER_SHARED, compiled.metadata.shared
    report = sm90.ptxas_report(compiled.asm["ptx"], tmp_path)
    assert "0 bytes stack frame" in report and "0 bytes spill stores" in report, report


def test_launch_gemm_runs_each_config_on_its_kernel(monkeypatch):
    """grouped_gemm.launch_gemm: a WsConfig on ws_gemm's kernels, a WsDecodeConfig on ws_decode's, a GemmConfig on
    the Triton ones with the launch options (which the Gluon kernels take none of); gather rows for Triton and for a
    WsConfig that `gathers`, never for the decode form or one that does not."""
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels import grouped_gemm as gg
    from weave_moe.backends.weave.kernels import ws_decode

    calls = []
    for module, names in ((ws, ("ws_gemm0", "ws_gemm1")), (ws_decode, ("ws_decode_gemm0", "ws_decode_gemm1")),
                          (gg, ("grouped_gemm0", "grouped_gemm1"))):
        for name in names:
            monkeypatch.setattr(module, name, lambda *args, name=name, **options: calls.append((name, options)))
    triton, wide, decode = gc.analytical_config(0, 4096, 8), ws.DEFAULT_CONFIG, ws_decode.WsDecodeConfig()
    for gemm in (0, 1):
        for config in (triton, wide, decode):
            gg.launch_gemm(gemm, config, "a", "w", "out", "tiles", pdl=True)
    plain = dict(chained=False)
    assert calls == [("grouped_gemm0", dict(gather=None, pdl=True)), ("ws_gemm0", dict(gather=None, chained=False)),
                     ("ws_decode_gemm0", dict(chained=False, preload=False)), ("grouped_gemm1", dict(pdl=True)),
                     ("ws_gemm1", plain), ("ws_decode_gemm1", plain)]
    calls.clear()
    gg.launch_gemm(0, wide, "a", "w", "out", "tiles", gather="rows")
    gg.launch_gemm(1, decode, "a", "w", "out", "tiles", chained=True)
    gg.launch_gemm(0, decode, "a", "w", "out", "tiles", chained=True, preload=True)
    assert calls == [("ws_gemm0", dict(gather="rows", chained=False)), ("ws_decode_gemm1", dict(chained=True)),
                     ("ws_decode_gemm0", dict(chained=True, preload=True))]
    with pytest.raises(ValueError, match="not chained"):
        gg.launch_gemm(1, triton, "a", "w", "out", "tiles", chained=True)
    for config in (decode, ws.WsConfig(split_tail=True), ws.WsConfig(block_n=128, num_warps=4, consumers=2)):
        with pytest.raises(ValueError, match="expert order"):
            gg.launch_gemm(0, config, "a", "w", "out", "tiles", gather="rows")
    assert [gc.kernel_of(c) for c in (triton, wide, decode)] == ["triton", "ws", "ws_decode"]
    with pytest.raises(TypeError, match="not a grouped-GEMM configuration"):
        gc.kernel_of("128x256")


def test_k_blocked_weights_compile_and_refuse_the_plain_layout(tmp_path):
    """WsConfig.k_blocked (a probe of the weights' DRAM access pattern): `block_weights` puts each K step's W block in
    one contiguous run; the kernel compiles for sm_90 on it without spills, and a launch refuses weights in the plain
    layout (and the other way round) naming the operand; no layer's table may hold such a config."""
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels.ws_ring import block_weights

    w = torch.randn(3, 8, 256)
    blocked = block_weights(w, 64)
    assert blocked.shape == (3, 4, 8, 64) and blocked.is_contiguous()
    assert torch.equal(blocked[1, 2, 5], w[1, 5, 128:192])
    with pytest.raises(ValueError, match="multiple of block_k"):
        block_weights(w, 96)
    config = ws.WsConfig.parse("64x256x64w4s4b")
    assert config.k_blocked and config.short == "64x256x64w4s4b"
    a, w13, h, tiles, _ = _operands(0, 2048, 768, block_m=64)
    with pytest.raises(ValueError, match="K-blocked layout"):
        ws.ws_launch(0, a, w13, h, tiles, config, num_sms=132)
    with pytest.raises(ValueError, match="w: expected"):
        ws.ws_launch(0, a, block_weights(w13, 64), h, tiles, ws.WsConfig(block_m=64, num_warps=4), num_sms=132)
    kernel, grid, args, kwargs = ws.ws_launch(0, a, block_weights(w13, 64), h, tiles, config, num_sms=132)
    compiled = sm90.compile_for_sm90(kernel, args, kwargs)
    report = sm90.ptxas_report(compiled.asm["ptx"], tmp_path)
    assert "0 bytes stack frame" in report and "0 bytes spill stores" in report, report
    with pytest.raises(ValueError, match="k_blocked"):
        gc.parse_ws_config("64x256x64w4s4b")


def test_the_probe_times_a_shapes_variants_in_interleaved_rounds():
    """scripts/ws_gemm_probe.py's `time_in_rounds`: every variant once per round, in the bench's rotating order, the
    median over rounds; only round 0's first variant is marked for the second timing (the first-timed artifact)."""
    import importlib.util
    from pathlib import Path

    from weave_moe.bench.harness import round_orders

    path = Path(__file__).resolve().parent.parent / "scripts" / "ws_gemm_probe.py"
    spec = importlib.util.spec_from_file_location("ws_gemm_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    calls, clock = [], iter(range(100))

    def time_once(item, first):
        calls.append((item, first))
        return float(next(clock)) + (10.0 if item == "b" else 0.0)
    medians = probe.time_in_rounds(["a", "b", "c"], 3, time_once)
    assert [item for item, _ in calls] == ["abc"[i] for order in round_orders(3, 3) for i in order]
    assert [first for _, first in calls] == [True] + [False] * 8
    times = {item: [] for item in "abc"}
    for tick, (item, _) in enumerate(calls):
        times[item].append(tick + (10.0 if item == "b" else 0.0))
    assert medians == [sorted(times[item])[1] for item in "abc"]


def test_the_probes_configs_parse():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "ws_gemm_probe.py"
    spec = importlib.util.spec_from_file_location("ws_gemm_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    configs = [probe.parse_config(text) for text in probe.DEFAULT_CONFIGS.split(",")]
    assert configs[0] == ws.WsConfig()
    assert probe.parse_config("64x128x64w4s5p24r232") == ws.WsConfig(block_m=64, block_n=128, num_warps=4, stages=5,
                                                                      producer_regs=24, maxnreg=232)
    assert probe.parse_config("128x128x64w4s4c2") == ws.WsConfig(block_n=128, num_warps=4, consumers=2)
    assert probe.parse_config("128x256x64w8s4t") == ws.WsConfig(split_tail=True)
    with pytest.raises(ValueError, match="expected e.g."):
        probe.parse_config("128x256")
    from weave_moe.backends.weave.kernels.ws_decode import WsDecodeConfig

    decode = [probe.parse_decode_config(text) for text in probe.DEFAULT_DECODE_CONFIGS.split(",")]
    assert decode[0] == WsDecodeConfig()
    assert probe.parse_decode_config("t8w64k128s6p24") == WsDecodeConfig(block_t=8, stages=6, producer_regs=24)
    with pytest.raises(ValueError, match="expected e.g."):
        probe.parse_decode_config("16x64")


def test_default_config_takes_the_weight_streaming_sizes_only():
    """KernelConfig.ws_gemm's prefill config: 64x256x64 over one warpgroup from 64 to 256 rows per expert on average
    (where it measured faster on an H100); none below (decode sizes: kernels/ws_decode.py) or above (the Triton
    kernels as fast or faster)."""
    assert ws.default_config(0, 63 * 64, 64) is None and ws.default_config(1, 8, 64) is None
    assert ws.default_config(0, 128 * 128, 128) == ws.DEFAULT_CONFIG == ws.WsConfig(block_m=64, num_warps=4)
    assert ws.default_config(1, 256 * 80, 80) == ws.DEFAULT_CONFIG
    assert ws.default_config(0, 257 * 80, 80) is None and ws.default_config(1, 1024 * 64, 64) is None
    assert ws.default_configs() == (ws.DEFAULT_CONFIG, )


class _MBarrier:
    """An mbarrier of arrival count `count`: `wait(parity)` passes once the phase of that parity has completed, i.e.
    while the phase in progress has the other parity (a fresh barrier: phase 0 in progress, so parity 1 passes)."""

    def __init__(self, count: int = 1):
        self.completions, self.count, self.arrivals = 0, count, 0

    def arrive(self):
        self.arrivals += 1
        if self.arrivals == self.count:
            self.completions, self.arrivals = self.completions + 1, 0

    def passes(self, parity: int) -> bool:
        return self.completions % 2 != parity


def _simulate(stages: int, consumers: int, items: int, k_steps: int, seed: int, gather_threads: int = 0,
              chained: bool = False, early: int | None = None, parts: int = 1,
              empty_arrivals: int | None = None) -> None:
    """The ring protocol of kernels/ws_ring.py (with ws_gemm.py's turns), its step, stage and phase arithmetic, the
    producer and the consumers interleaved at random: every consumer step must read the stage the producer filled for
    that step, and the producer must never refill a stage an unfinished MMA still reads. Each agent is a generator
    that yields the condition it waits on. A stage's copies land later, one at a time in random order (a `memory`
    agent): the W block, and the A block or, with `gather_threads`, one part per producer thread (their
    cp.async.mbarrier.arrive.noinc); `ready` completes when all of a step's parts have landed. `chained`: the
    producer issues its first item's first min(stages, k_steps) W blocks, then waits for the kernel before (which
    ends at a random moment) before any A block ("Chained launches"); `early` overrides that count (to break it).
    `parts` > 1 (one consumer per row part, every item; ws_ring "Row parts"): each item has 1 to `parts` parts with
    rows (at random), whose A blocks the producer copies; a part without rows waits on `ready` and releases the stage
    at once; `empty` counts `parts` arrivals (`empty_arrivals` overrides that, to break it)."""
    import random

    rng = random.Random(seed)
    ready, empty = [_MBarrier() for _ in range(stages)], [_MBarrier(empty_arrivals or parts) for _ in range(stages)]
    active = [rng.randint(1, parts) for _ in range(items)]   # row parts with rows, per item
    turn = [_MBarrier() for _ in range(consumers)]   # ping-pong: the mainloops take turns
    if parts > 1:   # an A block per row part: part names per item
        names = [["w"] + [f"a{p}" for p in range(n)] for n in active]
    else:
        names = [["w"] + ([f"a{t}" for t in range(gather_threads)] if gather_threads else ["a"])] * items
    contents = [{} for _ in range(stages)]   # part -> the step whose block a stage holds
    pending = [0] * stages                   # parts of the stage's phase in progress not yet landed
    in_transit = []                          # (stage, part, step) issued, not landed
    reading = [set() for _ in range(stages)]   # in-flight MMAs (consumer, step) reading each stage
    consumed = []
    previous = {"ended": False}                # the kernel before a chained launch

    def issue(stage, step, names):
        for name in names:
            in_transit.append((stage, name, step))
            pending[stage] += 1

    def memory():
        while True:
            yield lambda: bool(in_transit) or not previous["ended"] or finished()
            if not previous["ended"] and (not in_transit or rng.random() < 0.2):
                previous["ended"] = True
                continue
            if not in_transit:
                return
            stage, name, step = in_transit.pop(rng.randrange(len(in_transit)))
            contents[stage][name] = step
            pending[stage] -= 1
            if pending[stage] == 0 and all(contents[stage].get(n) == step for n in names[step // k_steps]):
                ready[stage].completions += 1

    def producer():
        step, first = 0, (min(stages, k_steps) if early is None else early) if chained and items else 0
        for i in range(first):   # the fresh ring's first phase: no `empty` to wait for
            issue(i % stages, i, ["w"])
        if chained:
            yield lambda: previous["ended"]   # griddepcontrol.wait
            for i in range(first):
                issue(i % stages, i, [p for p in names[0] if p != "w"])
        for item in range(items):
            for k in range(k_steps):
                if item == 0 and k < first:
                    step += 1
                    continue
                stage = step % stages
                yield lambda s=stage, p=((step // stages) & 1) ^ 1: empty[s].passes(p)
                assert not reading[stage], f"step {step} refills stage {stage} under an MMA: {reading[stage]}"
                assert chained is False or previous["ended"], "an A block loaded before the kernel before ended"
                issue(stage, step, names[item])
                step += 1

    def consumer(which):
        in_flight = []   # (stage, step) of this consumer's MMA groups not yet waited for
        # the CTA's item indices: alternate ones (ping-pong), or every one (row part `which`)
        for index in range(which, items, consumers) if parts == 1 else range(items):
            step = index * k_steps
            if consumers == 2:   # the other consumer's mainloops of the items before this one
                yield lambda turns=index // 2 + which: turns == 0 or turn[which].passes((turns - 1) & 1)
            if parts > 1 and which >= active[index]:   # a row part without rows: `_pass_tile`
                for k in range(k_steps):
                    stage = step % stages
                    yield lambda s=stage, p=(step // stages) & 1: ready[s].passes(p)
                    empty[stage].arrive()
                    step += 1
                continue
            reads = ["w", f"a{which}"] if parts > 1 else names[index]
            for k in range(k_steps):
                stage = step % stages
                yield lambda s=stage, p=(step // stages) & 1: ready[s].passes(p)
                assert all(contents[stage].get(n) == step for n in reads), \
                    f"consumer {which} reads {contents[stage]} as step {step}"
                reading[stage].add((which, step))
                in_flight.append((stage, step))
                while len(in_flight) > 1:   # warpgroup_mma_wait(1)
                    done_stage, done_step = in_flight.pop(0)
                    reading[done_stage].discard((which, done_step))
                if k > 0:
                    empty[(step + stages - 1) % stages].arrive()
                if which == 0 or parts == 1:   # (part 0 always has rows)
                    consumed.append(step)
                step += 1
            if consumers == 2:
                turn[1 - which].completions += 1
            for done_stage, done_step in in_flight:   # warpgroup_mma_wait(0)
                reading[done_stage].discard((which, done_step))
            in_flight.clear()
            empty[(step + stages - 1) % stages].arrive()
            yield lambda: True   # the epilogue

    workers = [producer()] + [consumer(c) for c in range(consumers if parts == 1 else parts)]

    def finished():
        return not any(agent in agents for agent in workers)

    agents = workers + [memory()]
    waits = {id(agent): (lambda: True) for agent in agents}
    while agents:
        runnable = [agent for agent in agents if waits[id(agent)]()]
        assert runnable, "deadlock"
        agent = rng.choice(runnable)
        try:
            waits[id(agent)] = next(agent)
        except StopIteration:
            agents.remove(agent)
    assert sorted(consumed) == list(range(items * k_steps))


@pytest.mark.parametrize("stages,consumers", [(2, 1), (3, 1), (4, 1), (2, 2), (4, 2), (5, 2)])
def test_the_ring_protocol_neither_deadlocks_nor_races(stages, consumers):
    for seed in range(40):
        for items, k_steps in ((1, 1), (3, 1), (5, 3), (7, 9)):
            _simulate(stages, consumers, items, k_steps, seed)


@pytest.mark.parametrize("stages,consumers,gather_threads,chained", [
    (4, 1, 4, False), (2, 1, 3, False),                  # gathered A: one part per producer thread (GEMM0)
    (4, 1, 0, True), (2, 1, 0, True), (8, 1, 0, True),   # chained GEMM1 (the decode form's 8 stages too)
    (4, 2, 0, True)])
def test_the_ring_protocol_with_gathered_rows_and_chained_launches(stages, consumers, gather_threads, chained):
    """The same simulation with the copies landing out of order: gathered A rows (`ready` waits for every producer
    thread's part) and a chained launch (the first W blocks before the wait for the kernel before, their A blocks
    after it, more steps than stages or fewer)."""
    for seed in range(30):
        for items, k_steps in ((1, 1), (3, 2), (5, 3), (4, 11)):
            _simulate(stages, consumers, items, k_steps, seed, gather_threads, chained)


@pytest.mark.parametrize("stages,parts,chained", [(2, 3, False), (3, 3, False), (4, 3, False), (4, 2, False),
                                                  (3, 3, True)])
def test_the_ring_protocol_with_row_parts(stages, parts, chained):
    """192-row tiles (ws_ring, "Row parts"): every consumer reads every stage's W block and its own A block; parts
    without rows in an item only pass its stages on; `empty` completes once all parts have released a stage."""
    for seed in range(30):
        for items, k_steps in ((1, 1), (3, 2), (5, 3), (4, 11)):
            _simulate(stages, 1, items, k_steps, seed, chained=chained, parts=parts)


def test_the_ring_simulation_fails_on_a_broken_protocol():
    """The simulation can fail: a chained producer that pre-issues one stage more than the ring holds refills a stage
    whose first phase has not been consumed (its parts then mix two steps, or its phase never completes)."""
    with pytest.raises(AssertionError):
        for seed in range(10):
            _simulate(2, 1, 3, 5, seed, 0, True, early=3)
    # row parts whose `empty` completes on one part's arrival: a stage is refilled under another part's MMA
    with pytest.raises(AssertionError):
        for seed in range(10):
            _simulate(3, 1, 4, 6, seed, parts=3, empty_arrivals=1)


def test_the_probes_small_checks_report_every_config_from_child_processes():
    """scripts/ws_gemm_probe.py checks its candidates in child processes first, each named with its verdict (here,
    without a GPU, every one fails to run: the verdicts say so, and a config that does not parse is one of them)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "ws_gemm_probe.py"
    spec = importlib.util.spec_from_file_location("ws_gemm_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    texts = ["128x256x64w8s4", "bad"]
    results = probe.smoke_all(texts, decode=False, timeout_s=120)
    assert sorted(results) == sorted(texts)
    assert all(verdict.startswith("FAIL") for verdict in results.values()), results
    assert "expected e.g." in results["bad"]


def test_ptx_fingerprints_ignore_debug_info_and_see_instructions():
    """scripts/ptx_fingerprint.py: the fingerprint ignores line records, comments and the inlined-call labels, sees an
    instruction change; this tree against HEAD's: the same kernels (a child process on `git archive HEAD`)."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "ptx_fingerprint.py"
    spec = importlib.util.spec_from_file_location("ptx_fingerprint", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    ptx = "\n".join(["$L__tmp1:", "\t.loc 1 2 3", "\tmov.u32 %r1, 0;", "\t// comment", "\tbra $L__tmp1;",
                      ".section .debug_info {", ".b8 1", "}"])
    moved = ptx.replace("$L__tmp1", "$L__tmp7").replace(".loc 1 2 3", ".loc 1 9 9").replace(".b8 1", ".b8 2")
    assert probe.fingerprint(ptx) == probe.fingerprint(moved)
    assert probe.fingerprint(ptx) != probe.fingerprint(ptx.replace("mov.u32 %r1, 0", "mov.u32 %r1, 1"))
    root = path.parent.parent
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    result = subprocess.run([sys.executable, str(path), "--configs", "t16w64k128s8", "--against", "HEAD"],
                            capture_output=True, text=True, cwd=root, timeout=600)
    assert "GEMM0 t16w64k128s8" in result.stdout, result.stdout + result.stderr
    if result.returncode:   # the working tree's kernels differ from HEAD's (uncommitted GPU code): say so, not fail
        assert "CHANGED" in result.stdout


def test_stream_probe_reads_every_weight_block_once_in_both_layouts():
    """scripts/stream_probe.py under the interpreter: one pass over small weights, in the layer's layout and the
    K-blocked one, two block shapes, reads every block once (its checksum equals torch's sum)."""
    from pathlib import Path

    from interpreter import run_interpreted

    script = f"""
import importlib.util, torch
spec = importlib.util.spec_from_file_location("stream_probe", {str(Path(__file__).resolve().parent.parent / "scripts" / "stream_probe.py")!r})
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
torch.manual_seed(0)
w = torch.randn(3, 128, 256).bfloat16()
expected = torch.sum(w, dtype=torch.float32).item()
for block_n, block_k in ((64, 64), (32, 128)):
    for blocked in (False, True):
        sums = torch.zeros(4)
        probe.stream(probe.block_weights(w, block_k) if blocked else w, block_n, block_k, blocked, 4, sums, stages=2)
        assert abs(sums.sum().item() - expected) < 1e-2, (block_n, block_k, blocked, sums.sum().item(), expected)
print("STREAM OK")
"""
    run_interpreted(script, "STREAM OK")


GATHER_CASES = [  # (config, H, I): the rule's config and a two-warpgroup one, DeepSeek-V2's and Qwen3-30B-A3B's shapes
    (ws.DEFAULT_CONFIG, 5120, 1536),
    (ws.WsConfig(), 2048, 768),
    (ws.WsConfig.parse("64x256x128w4s2"), 5120, 1536),
    (ws.WsConfig.parse("192x128x64w4s4"), 5120, 1536),   # row parts: the producer copies each part's rows
    (ws.WsConfig.parse("128x256x64w4s3h"), 5120, 1536),
]


@pytest.mark.parametrize("config,hidden,inter", GATHER_CASES, ids=lambda v: str(v))
def test_gathered_gemm0_copies_rows_with_cp_async_tracked_on_the_ready_barrier(config, hidden, inter, tmp_path):
    """GEMM0 through gather rows (`ws_launch(gather=)`, ws_ring "Gathered A rows"), compiled for sm_90 as launched:
    the producer warpgroup copies A in 16-byte cp.async (no TMA for A, W's still through TMA) and each of its threads
    arrives on `ready` with cp.async.mbarrier.arrive.noinc, `ready` counting those 128 arrivals and the W copy's
    expect; the consumer fences the async proxy after its wait on `ready`; no spills, no local memory."""
    from weave_moe.backends.weave.kernels.ws_ring import GATHER_WARPS

    _, w, out, tiles, _ = _operands(0, hidden, inter, block_m=config.block_m)
    source = torch.empty(3 * out.shape[0], hidden, dtype=torch.bfloat16)   # the receive buffer: any rows
    gather = torch.empty(out.shape[0], dtype=torch.int32)
    kernel, _, args, kwargs = ws.ws_launch(0, source, w, out, tiles, config, num_sms=132, gather=gather)
    compiled = sm90.compile_for_sm90(kernel, args, kwargs)
    ptx = compiled.asm["ptx"]
    threads = 32 * GATHER_WARPS.value
    copies = config.block_m * config.block_k * 2 // 16 // threads   # 16-byte copies per thread and K step
    assert len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)) == copies
    assert ptx.count("cp.async.mbarrier.arrive.noinc.shared.b64") == 1
    # W only (its boxes, where a row is wider than the 128-byte swizzle, spread over the warpgroup's warps)
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx") == 1
    inits = re.findall(r"mbarrier\.init\.shared::cta\.b64 \[[^]]*\], (\d+);", ptx)
    assert inits.count(str(1 + threads)) == config.stages, inits   # each stage's `ready`
    assert ptx.count("fence.proxy.async.shared::cta") >= 1
    assert re.search(r"mbarrier\.try_wait\.parity[^\n]*\n(?:[^\n]*\n){0,8}?\s*fence\.proxy\.async\.shared::cta", ptx)
    assert not re.search(r"\.local\b", ptx), "local memory"
    assert 0 < compiled.metadata.shared <= HOPPER_SHARED, compiled.metadata.shared
    report = sm90.ptxas_report(ptx, tmp_path)
    assert "0 bytes stack frame" in report and "0 bytes spill stores" in report, report


def test_gathered_launches_are_checked():
    """A gathered launch: GEMM0 only, a config that `gathers`, int32 contiguous rows; the source rows' count is free
    (the receive buffer), their width must be H."""
    _, w, out, tiles, _ = _operands(0, 256, 128)
    source = torch.empty(700, 256, dtype=torch.bfloat16)
    rows = torch.empty(512, dtype=torch.int32)
    ws.ws_launch(0, source, w, out, tiles, ws.WsConfig(), num_sms=4, gather=rows)   # accepted
    for args, config, gather, message in (
            ((0, source, w, out, tiles), ws.WsConfig(), rows.long(), "gather: expected contiguous int32"),
            ((0, source, w, out, tiles), ws.WsConfig(), rows[::2], "gather: expected contiguous int32"),
            ((0, source[:, :128], w, out, tiles), ws.WsConfig(), rows, "a: expected"),
            ((0, source, w, out, build_tile_table_torch(torch.tensor([0, 256, 512], dtype=torch.int32), 128, 512,
                                                         True)), ws.WsConfig(split_tail=True), rows, "no split"),
            ((0, source, w, out, tiles), ws.WsConfig(block_n=128, num_warps=4, consumers=2), rows, "one consumer")):
        with pytest.raises(ValueError, match=message):
            ws.ws_launch(*args, config, num_sms=4, gather=gather)
    h, w2, y, tiles, _ = _operands(1, 256, 128)
    with pytest.raises(ValueError, match="GEMM0"):
        ws.ws_launch(1, h, w2, y, tiles, ws.WsConfig(), num_sms=4, gather=rows)


CHAIN_CASES = [ws.DEFAULT_CONFIG, ws.WsConfig(split_tail=True), ws.WsConfig(block_n=128, num_warps=4, consumers=2),
               ws.WsConfig(block_m=192, block_n=128, num_warps=4), ws.WsConfig(num_warps=4, row_split=True, stages=3),
               "t16w64k128s8"]


@pytest.mark.parametrize("config", CHAIN_CASES, ids=str)
def test_chained_gemms_start_gemm1_early_and_wait_before_reading_h(config, tmp_path):
    """KernelConfig.ws_chain (kernels/ws_ring.py, "Chained launches"), compiled for sm_90 as launched: GEMM0 says
    `griddepcontrol.launch_dependents` and is a plain launch; GEMM1 is launched programmatically and its producer
    issues its first weight blocks (the stage's expect counting A and W), then `griddepcontrol.wait`, and only then
    any A (h) block; the consumer never waits on the grid. Unchained kernels hold neither instruction."""
    from weave_moe.backends.weave.kernels import ws_decode

    decode = isinstance(config, str)
    config = ws_decode.WsDecodeConfig.parse(config) if decode else config
    launch = ws_decode.ws_decode_launch if decode else ws.ws_launch
    ptx = {}
    for gemm in (0, 1):
        a, w, out, tiles, scale = _operands(gemm, 2048, 768, block_m=config.block_m, split_tail=config.split_tail,
                                            scale=gemm == 1)
        for chained in (False, True):
            kernel, _, args, kwargs = launch(gemm, a, w, out, tiles, config, scale=scale, num_sms=132,
                                             chained=chained)
            assert kwargs["launch_pdl"] is (chained and gemm == 1)
            compiled = sm90.compile_for_sm90(kernel, args, kwargs)
            ptx[gemm, chained] = compiled.asm["ptx"]
            if chained:
                report = sm90.ptxas_report(ptx[gemm, chained], tmp_path)
                assert "0 bytes stack frame" in report and "0 bytes spill stores" in report, report
    for key, text in ptx.items():
        chained_gemm0, chained_gemm1 = key == (0, True), key == (1, True)
        assert ("griddepcontrol.launch_dependents" in text) is chained_gemm0, key
        assert ("griddepcontrol.wait" in text) is chained_gemm1, key
    text = ptx[1, True]
    copy = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
    first_wait = text.index("griddepcontrol.wait")
    before = text[:first_wait]
    # before the first wait: the producer's expect of A + W bytes and W copies only (W's descriptor), no A copy
    a_bytes = config.block_m * config.block_k * 2
    w_bytes = (config.block_w if decode else config.block_n) * config.block_k * 2
    assert "mbarrier.arrive.expect_tx.shared.b64 _, [%r" in before and f"], {a_bytes + w_bytes};" in before
    descriptors = re.findall(re.escape(copy) + r" \[[^]]*\], \[(%rd\d+),", text)
    early = re.findall(re.escape(copy) + r" \[[^]]*\], \[(%rd\d+),", before)
    assert early and len(set(early)) == 1 and len(set(descriptors)) >= 2, (early, set(descriptors))


@pytest.mark.parametrize("config", ["t8w64k128s8", "t16w64k128s8", "t64w64k128s6"])
@pytest.mark.parametrize("chained", [False, True])
def test_a_preloading_gemm0_issues_its_first_weights_before_it_waits_for_the_rows(config, chained, tmp_path):
    """KernelConfig.chain_pairs: the decode-form GEMM0 launched programmatically after the pair dispatch
    (`ws_decode_launch(preload=True)`), compiled for sm_90 as launched: the producer's first weight blocks (the
    stage's expect counting A and W), then `griddepcontrol.wait`, then A (the rows the pair dispatch writes); with
    `ws_chain` it still lets the chained GEMM1 start early. No spills. The plain GEMM0 holds no wait; the preload is
    GEMM0's only (a chained GEMM1 preloads already)."""
    from weave_moe.backends.weave.kernels import grouped_gemm as gg
    from weave_moe.backends.weave.kernels import ws_decode

    config = ws_decode.WsDecodeConfig.parse(config)
    a, w, out, tiles, _ = _operands(0, 2048, 768, block_m=config.block_m)
    kernel, _, args, kwargs = ws_decode.ws_decode_launch(0, a, w, out, tiles, config, num_sms=132, chained=chained,
                                                         preload=True)
    assert kwargs["launch_pdl"] is True and kwargs["PRELOAD"] is True
    text = sm90.compile_for_sm90(kernel, args, kwargs).asm["ptx"]
    report = sm90.ptxas_report(text, tmp_path)
    assert "0 bytes stack frame" in report and "0 bytes spill stores" in report, report
    assert ("griddepcontrol.launch_dependents" in text) is chained
    copy = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
    before = text[:text.index("griddepcontrol.wait")]
    a_bytes, w_bytes = config.block_m * config.block_k * 2, config.block_w * config.block_k * 2
    assert f"], {a_bytes + w_bytes};" in before
    descriptors = re.findall(re.escape(copy) + r" \[[^]]*\], \[(%rd\d+),", text)
    early = re.findall(re.escape(copy) + r" \[[^]]*\], \[(%rd\d+),", before)
    assert early and len(set(early)) == 1 and len(set(descriptors)) >= 2, (early, set(descriptors))
    plain = ws_decode.ws_decode_launch(0, a, w, out, tiles, config, num_sms=132, chained=chained)
    assert plain[3]["launch_pdl"] is False and "PRELOAD" not in plain[3]
    with pytest.raises(ValueError, match="GEMM0 only"):
        ws_decode.ws_decode_launch(1, *_operands(1, 2048, 768, block_m=config.block_m)[:4], config, num_sms=132,
                                   preload=True)
    with pytest.raises(ValueError, match="only a decode-form GEMM0 preloads"):
        gg.launch_gemm(0, ws.DEFAULT_CONFIG, a, w, out, tiles, preload=True)
