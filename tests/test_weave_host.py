"""Host-side pieces of the weave backend that run without a GPU: configuration, errors, measured timelines."""

import dataclasses

import pytest
import torch

from weave_moe.backends.weave import KernelConfig
from weave_moe.backends.weave.config import DECODE_ROWS, DECODE_TOKENS
from weave_moe.models import MoESpec
from weave_moe.sim.timeline import KINDS, measured_result


def test_kernel_config_from_env(monkeypatch):
    monkeypatch.setenv("WEAVE_MOE_KERNEL_CONFIG", "block_n0=64, stages1=3,dot_fp32=1")
    cfg = KernelConfig.from_env()
    assert (cfg.block_n0, cfg.stages1, cfg.dot_fp32, cfg.block_m) == (64, 3, True, 128)
    assert cfg.fused_serial is False and cfg.tma is True and cfg.compile_layout is True  # the measured defaults
    for off in ("off", "no", "false", "0", "OFF"):
        monkeypatch.setenv("WEAVE_MOE_KERNEL_CONFIG", f"fused_serial=on,tma={off},compile_layout={off}")
        cfg = KernelConfig.from_env()
        assert cfg.fused_serial is True and cfg.tma is False and cfg.compile_layout is False
    for bad in ("no_such_field=1", "tma=maybe", "block_m=12x", "block_m", "block_m=0"):
        monkeypatch.setenv("WEAVE_MOE_KERNEL_CONFIG", bad)
        with pytest.raises(ValueError, match="WEAVE_MOE_KERNEL_CONFIG|block_m"):
            KernelConfig.from_env()
    with pytest.raises(Exception):
        cfg.block_m = 64                                       # frozen


def test_kernel_config_as_text_names_the_fields_off_their_defaults():
    """`KernelConfig.as_text` (what the ranks' construction check compares): "" for the defaults, else the changed
    fields in `from_text`'s format, which reads them back to the same config."""
    assert KernelConfig().as_text() == ""
    config = KernelConfig.from_text("pair_peers=on,block_m=64,chain_pairs=off", "test")
    assert config.as_text() == "block_m=64,pair_peers=on,chain_pairs=off"
    assert KernelConfig.from_text(config.as_text(), "test") == config


def test_gemm0_gather_auto_follows_the_intermediate_size():
    from weave_moe.backends.weave.config import GEMM0_GATHER_MAX_I

    auto = KernelConfig()
    assert auto.gemm0_gather == "auto"
    assert auto.gathers_in_gemm0(GEMM0_GATHER_MAX_I) and not auto.gathers_in_gemm0(GEMM0_GATHER_MAX_I + 8)
    on, off = (KernelConfig.from_text(f"gemm0_gather={v}", "test") for v in ("ON", "off"))
    assert on.gathers_in_gemm0(6400) and not off.gathers_in_gemm0(512)
    with pytest.raises(ValueError, match="gemm0_gather"):
        KernelConfig.from_text("gemm0_gather=1", "test")


def test_which_gemm0_reads_the_gather_rows():
    """KernelConfig.gemm0_gathers (the kernels whose GEMM0 reads the received rows through the gather rows) and
    gemm_configs.reads_gather_rows (per config): the Triton GEMM0 by gemm0_gather, the Gluon one by ws_gather where
    its config `gathers` (one consumer, no split tails), the decode form never."""
    from weave_moe.backends.weave.config import GEMM0_GATHER_MAX_I
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels import ws_decode, ws_gemm

    small, large = GEMM0_GATHER_MAX_I, GEMM0_GATHER_MAX_I + 8
    base, gather = KernelConfig(), KernelConfig.from_text("ws_gather=1", "test")
    assert (base.gemm0_gathers(small), base.gemm0_gathers(large)) == (("triton", ), ())
    assert (gather.gemm0_gathers(small), gather.gemm0_gathers(large)) == (("triton", "ws"), ("ws", ))
    triton, decode = gc.analytical_config(0, 4096, 8), ws_decode.WsDecodeConfig()
    pingpong = ws_gemm.WsConfig(block_n=128, num_warps=4, consumers=2)
    cases = [(base, small, triton, True), (base, large, triton, False), (base, small, ws_gemm.DEFAULT_CONFIG, False),
             (gather, large, ws_gemm.DEFAULT_CONFIG, True), (gather, large, ws_gemm.WsConfig(), True),
             (gather, large, pingpong, False), (gather, large, ws_gemm.WsConfig(split_tail=True), False),
             (gather, small, decode, False), (gather, large, triton, False)]
    for kernel_config, inter, config, expected in cases:
        assert gc.reads_gather_rows(config, kernel_config, inter) is expected, (kernel_config, inter, config)
    assert gc.gluon_gemm0_copies(("triton", )) and not gc.gluon_gemm0_copies(("triton", "ws"))
    assert not gc.gluon_gemm0_copies(("ws", )) and not gc.gluon_gemm0_copies(())


def test_timeout_from_env_is_strict(monkeypatch):
    from weave_moe.backends.weave.config import DEFAULT_TIMEOUT_S, timeout_s_from_env

    monkeypatch.delenv("WEAVE_MOE_TIMEOUT_S", raising=False)
    assert timeout_s_from_env() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("WEAVE_MOE_TIMEOUT_S", "2.5")
    assert timeout_s_from_env() == 2.5
    for bad in ("soon", "0", "-1", "inf", "nan"):
        monkeypatch.setenv("WEAVE_MOE_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="WEAVE_MOE_TIMEOUT_S"):
            timeout_s_from_env()


def test_kernel_config_and_profile_must_cut_the_same_tiles():
    from weave_moe.plan import HardwareProfile

    KernelConfig().check_profile(HardwareProfile.default())   # the shipped pair agrees
    with pytest.raises(ValueError, match="tiles"):
        KernelConfig(block_n1=128).check_profile(HardwareProfile.default())


def test_weave_backend_on_cpu_names_the_problem():
    from weave_moe.layer import ExpertParallelMoE

    spec = MoESpec(8, 2, 64, 32)
    with pytest.raises(RuntimeError, match="CUDA"):
        ExpertParallelMoE(spec, backend="weave", device=torch.device("cpu"), max_tokens_per_rank=16)


@pytest.mark.parametrize("capability, supported", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)])
def test_weave_backend_refuses_gpus_older_than_hopper_by_name(monkeypatch, capability, supported):
    """Its kernels use programmatic dependent launch (sm_90): an A100 or L40S gets an error naming the GPU, its
    compute capability and the backend to use, when the layer is built (not a ptxas error at its first call)."""
    from weave_moe.backends.weave.backend import WeaveBackend
    from weave_moe.backends.weave.config import unsupported_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    gpu = torch.device("cuda", 0)
    reason = unsupported_device(gpu)
    assert (reason is None) is supported, reason
    if not supported:
        assert "NVIDIA A100-SXM4-80GB" in reason and f"({capability[0]}.{capability[1]})" in reason
        assert "backend='nccl'" in reason and "9.0" in reason
        with pytest.raises(RuntimeError, match="compute capability 9.0 or newer"):
            WeaveBackend(MoESpec(8, 2, 64, 32), None, 0, 1, 16, gpu)


def test_measured_timeline_figures():
    # two SMs: SM 0 dispatches 0-10 us then combines 30-40; SM 1 runs GEMM0 5-25 and a stolen GEMM1 25-30
    events = [(0, "dispatch", 0, 10_000), (0, "combine", 30_000, 40_000), (1, "gemm0", 5_000, 25_000),
              (1, "stolen_gemm1", 25_000, 30_000), (1, "reduce", 30_000, 35_000)]
    result = measured_result(events, 2, plan=None)
    assert result.latency_us == pytest.approx(40.0)
    assert result.sm_active == pytest.approx((10 + 10 + 20 + 5 + 5) / (2 * 40))
    # comm (dispatch 0-10, combine 30-40, reduce 30-35) overlaps GEMM (5-30) during 5-10 only
    assert result.overlap == pytest.approx(5 / 40)
    assert result.timeline.count("stolen") == 1 and result.timeline.count("combine") == 2
    assert set(KINDS) >= {"dispatch", "gemm0", "gemm1", "combine", "stolen"}


def test_plan_key_buckets_similar_workloads_and_separates_different_ones():
    from weave_moe.backends.weave.backend import _plan_key
    from weave_moe.backends.weave.exchange import LayoutCounts

    def counts(scale):
        pairs = [int(scale * (300 + 7 * e)) for e in range(16)]
        return LayoutCounts([int(scale * 4000), int(scale * 3900)],
                            [[int(scale * 2000), int(scale * 1900)], [int(scale * 1800), int(scale * 2100)]], pairs)

    base = _plan_key(counts(1.0), 2, 8, 128)
    assert base == _plan_key(counts(1.0), 2, 8, 128)          # deterministic: every rank computes the same key
    nudged = counts(1.0)
    nudged.expert_pairs[0] += 1                               # same M tiles, same largest expert
    assert base == _plan_key(nudged, 2, 8, 128)               # within a bucket: the memoised plans are reused
    assert base != _plan_key(counts(1.5), 2, 8, 128)          # a different workload plans again
    empty = LayoutCounts([0, 0], [[0, 0], [0, 0]], [0] * 16)
    assert _plan_key(empty, 2, 8, 128) != base


def test_verdict_refuses_bad_ids_failed_ranks_and_call_order_on_the_device():
    """The resident call's checks (CountsFormat.verdict): the same rejection on every rank, the first error kept."""
    import torch

    from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage
    from weave_moe.backends.weave.kernels import sync

    ep, E, k, T_max = 3, 6, 2, 4
    message = RoutingMessage(T_max, k)
    fmt = CountsFormat(ep, E, 4)

    def gathered(ids_per_rank, headers):
        rows = []
        for ids, header in zip(ids_per_rank, headers):
            out = torch.empty(message.words, dtype=torch.int32)
            ids = torch.tensor(ids, dtype=torch.int32).view(-1, k)
            message.pack(out, ids, torch.full(ids.shape, 0.5), message.pad(), torch.arange(T_max + 1, dtype=torch.int32),
                         torch.tensor(header, dtype=torch.int32))
            rows.append(out)
        return torch.stack(rows)

    good = [[0, 1, 2, 3], [4, 5], []]
    header = [7, 1, 5, 0]

    def verdict(ids_per_rank, headers, rank=0, status=None):
        status = torch.zeros(4, dtype=torch.int32) if status is None else status
        counts = fmt.build(gathered(ids_per_rank, headers), message, status.clone())
        fmt.verdict(counts, rank, status)
        return status.tolist()

    assert verdict(good, [header] * 3) == [0, 0, 0, 0]
    # rank 1 sent two ids outside [-1, E): every rank writes [BAD_IDS, 1, 2, its call number]
    for rank in range(ep):
        assert verdict([[0, 1, 2, 3], [6, -2], []], [header] * 3, rank) == [sync.REJECT_BAD_IDS, 1, 2, 5]
    # rank 2 failed its local checks (code 1), rank 1 is at another call: a failure outranks the call order
    assert verdict(good, [header, header, [7, 1, 5, 1]]) == [sync.REJECT_PEER_FAILED, 2, 1, 5]
    assert verdict(good, [header, [7, 1, 6, 0], header]) == [sync.REJECT_CALL_ORDER, 1, 6, 5]
    assert verdict(good, [header, header, [8, 1, 5, 0]], rank=2) == [sync.REJECT_CALL_ORDER, 0, 5, 5]
    # the first error stays
    earlier = torch.tensor([1, 3, 4, 9], dtype=torch.int32)
    assert verdict([[0, 1, 2, 3], [6, -2], []], [header] * 3, status=earlier) == [1, 3, 4, 9]


def test_resident_tables_never_read_a_device_value_on_the_host():
    """The resident call's torch work (pack, and the torch task tables when KernelConfig.triton_tables is off) must
    not read a tensor's value on the host: that is a sync, and it breaks CUDA-graph capture (a 0-d index tensor did,
    on the H200). On the CPU the same ops dispatch `_local_scalar_dense` (`.item()`, `int(t)`, `t[0-d tensor]`) or
    `nonzero`, which this mode refuses. The counts and the verdict are one Triton launch (kernels/counts.py, which
    reads no tensor on the host); `CountsFormat.build` and `verdict`, their torch definition, are checked here too."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage
    from weave_moe.backends.weave.layout import build_layout

    class NoHostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
                raise AssertionError(f"a host read inside the resident call: {func}")
            return func(*args, **(kwargs or {}))

    ep, E, k, T = 2, 8, 2, 16
    message, fmt = RoutingMessage(T, k), CountsFormat(ep, E, 4)
    generator = torch.Generator().manual_seed(0)
    messages, status, plans = [], torch.zeros(4, dtype=torch.int32), torch.ones(ep, 4, dtype=torch.int32)
    with NoHostReads():
        for rank in range(ep):
            out = torch.empty(message.words, dtype=torch.int32)
            ids = torch.randint(0, E, (T - rank, k), dtype=torch.int32, generator=generator)
            ids[0, 0] = E
            message.pack(out, ids, torch.rand(T - rank, k, generator=generator), message.pad(),
                         torch.arange(T + 1, dtype=torch.int32), torch.tensor([1, 2, 3, 0], dtype=torch.int32))
            messages.append(out)
        gathered = torch.stack(messages)
        counts = fmt.build(gathered, message, status)
        fmt.verdict(counts, 0, status)
        all_ids, all_weights, tokens = message.unpack(gathered)
        build_layout(all_ids, all_weights, tokens, plans[:, 1], 0, E, hidden_size=32, intermediate_size=16,
                     block_m=16, block_n0=16, block_n1=16, dispatch_rows=4, combine_rows=4, reduce_rows=4)
    assert status.tolist() == [16, 0, 1, 3]


def test_resident_setting_is_strict_and_auto_means_on(monkeypatch):
    import pytest

    from weave_moe.backends.weave.config import KERNEL_CONFIG_ENV, KernelConfig

    assert KernelConfig().resident_at(1) and KernelConfig().resident_at(2)
    assert KernelConfig(resident="on").resident_at(4) and not KernelConfig(resident="off").resident_at(1)
    monkeypatch.setenv(KERNEL_CONFIG_ENV, "resident=Off")
    assert KernelConfig.from_env().resident == "off"
    monkeypatch.setenv(KERNEL_CONFIG_ENV, "resident=maybe")
    with pytest.raises(ValueError, match=KERNEL_CONFIG_ENV):
        KernelConfig.from_env()
    with pytest.raises(ValueError, match="resident"):
        KernelConfig(resident=True)


def test_workspace_refuses_mixing_resident_and_host_driven_layers():
    import pytest
    import torch

    from weave_moe.backends.weave.workspace import SymmetricWorkspace

    ws = SymmetricWorkspace(None, 0, 1, torch.device("cpu"))
    ws.claim_call_mode(True)
    ws.claim_call_mode(True)
    with pytest.raises(ValueError, match="resident"):
        ws.claim_call_mode(False)


def test_deferred_errors_name_the_problem_and_leave_the_layer_usable():
    """The resident call's status word at the next call / synchronize (WeaveBackend._raise_status): rejections raise
    the named error and are cleared (the layer goes on), a kernel timeout breaks the layer."""
    import pytest
    import torch

    from weave_moe.backends.coordination import CallOrderError, PeerError
    from weave_moe.backends.weave.backend import WeaveBackend, WeaveTimeoutError
    from weave_moe.backends.weave.kernels import sync
    from weave_moe.models import MoESpec

    backend = WeaveBackend.__new__(WeaveBackend)  # the host-side logic only: no GPU here
    backend.rank, backend.spec, backend.broken, backend.timeout_s = 0, MoESpec(16, 2, 64, 32), None, 5.0
    backend.status, backend.status_host = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)

    def raised(word, reported=(0, 0, 0, 0)):  # the live word, then the reported rejection (kernels/sync.py)
        words = list(word) + list(reported)
        backend.status[:] = torch.tensor(words)
        backend.status_host[:] = torch.tensor(words)
        try:
            backend._raise_status(words)
        except Exception as error:  # noqa: BLE001 - returned for the assertions
            return error
        return None

    error = raised([sync.REJECT_BAD_IDS, 1, 3, 7])
    assert isinstance(error, ValueError) and "topk_ids must be in [-1, 16)" in str(error) and "rank 1" in str(error)
    assert "call 7" in str(error) and not backend.status.any() and not backend.status_host.any()
    assert isinstance(raised([sync.REJECT_PEER_FAILED, 1, 1, 2]), PeerError)
    assert raised([sync.REJECT_PEER_FAILED, 0, 1, 2]) is None  # this rank raised its own error in that call
    error = raised([sync.REJECT_CALL_ORDER, 1, 9, 2])
    assert isinstance(error, CallOrderError) and "rank 1 was at its call 9" in str(error) and "in call 2" in str(error)
    error = raised([sync.REJECT_CALL_ORDER, 1, 2, 2])   # the same call number: the peer was in another layer
    assert isinstance(error, CallOrderError) and "rank 1 was in a call of another MoE layer" in str(error)
    # a rejection carried into the reported word (by a later call's pack) is raised with its own call number
    error = raised([0, 0, 0, 0], [sync.REJECT_BAD_IDS, 1, 2, 4])
    assert isinstance(error, ValueError) and "call 4" in str(error) and not backend.status.any()
    assert raised([0] * 4) is None
    assert backend.broken is None
    error = raised([sync.ERROR_COMBINE_TIMEOUT.value, 1, 0, 5])
    assert isinstance(error, WeaveTimeoutError) and backend.broken
    with pytest.raises(WeaveTimeoutError):
        backend._raise_status([sync.ERROR_EXCHANGE_TIMEOUT.value, 1, 0, 1])


class _AnyTable:
    """A stand-in for the task tables (layout.Layout): every table is one int32 zero."""

    def __getattr__(self, name):
        return torch.zeros(1, dtype=torch.int32)


class _HeldTables(str):
    """A stand-in for a layer's TableBuffers, named by its string: its layout is an _AnyTable."""

    def layout(self):
        return _AnyTable()


def _compile_name(constants):
    """A megakernel compile as the launch tests name it: its STAGE; "4gs": STAGE 4 (combine + reduce) compiled with
    GROUPED_SERIAL; "d4": a decode compile (DECODE_ROWS rows per task; the tests' plain compiles have 4)."""
    plain = f"{constants.STAGE}gs" if constants.GROUPED_SERIAL else constants.STAGE
    return f"d{plain}" if constants.REDUCE_ROWS == DECODE_ROWS else plain


def _host_backend(monkeypatch, fixed_plan, *, grouped=False, fused_serial=False, resident=False, decode=False,
                  fork=False):
    """A WeaveBackend for `_launch`'s host logic on the CPU: the megakernel's launches and compiles are recorded as
    STAGE values (the grouped GEMMs as "grouped"; "d" prefixed: a decode compile), nothing runs. `decode`: the
    layer has decode compiles (KernelConfig.decode_stages on a resident layer). `fork`: KernelConfig.fork_prologue
    as on a GPU (the side stream's prologue recorded as "fork", the grouped stage after it as "grouped after fork")."""
    from weave_moe.backends.weave import backend as backend_module
    from weave_moe.backends.weave.backend import WeaveBackend
    from weave_moe.backends.weave.launch import MegakernelConstants
    from weave_moe.backends.weave.workspace import SymmetricWorkspace

    launched, compiled = [], []
    name = _compile_name
    monkeypatch.setattr(backend_module.mk_launch, "launch", lambda args, constants, **options:
                        launched.append(name(constants) if args.PHASE_FIRST == 0
                                        else f"{name(constants)} from phase {args.PHASE_FIRST}"))
    monkeypatch.setattr(backend_module.mk_launch, "warmup", lambda args, constants, **options:
                        compiled.append(name(constants)))
    monkeypatch.setattr(backend_module.gemm_configs, "default_configs", lambda *args, **options: [])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    spec, H, I = MoESpec(8, 2, 32, 16), 32, 16
    backend = WeaveBackend.__new__(WeaveBackend)  # the host-side logic only: no GPU here
    backend.spec, backend.rank, backend.world_size, backend.max_tokens = spec, 0, 1, 8
    backend.num_sms, backend.num_local_experts, backend.max_pairs, backend.local_rows = 4, 8, 16, 0
    backend.device, backend.timeout_ns, backend.timeline_events = torch.device("cpu"), 10 ** 9, 0
    backend.config = KernelConfig(fused_serial=fused_serial, grouped_gemm=grouped)
    backend.fixed_plan, backend.grouped, backend.resident = fixed_plan, grouped and fixed_plan is not None, resident
    backend.grouped_serial = grouped and resident and fixed_plan is None
    backend.interleaved = backend.grouped or backend.grouped_serial
    backend.ws_gemm = backend.ws_chain = False
    backend.gemm0_gather = backend.config.gathers_in_gemm0(I)
    backend.debug_skip_launch, backend.compiled, backend.descriptors = False, set(), {}
    backend.workspace = SymmetricWorkspace(None, 0, 1, torch.device("cpu")).attach(8, H, I, 16)
    backend.ctrl, backend.status = torch.zeros(32, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    backend.live_status = backend.status[:4]
    backend.plans_device, backend.io = torch.zeros(1, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    backend.tokens_word = torch.zeros(1, dtype=torch.int32)
    backend.w13, backend.w2 = torch.zeros(8, 2 * I, H).bfloat16(), torch.zeros(8, H, I).bfloat16()
    backend.timeline_buf = torch.zeros(1, dtype=torch.int64)
    backend.constants = MegakernelConstants(
        TOP_K=2, MAX_CHUNKS=8, BLOCK_M=16, BLOCK_N0=16, BLOCK_N1=16, BLOCK_K=16, DISPATCH_ROWS=4, COMBINE_ROWS=4,
        REDUCE_ROWS=4, BLOCK_H=32, DOT_FP32=True, TIMELINE=False, MAX_EVENTS=1, STAGES0=3, STAGES1=4, BLOCK_K1=16,
        USE_TMA=False, RESIDENT=resident)
    backend.stage_constants = backend_module.stage_constants(backend.constants, H)
    backend.decode_tokens = DECODE_TOKENS if decode else 0
    backend.table_buffers = {False: _HeldTables("the layer's tables"), True: _HeldTables("the layer's decode tables")}
    backend.first_launch_lined_up, backend.group = False, None
    backend.tile_buffers, backend.gemm_scratch, backend.stream_k_scratch = {}, {}, "the layer's stream-K scratch"
    backend.kernel_variants = backend._kernel_variants()
    backend._grouped_configs = lambda rows: None
    backend.fork_prologue = fork
    backend._grouped_prologue = lambda offsets, keys, device_serial, side=False: (
        launched.append("fork") if side else None) or ({}, None, "event" if side else None)
    backend._gather_rows = lambda index, rows, count_ready: None
    backend._grouped_gemms = lambda layout, configs, device_serial=False, early=None, gather_ahead=True: \
        launched.append("grouped" + (" if serial" if device_serial else "") + (" after fork" if early is not None
                                                                               else "")
                        + ("" if gather_ahead else ", its gather waiting first"))
    backend.early_dispatch = backend.tables_dispatch = None
    backend.pair_dispatches, backend.pair_combine, backend.peer_pair_combine = [], None, None

    class Stream:
        def wait_event(self, event):
            launched.append(("join", event))

    backend._current_stream = lambda: Stream()
    return backend, launched, compiled


@pytest.mark.parametrize("policy, grouped, fused_serial, resident, plans, launches, compiles", [
    # the fixed serial policy: one launch per stage (dispatch, GEMMs, combine + reduce = STAGE 4), each compiled for
    # its stage; the GEMM stage as grouped GEMMs
    ("serial", True, False, False, ["fixed"], [[0, "grouped", 4]], [0, 4]),
    ("serial", False, False, False, ["fixed"], [[0, 1, 4]], [0, 1, 4]),
    ("serial", False, True, False, ["fixed"], [[-1]], [-1]),       # KernelConfig.fused_serial: one launch
    ("serial", True, False, True, ["fixed"], [[0, "grouped", 4]], [0, 4]),
    ("static:2,2", False, False, False, ["fixed"], [[-1]], [-1]),
    # an adaptive policy's host-driven call plans per call, serial or not: every variant is compiled before the first
    ("weave", False, False, False, ["split", "serial"], [[-1], [0, 1, 4]], [-1, 0, 1, 4]),
    ("weave", False, False, False, ["serial", "split"], [[0, 1, 4], [-1]], [-1, 0, 1, 4]),
    # its resident call has the plan on the device: one launch
    ("weave", False, False, True, [None], [[-1]], [-1]),
    # ... with grouped GEMMs (grouped configs given, as every resident call of such a layer passes them): the first
    # launch (dispatch only under a serial device plan), the grouped GEMMs, then combine + reduce (the GROUPED_SERIAL
    # compiles); without configs one launch; every variant compiled at the first call
    ("weave", True, False, True, [None], [[-1]], [-1, "-1gs", "4gs"]),
    ("weave", True, False, True, ["device serial", None], [["-1gs", "grouped if serial", "4gs"], [-1]],
     [-1, "-1gs", "4gs"]),
    # KernelConfig.decode_stages: a decode call runs the decode compiles of the launches without GEMM (the one that
    # may run every phase keeps its compile); the layer compiles both kinds at its first call
    ("serial", True, False, "decode", ["fixed decode", "fixed"], [["d0", "grouped", "d4"], [0, "grouped", 4]],
     [0, 4, "d0", "d4"]),
    ("weave", True, False, "decode", ["device serial decode", "device serial"],
     [["-1gs", "grouped if serial", "d4gs"], ["-1gs", "grouped if serial", "4gs"]], [-1, "-1gs", "4gs", "d4gs"]),
    ("weave", False, False, "decode", ["decode"], [[-1]], [-1]),
])
def test_launch_compiles_each_serial_stage_for_its_stage(monkeypatch, policy, grouped, fused_serial, resident, plans,
                                                         launches, compiles):
    from weave_moe.plan import Plan

    num_sms = 4
    plan_of = {"fixed": Plan(num_sms, 1, 0, 0.0, policy) if policy == "serial" else Plan(2, 2, 0, 0.0, policy),
               "serial": Plan(num_sms, 1, 0, 0.0, policy), "split": Plan(2, 2, 1, 0.0, policy), None: None,
               "device serial": None}
    fixed = plan_of["fixed"] if policy != "weave" else None
    backend, launched, compiled = _host_backend(monkeypatch, fixed, grouped=grouped, fused_serial=fused_serial,
                                                resident=bool(resident), decode=resident == "decode")
    x, out = torch.zeros(3, 32).bfloat16(), torch.zeros(3, 32).bfloat16()
    for plan_name, expected in zip(plans, launches):
        launched.clear()
        # "<plan> decode": that plan in a decode call ("decode" alone: the plan on the device)
        decode = plan_name is not None and plan_name.endswith("decode")
        if decode:
            plan_name = plan_name.removesuffix("decode").strip() or None
        configs = ("gemm0 config", "gemm1 config") if plan_name == "device serial" else None
        backend._compile_before_call()   # as every call does before it enqueues anything
        backend._launch(x, out, _AnyTable(), plan_of[plan_name], 0, configs, decode)
        assert launched == expected, (plan_name, launched)
        # a megakernel launch (the dispatch) always stands between the task tables and the grouped stage: the row
        # gather loads the tables' indices ahead of its wait on that ground (grouped_tiles, sync.pdl_ahead)
        for i, stage in enumerate(launched):
            if str(stage).startswith("grouped"):
                assert i > 0 and not str(launched[i - 1]).startswith(("grouped", "fork")), launched
        # every variant a call can launch was compiled at the first call, and only then
        assert sorted(compiled, key=str) == sorted(compiles, key=str)
    assert {_compile_name(c) for c in backend.compiled} == set(compiles)


@pytest.mark.parametrize("policy, plan, launches", [
    # a fixed serial plan: the tile tables on the side stream before the dispatch launch, the grouped stage joins
    ("serial", "fixed", ["fork", 0, "grouped after fork", 4]),
    ("serial", "fixed decode", ["fork", "d0", "grouped after fork", "d4"]),
    # an adaptive plan decided on the device: its first launch may run every phase and count on the done counters
    # the prologue sets, so the prologue stays after it, in the grouped stage
    ("weave", "device serial", ["-1gs", "grouped if serial", "4gs"]),
])
def test_fork_prologue_only_beside_a_dispatch_only_launch(monkeypatch, policy, plan, launches):
    from weave_moe.plan import Plan

    fixed = Plan(4, 1, 0, 0.0, policy) if policy == "serial" else None
    backend, launched, _ = _host_backend(monkeypatch, fixed, grouped=True, resident=True, decode=True, fork=True)
    from weave_moe.backends.weave.kernels import gemm_configs as gc

    configs = (gc.analytical_configs(0)[0], gc.analytical_configs(1)[0])
    backend._compile_before_call()
    backend._launch(torch.zeros(3, 32).bfloat16(), torch.zeros(3, 32).bfloat16(), _AnyTable(),
                    fixed, 0, configs, plan.endswith("decode"))
    assert launched == launches


@pytest.mark.parametrize("policy, plan, launches", [
    # a fixed serial plan: no dispatch launch; the grouped stage joins the early dispatch and the tile tables, and
    # its row gather (the emit possibly its predecessor) loads the task tables' indices only after its wait
    ("serial", "fixed decode", [("join", "dispatched"), "fork", "grouped after fork, its gather waiting first", "d4"]),
    # an adaptive plan decided on the device: its first launch starts at its GEMM phase
    ("weave", "device serial", [("join", "dispatched"), "-1gs from phase 1", "grouped if serial", "4gs"]),
])
def test_early_dispatch_replaces_the_dispatch_phase_and_is_joined_first(monkeypatch, policy, plan, launches):
    """KernelConfig.early_dispatch (`_launch(dispatched=)`): the rows were sent beside the task tables; the call's
    launches wait for that event first, the dispatch-only launch is left out, a launch of every phase starts at
    phase 1."""
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.plan import Plan

    fixed = Plan(4, 1, 0, 0.0, policy) if policy == "serial" else None
    backend, launched, _ = _host_backend(monkeypatch, fixed, grouped=True, resident=True, decode=True, fork=True)
    configs = (gc.analytical_configs(0)[0], gc.analytical_configs(1)[0])
    backend._compile_before_call()
    backend._launch(torch.zeros(3, 32).bfloat16(), torch.zeros(3, 32).bfloat16(), _AnyTable(),
                    fixed, 0, configs, plan.endswith("decode"), dispatched="dispatched")
    assert launched == launches


def test_paired_gemms_read_the_pair_rows_in_place_on_the_tile_tables_given(monkeypatch):
    """`_paired_gemms`: on the tile tables given, GEMM0 on the pair rows as they lie in y (no gather) into h, GEMM1
    from h into y."""
    from weave_moe.backends.weave import backend as backend_module
    from weave_moe.plan import Plan

    backend, launched, _ = _host_backend(monkeypatch, Plan(4, 1, 0, 0.0, "serial"), grouped=True, resident=True,
                                         decode=True, fork=True)

    def gemm(index):
        def run(a, w, out, tiles, config, gather=None, **launch):
            assert launch == backend.gemm_launch
            ws = backend.workspace
            source, target = (ws.y(), ws.h()) if index == 0 else (ws.h(), ws.y())
            assert a.data_ptr() == source.data_ptr() and a.shape == source.shape and gather is None
            assert out.data_ptr() == target.data_ptr() and w is (backend.w13, backend.w2)[index]
            launched.append((f"gemm{index}", tiles, config))
        return run

    monkeypatch.setattr(backend_module.grouped_gemm, "grouped_gemm0", gemm(0))
    monkeypatch.setattr(backend_module.grouped_gemm, "grouped_gemm1", gemm(1))
    monkeypatch.setattr(backend_module, "_tile_keys", lambda configs: ["k0", "k1"])
    backend._paired_gemms(("c0", "c1"), {"k0": "tiles k0", "k1": "tiles k1"})
    assert launched == [("gemm0", "tiles k0", "c0"), ("gemm1", "tiles k1", "c1")]


def _tables_host(monkeypatch):
    """A host backend of a resident decode-capable layer whose counts and planner launches only record themselves
    (`_resident_tables`' order), its forks run inline and named "<name> event"."""
    from weave_moe.backends.weave.exchange import RoutingMessage

    backend, launched, _ = _host_backend(monkeypatch, None, resident=True, decode=True)

    class Counts:
        planner = None

        def build(self, *args, **options):
            launched.append("counts")
            return "counts vector"

    class Planner:
        def launch(self, counts, plans):
            launched.append("planner")

    backend.device_counts, backend.device_planner = Counts(), Planner()
    backend.message = RoutingMessage(8, 2)
    backend.all_routing = torch.zeros(1, backend.message.words, dtype=torch.int32)
    backend.table_counters = None
    backend._fork = lambda name, enqueue: enqueue() or f"{name} event"
    return backend, launched


def test_resident_tables_fork_the_early_dispatch_after_the_counts_of_a_decode_call(monkeypatch):
    """KernelConfig.early_dispatch: a decode call's dispatch is forked once the counts (and an adaptive policy's
    plan) are enqueued, before the task tables, with the gathered ids, T and the plans' chunk column; not for a call
    past DECODE_TOKENS tokens."""
    from weave_moe.backends.weave import backend as backend_module

    backend, launched = _tables_host(monkeypatch)

    class Early:
        def launch(self, all_ids, tokens, chunks, io, workspace, status, rank, timeout_ns):
            assert chunks.data_ptr() == backend.plans_device[:, 1].data_ptr() and chunks.stride(0) == 4
            assert tuple(all_ids.shape) == (1, 8, 2) and tokens.numel() == 1 and io is backend.io
            launched.append("early dispatch")

    backend.early_dispatch = Early()
    monkeypatch.setattr(backend_module, "build_layout_triton", lambda *args, **options: launched.append("tables"))
    for decode, expected in ((True, ["counts", "planner", "early dispatch", "tables"]),
                             (False, ["counts", "planner", "tables"])):
        launched.clear()
        dispatched = []
        backend._resident_tables(decode=decode, dispatched=dispatched)
        assert launched == expected and dispatched == (["dispatch event"] if decode else []), (decode, launched)


@pytest.mark.parametrize("chain", [False, True])
def test_resident_paired_runs_no_task_tables_and_combines_by_the_pair_rows(monkeypatch, chain):
    """`_resident_paired` (KernelConfig.pair_dispatch, EP = 1): the counts; the tile tables from the counts vector's
    pairs of the local experts, forked beside the pair dispatch (on every expert's pairs, with the layer's offsets
    and rows table); the join; the grouped GEMMs on those tables; the pair combine of y by the rows with the
    message's weights, which also copies the status words to the host (no `copy_status` kernel after it). No task
    tables, no megakernel launch on the call's stream. `chain` (KernelConfig.chain_pairs): the layer's tile tables
    written by the counts launch itself (no tile-table launch, no fork, no join), the pair dispatch launched
    programmatically, GEMM0 preloading, the pair combine launched programmatically."""
    from weave_moe.backends.weave import backend as backend_module
    from weave_moe.backends.weave.exchange import CountsFormat

    backend, launched = _tables_host(monkeypatch)
    backend.num_sms = 4
    backend.counts_format = CountsFormat(1, 8, 4)
    vector = torch.arange(backend.counts_format.size, dtype=torch.int32)
    held = {"k0": "table k0", "k1": "table k1"}

    def counts(*args, tiles=None, **options):
        assert tiles == (["table k0", "table k1"] if chain else None), tiles
        launched.append("counts" + (" and tile tables" if chain else ""))
        return vector

    backend.device_counts.build = counts
    backend._tile_tables = lambda keys: (held, "rows") if keys == ["k0", "k1"] else None
    backend._preloads = lambda configs, chained: chained and configs == "configs"
    backend.pair_rows = torch.zeros(64, 2, dtype=torch.int32)

    def class_rows(rows):   # the call's size class's rows table: the first 32 of the layer's (Pairs.rows_shape)
        return rows.data_ptr() == backend.pair_rows.data_ptr() and tuple(rows.shape) == (32, 2)

    class Pairs:
        rows_shape = (32, 2)

        def launch(self, all_ids, tokens, pairs, io, workspace, status, rank, timeout_ns, offsets, rows, local,
                   pdl):
            start = backend.counts_format.expert_pairs_offset
            assert pairs.data_ptr() == vector[start:].data_ptr() and pairs.numel() == 8
            assert local.data_ptr() == backend.workspace.y().data_ptr()   # the pair rows into y
            assert tuple(all_ids.shape) == (1, 8, 2) and tokens.numel() == 1 and io is backend.io
            # no expert offsets: the tile tables come from the counts, nothing would read them
            assert offsets is None and class_rows(rows) and status is backend.live_status
            launched.append("pair dispatch" + (" (programmatic)" if pdl else ""))

    class Combine:
        def launch(self, y, rows, all_weights, tokens, io, status, rank, pdl, report, call_tokens):
            assert call_tokens == 5   # the grid of the call's tokens (PairCombine.grid)
            assert y.data_ptr() == backend.workspace.y().data_ptr() and class_rows(rows)
            assert all_weights.dtype == torch.float32 and tuple(all_weights.shape) == (1, 8, 2) and io is backend.io
            assert report == (backend.status, backend.status_host)   # the call's last kernel copies them
            launched.append("pair combine" + (" (programmatic)" if pdl else "") + ", status copied")

    backend.pair_combine = Combine()
    monkeypatch.setattr(backend_module, "build_layout_triton", lambda *args, **options: launched.append("tables"))
    monkeypatch.setattr(backend_module, "_tile_keys", lambda configs: ["k0", "k1"])
    backend._launch = lambda *args, **options: launched.append("megakernel")
    backend._paired_gemms = lambda configs, tables, preload: launched.append(("gemms", configs, tables, preload))
    backend._fork = lambda name, enqueue: launched.append(("fork", name)) or f"{name} event"
    backend.fork_prologue = True

    def prologue(offsets, keys, device_serial, side=False, form="offsets"):
        start = backend.counts_format.expert_pairs_offset   # this rank's experts' pairs (rank 0, EP = 1: all 8)
        assert offsets.data_ptr() == vector[start:].data_ptr() and offsets.numel() == 8
        assert keys == ["k0", "k1"] and not device_serial and form == "counts"
        launched.append(("tile tables", "beside" if side else "in line"))
        return "tile tables", None, "filled"

    backend._grouped_prologue = prologue
    backend._current_stream = lambda: type("Stream", (), {"wait_event": lambda self, e: launched.append(("join", e))})()
    backend.status, backend.status_host = "status words", "their host copy"
    monkeypatch.setattr(backend_module, "copy_status", lambda status, host: launched.append(("status copy", host)))
    backend._resident_paired("configs", Pairs(), chain=chain, call_tokens=5)
    if chain:
        assert launched == ["counts and tile tables", "pair dispatch (programmatic)",
                            ("gemms", "configs", held, True), "pair combine (programmatic), status copied"], launched
    else:
        assert launched == ["counts", ("tile tables", "beside"), "pair dispatch", ("join", "filled"),
                            ("gemms", "configs", "tile tables", False), "pair combine, status copied"], launched


def test_paired_calls_at_ep2_only_in_a_layer_sized_for_them():
    """`paired_call_tokens`: at EP = 1 a resident grouped layer pairs its calls of at most pair_tokens tokens; at
    EP > 1 (KernelConfig.pair_peers) all calls of a layer whose T_max is at most pair_tokens, none of a longer
    layer's (the ranks' T differ, their layers' T_max do not), none without pair_peers; no layer that is not
    resident and grouped, or has top_k > E_local, or H not a multiple of 8."""
    from weave_moe.backends.weave.backend import paired_call_tokens

    spec = MoESpec(16, 4, 64, 32)   # 16 experts, top-4, H 64
    base, peers = KernelConfig(), KernelConfig(pair_peers=True)
    assert base.pair_peers is False   # off by default: unmeasured on two GPUs
    assert paired_call_tokens(base, 1, 8192, spec, True) == base.pair_tokens
    assert paired_call_tokens(base, 1, 100, spec, True) == 100
    assert paired_call_tokens(base, 2, 128, spec, True) == 0
    assert paired_call_tokens(peers, 2, 128, spec, True) == 128
    assert paired_call_tokens(peers, 4, peers.pair_tokens, spec, True) == peers.pair_tokens
    assert paired_call_tokens(peers, 2, peers.pair_tokens + 1, spec, True) == 0
    assert paired_call_tokens(peers, 2, 128, spec, False) == 0
    assert paired_call_tokens(peers, 8, 128, spec, True) == 0   # 2 local experts < top-4
    assert paired_call_tokens(peers, 2, 128, MoESpec(16, 4, 60, 32), True) == 0
    assert paired_call_tokens(KernelConfig(pair_peers=True, pair_dispatch=False), 2, 128, spec, True) == 0


def test_resident_paired_at_ep2_exchanges_and_combines_through_the_peers(monkeypatch):
    """`_resident_paired` at EP > 1 (KernelConfig.pair_peers): the routing exchange first; the counts; the tile
    tables beside the pair dispatch, which writes into the destinations' receive regions (no local rows); the join;
    GEMM0 reading the pair rows from this rank's receive region, GEMM1 into y; the peer combine's send from y, its
    reduce into out, then `copy_status` (the call's last kernel). Never chained."""
    from weave_moe.backends.weave import backend as backend_module
    from weave_moe.backends.weave.exchange import CountsFormat
    from weave_moe.backends.weave.workspace import SymmetricWorkspace

    backend, launched = _tables_host(monkeypatch)
    backend.world_size, backend.rank, backend.num_local_experts, backend.num_sms = 2, 1, 4, 4
    backend.counts_format = CountsFormat(2, 8, 4)
    backend.workspace = SymmetricWorkspace(None, 0, 1, torch.device("cpu")).attach(8, 32, 16, 32, recv_rows=32)
    vector = torch.arange(backend.counts_format.size, dtype=torch.int32)
    backend.device_counts.build = lambda *args, tiles=None, **options: launched.append(("counts", tiles)) or vector
    backend.pair_rows = torch.zeros(8, 2, dtype=torch.int32)
    backend.pair_dispatches = ["the class"]
    assert not backend._chained(1, True) and not backend._chained(1, False)   # at EP > 1 never chained
    start = backend.counts_format.expert_pairs_offset

    def exchange(workspace, message, send, all_routing, status, timeout_ns):
        assert workspace is backend.workspace and send is backend.send_routing and status is backend.live_status
        launched.append("exchange")

    class Pairs:
        rows_shape = (8, 2)

        def launch(self, all_ids, tokens, pairs, io, workspace, status, rank, timeout_ns, offsets, rows, local,
                   pdl):
            assert pairs.data_ptr() == vector[start:].data_ptr() and pairs.numel() == 8 and rank == 1
            assert local is None and offsets is None and not pdl   # into the peers' receive regions
            launched.append("pair dispatch")

    class PeerCombine:
        def send(self, all_ids, all_weights, tokens, y, workspace, status, rank):
            assert y.data_ptr() == backend.workspace.y().data_ptr() and rank == 1
            assert all_weights.dtype == torch.float32 and workspace is backend.workspace
            launched.append("combine send")

        def reduce(self, all_ids, tokens, io, workspace, status, rank, timeout_ns):
            assert io is backend.io and timeout_ns == backend.timeout_ns and status is backend.live_status
            launched.append("combine reduce")

    def gemm(index, config, a, w, out, tiles, gather=None, **launch):
        ws = backend.workspace
        source, target = (ws.recv(), ws.h()) if index == 0 else (ws.h(), ws.y())
        assert a.data_ptr() == source.data_ptr() and a.shape == source.shape and gather is None
        assert index == 1 or a.shape == (32, 32)   # the receive region's rows for pairs (recv_rows)
        assert out.data_ptr() == target.data_ptr() and (config, tiles) == (f"c{index}", f"tiles {index}")
        launched.append(f"gemm{index}")

    backend.send_routing = torch.zeros(4, dtype=torch.int32)
    backend.status_host = torch.zeros(8, dtype=torch.int32)
    backend.pair_combine, backend.peer_pair_combine = None, PeerCombine()
    monkeypatch.setattr(backend_module, "exchange_routing", exchange)
    monkeypatch.setattr(backend_module.grouped_gemm, "launch_gemm", gemm)
    monkeypatch.setattr(backend_module, "_tile_keys", lambda configs: ["k0", "k1"])
    monkeypatch.setattr(backend_module, "copy_status", lambda status, host: launched.append("status copy")
                        if status is backend.status and host is backend.status_host else None)
    backend.fork_prologue = True
    backend._fork = lambda name, enqueue: launched.append(("fork", name)) or f"{name} event"

    def prologue(offsets, keys, device_serial, side=False, form="offsets"):
        assert offsets.data_ptr() == vector[start + 4:].data_ptr() and offsets.numel() == 4   # rank 1's experts
        launched.append("tile tables beside" if side else "tile tables")
        return {"k0": "tiles 0", "k1": "tiles 1"}, None, "filled"

    backend._grouped_prologue = prologue
    backend._current_stream = lambda: type("Stream", (), {"wait_event": lambda self, e: launched.append(("join", e))})()
    backend._resident_paired(("c0", "c1"), Pairs(), chain=False, call_tokens=3)
    assert launched == ["exchange", ("counts", None), "tile tables beside", "pair dispatch", ("join", "filled"),
                        "gemm0", "gemm1", "combine send", "combine reduce", "status copy"], launched


def test_resident_tables_fork_the_dispatch_beside_the_emit_of_a_longer_call(monkeypatch):
    """KernelConfig.dispatch_beside_emit: a call that is not a decode call has its dispatch forked between the bases
    and the emit (`build_layout_triton(beside_emit=)`), given the call's tables, T and the plans' chunk column; a
    decode call has none (its early dispatch, when on, is forked after the counts)."""
    from weave_moe.backends.weave import backend as backend_module

    backend, launched = _tables_host(monkeypatch)

    class Beside:
        def launch(self, tables, tokens, chunks, io, workspace, status, rank, timeout_ns):
            assert tables == "the layer's tables" and tokens.numel() == 1 and io is backend.io
            assert chunks.data_ptr() == backend.plans_device[:, 1].data_ptr() and chunks.stride(0) == 4
            launched.append("dispatch beside the emit")

    backend.tables_dispatch = Beside()

    def tables(*args, buffers, beside_emit=None, **options):
        launched.append("scan, bases")
        if beside_emit is not None:
            beside_emit(buffers)
        launched.append("emit")

    monkeypatch.setattr(backend_module, "build_layout_triton", tables)
    for decode, expected in ((False, ["counts", "planner", "scan, bases", "dispatch beside the emit", "emit"]),
                             (True, ["counts", "planner", "scan, bases", "emit"])):
        launched.clear()
        dispatched = []
        backend._resident_tables(decode=decode, dispatched=dispatched)
        assert launched == expected and dispatched == ([] if decode else ["dispatch event"]), (decode, launched)


@pytest.mark.parametrize("paired", [False, True, "chain", "chain1", "capture", "classes"])
def test_first_call_compiles_every_grouped_config_with_its_own_tile_table(monkeypatch, paired):
    """The grouped GEMMs' warm-up at the first call: each config a call may pick (the tuned table's, split-tail ones
    included) is compiled on a table of its own kind, and the prologue for every (GEMM0, GEMM1) pair of tile kinds.
    `paired` (KernelConfig.pair_dispatch): each GEMM0 config also on the pair rows in y read in place, and the pair
    dispatch on the counts vector's pairs and the layer's offsets, the pair combine on y; "chain"
    (KernelConfig.chain_pairs="on", paired calls of up to 8 tokens): the pair dispatch as launched programmatically
    and the counts launch writing the tables, and the plain chain too (calls over CHAIN_PAIRS_MAX_TOKENS tokens take
    it); "chain1": the same where no paired call is longer (the chained launches only, no tile-table launch from the
    counts); "capture" (chained under a caller's capture only): both chains' launches and both sources of the
    tables; "classes": "chain" with the paired calls in two size classes (KernelConfig.pair_tokens over
    decode_tokens), each class's pair dispatch compiled for the chains of its own calls only, on its prefix of the
    rows table."""
    from weave_moe.backends.weave import backend as backend_module
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels.grouped_tiles import TileTable
    from weave_moe.plan import Plan

    backend, launched, compiled = _host_backend(monkeypatch, Plan(4, 1, 0, 0.0, "serial"), grouped=True)
    plain = gc.analytical_configs(0)[1]
    configs = {0: [plain, plain.with_(block_m=64, split_tail=True)], 1: [gc.analytical_configs(1)[0]]}
    monkeypatch.setattr(backend_module.gemm_configs, "default_configs", lambda gemm, *shape, **options: configs[gemm])
    monkeypatch.setattr(backend_module.grouped_tiles, "build_tile_table",
                        lambda offsets, block_m, rows, split_tail=False: TileTable(None, None, block_m, split_tail))
    warmed, prologues = [], []

    def gemm(index):
        def run(a, w, out, tiles, config, early_release, pdl, scratch, gather=None, **stream_k_options):
            assert (tiles.block_m, tiles.split_tail) == (config.block_m, config.split_tail), (tiles, config)
            in_place = paired and gather is None and a.data_ptr() == backend.workspace.y().data_ptr()
            assert (gather is not None) is (index == 0 and backend.gemm0_gather) or in_place and index == 0
            # a stream-K config's scratch (the layer's, per size), status word and deadline, as in the calls
            assert stream_k_options == dict(stream_k_scratch=backend.stream_k_scratch, status=backend.live_status,
                                            timeout_ns=backend.timeout_ns)
            # the variant the calls launch (a compile per value of the constexpr and of the launch option)
            assert early_release is backend.config.gemm_early_release
            assert pdl is backend.config.grouped_pdl
            assert scratch == backend._gemm_scratch   # the layer's Triton scratch, as in the calls
            warmed.append((index, config) + (("in place",) if in_place else ()))
        return run

    monkeypatch.setattr(backend_module.grouped_gemm, "grouped_gemm0", gemm(0))
    monkeypatch.setattr(backend_module.grouped_gemm, "grouped_gemm1", gemm(1))
    # the warm-up fills the layer's tile tables (on the stream, not beside it), before the call enqueues anything:
    # the call's own fill comes after it (test_first_call_compiles_and_lines_up_before_it_enqueues_anything)
    backend._grouped_prologue = lambda offsets, keys, *rest, side=False, form="offsets": (
        prologues.append((tuple(sorted(set(keys))), side) + (
            () if form == "offsets" else (f"from the {form}", offsets.numel(), bool((offsets == 0).all()))))
        or ({}, None, None))
    backend._gather_rows = lambda index, rows, count_ready: None
    if paired:
        from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage

        backend.message, backend.counts_format = RoutingMessage(8, 2), CountsFormat(1, 8, 4)
        backend.all_routing = torch.zeros(1, backend.message.words, dtype=torch.int32)
        backend.device_counts = type("Counts", (), {
            "counts": torch.full((backend.counts_format.size,), 7, dtype=torch.int32), "planner": None,
            "warmup": lambda self, messages, status, rank, verdict, plans, tiles: counted.append(tuple(tiles))})()

        def class_rows(rows, most):   # a size class's rows table: the layer's first rows, as many as its tokens
            return rows.data_ptr() == backend.pair_rows.data_ptr() and tuple(rows.shape) == (most, 2)

        class Pairs:
            def __init__(self, most):
                self.max_call_tokens, self.rows_shape = most, (most, 2)

            def warmup(self, all_ids, tokens, pairs, io, workspace, status, rank, timeout_ns, offsets, rows, local,
                       pdl):
                assert local.data_ptr() == backend.workspace.y().data_ptr() and class_rows(rows, self.max_call_tokens)
                start = backend.counts_format.expert_pairs_offset
                assert pairs.data_ptr() == backend.device_counts.counts[start:].data_ptr() and pairs.numel() == 8
                assert offsets is None
                warmed.append(f"pair dispatch <= {self.max_call_tokens}" + (" chained" if pdl else ""))

        class Combine:
            def warmup(self, y, rows, all_weights, tokens, io, status, rank, pdl, report):
                assert report == (backend.status, backend.status_host)   # compiled as launched, either chain
                assert y.data_ptr() == backend.workspace.y().data_ptr()
                assert rows.data_ptr() == backend.pair_rows.data_ptr()
                warmed.append(f"pair combine <= {rows.shape[0]}" + (" chained" if pdl else ""))

        classes = {"chain1": (1,), "classes": (1, 8)}.get(paired, (8,))
        backend.pair_dispatches, backend.pair_combine = [Pairs(most) for most in classes], Combine()
        backend.pair_rows = torch.zeros(classes[-1], 2, dtype=torch.int32)
        setting = {True: "off", "chain": "on", "chain1": "on", "capture": "capture", "classes": "on"}[paired]
        backend.config = dataclasses.replace(backend.config, chain_pairs=setting)
        backend.status_host = torch.zeros_like(backend.status)
    held, counted = [], []
    backend._tile_tables = lambda keys: held.append(tuple(sorted(set(keys)))) or (
        {key: f"table {key}" for key in sorted(set(keys))}, "rows")
    backend._compile_before_call()
    gemm0 = [(0, c) for c in configs[0]]
    if paired:   # each config on both sources, the pair rows second
        gemm0 = [w for c in configs[0] for w in ((0, c), (0, c, "in place"))]
    # (class, chain) pairs compiled: "chain" calls of 1 token chained, of 2-8 not; "classes" the same by class
    chains = {False: [], True: [(8, "")], "chain": [(8, ""), (8, " chained")], "chain1": [(1, " chained")],
              "capture": [(8, ""), (8, " chained")], "classes": [(1, " chained"), (8, "")]}[paired]
    pairs = [f"pair {launch} <= {most}{chain}" for most, chain in chains for launch in ("dispatch", "combine")]
    assert warmed == gemm0 + [(1, c) for c in configs[1]] + pairs
    g1 = (configs[1][0].block_m, False)
    kinds = {tuple(sorted({(128, False), g1})), tuple(sorted({(64, True), g1}))}
    # paired: each pair also from the counts vector's pairs of the local experts (8 here), zeros (not the counts
    # buffer, whose contents before a first call are anything: an H100 run at 81dd1fe read past the buffers so)
    expected = [(k, False) for k in kinds] + ([(k, False, "from the counts", 8, True) for k in kinds]
                                              if paired in (True, "chain", "capture", "classes") else [])
    # "chain": the tables the counts launch fills, allocated before the call (not inside its capture), and the
    # counts launch compiled for them (a chained call may first come inside a caller's capture)
    assert sorted(held) == (sorted(kinds) if paired in ("chain", "chain1", "capture", "classes") else []), held
    assert sorted(counted) == (sorted(tuple(f"table {key}" for key in kind) for kind in kinds)
                               if paired in ("chain", "chain1", "capture", "classes") else []), counted
    assert sorted(prologues, key=str) == sorted(expected, key=str)


def test_first_call_compiles_and_lines_up_before_it_enqueues_anything(monkeypatch):
    """A layer's first call compiles every kernel variant and lines the ranks up before it enqueues anything (its
    warm-ups then cannot overwrite what the call has enqueued: the decode fault of 13165e6..49f0f99), specialised on
    the layer's own table buffers; it lines them up again once, before its first launch (after the table kernels'
    first-time compiles); a launch before the compile is refused; later calls neither compile nor line up."""
    from weave_moe.plan import Plan

    backend, launched, compiled = _host_backend(monkeypatch, Plan(4, 1, 0, 0.0, "serial"), grouped=True,
                                                resident=True, decode=True)
    order = []
    specimens = []
    backend._line_up = lambda what: order.append(what)
    real_args = backend._megakernel_args

    def megakernel_args(x, out, layout, my_plan, parity):
        specimens.append(layout)
        return real_args(x, out, layout, my_plan, parity)

    backend._megakernel_args = megakernel_args
    x, out = torch.zeros(3, 32).bfloat16(), torch.zeros(3, 32).bfloat16()
    with pytest.raises(RuntimeError, match="before the layer compiled"):
        backend._launch(x, out, _AnyTable(), backend.fixed_plan, 0)
    assert launched == [] and order == []
    backend._compile_before_call()
    assert sorted(compiled, key=str) == [0, 4, "d0", "d4"]
    assert order == ["the barrier after compiling the kernel"] and launched == []
    assert isinstance(specimens[0], _AnyTable)   # the held tables' layout (_HeldTables.layout)
    backend._launch(x, out, _AnyTable(), backend.fixed_plan, 0)
    assert order == ["the barrier after compiling the kernel", "the barrier before the layer's first launch"]
    assert launched == [0, "grouped", 4]
    compiled.clear()
    backend._compile_before_call()
    backend._launch(x, out, _AnyTable(), backend.fixed_plan, 0)
    assert compiled == [] and len(order) == 2


def test_resident_and_host_driven_calls_compile_before_their_first_enqueue(monkeypatch):
    """WeaveBackend.forward's two paths call _compile_before_call before anything of the call is enqueued: the
    resident call before its slot write and graph run, the host-driven call before its header and routing pack."""
    from weave_moe.backends.weave.backend import WeaveBackend

    class Stop(Exception):
        pass

    order = []
    backend = WeaveBackend.__new__(WeaveBackend)
    backend.broken, backend.debug_poison = None, False
    backend.coordinator = type("C", (), {"check_usable": lambda self: order.append("usable"),
                                         "header": lambda self: [0, 0, 0, 0]})()
    backend._compile_before_call = lambda: order.append("compile")
    backend._raise_deferred = lambda: order.append("deferred errors")

    def enqueue(*args, **kwargs):
        order.append("enqueue")
        raise Stop

    backend.spec, backend.num_local_experts, backend.device = MoESpec(8, 2, 32, 16), 8, torch.device("cpu")
    backend.resident_graph_names, backend.decode_tokens, backend.debug_skip_launch = {}, 0, False
    backend.pair_dispatches = []
    backend.workspace = type("W", (), {"generation": 1})()
    backend._grouped_configs = lambda rows: None
    backend.slots = type("S", (), {"write": enqueue})()   # the resident call's first enqueue: its slot
    backend._write_header = enqueue                        # the host-driven call's: its header
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x, ids, w = torch.zeros(2, 32).bfloat16(), torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)
    backend.kernel_variants, backend.compiled = frozenset({"k"}), set()
    for resident, expected in ((True, ["usable", "deferred errors", "compile", "enqueue"]),
                               (False, ["usable", "compile", "enqueue"])):
        backend.resident = resident
        order.clear()
        with pytest.raises(Stop):
            backend.forward(x, ids, w)
        assert order == expected, (resident, order)


@pytest.mark.parametrize("forked", [False, True])
@pytest.mark.parametrize("gemm0_gather", [False, True])
def test_grouped_stage_gathers_rows_or_lets_gemm0_read_them(monkeypatch, gemm0_gather, forked):
    """The grouped GEMM stage: without KernelConfig.scatter_rows a gather launch copies the received rows into y in
    expert order (by pair) and GEMM0 reads y, with it (the default) the copy runs by received row; with
    KernelConfig.gemm0_gather no copy launch, GEMM0 reads the receive buffer through the layout's
    gather rows. GEMM1 reads h and writes y either way. After a prologue forked onto a side stream (`forked`: its
    event given) the stream waits for it first, and the gather reads the count ahead of its wait (count_ready);
    after one on the same stream it may not."""
    import dataclasses
    import types

    from weave_moe.backends.weave import backend as backend_module
    from weave_moe.backends.weave.backend import WeaveBackend
    from weave_moe.plan import Plan

    backend, _, _ = _host_backend(monkeypatch, Plan(4, 1, 0, 0.0, "serial"), grouped=True)
    assert backend.config.scatter_rows is True
    backend.config = dataclasses.replace(backend.config, gemm0_gather="on" if gemm0_gather else "off",
                                         scatter_rows=False)
    calls, launched_pdl = [], []
    backend._gather_rows = lambda index, rows, count_ready: calls.append(("gather", index, rows, count_ready))
    backend._current_stream = lambda: types.SimpleNamespace(wait_event=lambda event: calls.append(("join", event)))
    monkeypatch.setattr(backend_module.grouped_gemm, "grouped_gemm0", lambda a, w, out, tiles, config, early_release,
                        pdl, scratch, stream_k_scratch, status, timeout_ns, gather=None:
                        calls.append(("gemm0", a, gather)) or launched_pdl.append(pdl))
    monkeypatch.setattr(backend_module.grouped_gemm, "grouped_gemm1", lambda a, w, out, tiles, config, early_release,
                        pdl, scratch, stream_k_scratch, status, timeout_ns:
                        calls.append(("gemm1", a, out)) or launched_pdl.append(pdl))
    layout = types.SimpleNamespace(gather_rows=torch.arange(5, dtype=torch.int32))
    keys = ((16, False),)
    rows = torch.ones(1, dtype=torch.int32)
    configs = (backend_module.gemm_configs.analytical_configs(0)[2],) * 2   # 16-row tiles
    assert configs[0].block_m == 16 and not configs[0].split_tail
    event = "prologue done" if forked else None
    WeaveBackend._grouped_gemms(backend, layout, configs, early=({keys[0]: "table"}, rows, event))
    if forked:
        assert calls.pop(0) == ("join", event)
    ws = backend.workspace
    names = [call[0] for call in calls]
    if gemm0_gather:
        assert names == ["gemm0", "gemm1"]
        assert calls[0][1].data_ptr() == ws.recv().data_ptr()
        assert calls[0][2] is layout.gather_rows
    else:
        assert names == ["gather", "gemm0", "gemm1"]
        assert calls[0][1] is layout.gather_rows and calls[0][2] is rows and calls[0][3] is forked
        assert calls[1][1].data_ptr() == ws.y().data_ptr() and calls[1][2] is None
    assert calls[-1][1].data_ptr() == ws.h().data_ptr() and calls[-1][2].data_ptr() == ws.y().data_ptr()
    # both GEMMs launched plainly by default (KernelConfig.grouped_pdl)
    assert launched_pdl == [backend.config.grouped_pdl] * 2 and backend.config.grouped_pdl is False
    # KernelConfig.scatter_rows: the copy by received row from the layout's combine tables, same count, into y
    backend.config = dataclasses.replace(backend.config, scatter_rows=True)
    scattered = []
    monkeypatch.setattr(backend_module.grouped_tiles, "scatter_rows", lambda *args: scattered.append(args))
    layout = types.SimpleNamespace(gather_rows=layout.gather_rows, combine_pos=torch.zeros(3, 2, dtype=torch.int32),
                                   combine_tasks=torch.zeros(2, 4, dtype=torch.int32),
                                   meta=torch.arange(5, dtype=torch.int32))
    calls.clear()
    WeaveBackend._grouped_gemms(backend, layout, configs, early=({keys[0]: "table"}, rows, None))
    names = [call[0] for call in calls]
    if gemm0_gather:   # GEMM0 reads the gather rows itself: neither copy
        assert names == ["gemm0", "gemm1"] and not scattered
    else:
        assert names == ["gemm0", "gemm1"] and len(scattered) == 1
        src, gather, pos, dst, tasks, num_tasks, count, _, start, count_column = scattered[0]
        assert src.data_ptr() == ws.recv().data_ptr() and dst.data_ptr() == ws.y().data_ptr()
        assert gather is layout.gather_rows and pos is layout.combine_pos and tasks is layout.combine_tasks
        assert int(num_tasks) == 2 and count is rows and (start, count_column) == (2, 3)   # META_FIELDS, COMBINE_COLUMNS


def test_resident_call_host_path_writes_a_slot_or_packs_under_capture(monkeypatch):
    """WeaveBackend._forward_resident's host logic (no GPU): an eager call writes its slot and replays the graph whose
    first kernel reads it; a call captured into a caller's graph launches the argument pack and writes no slot; the
    stalled-peer hook writes nothing; a launch that raises after the slot write breaks the layer (ring and device
    cursor may have parted); `out` is the tensor returned, unless it or x is not 16-byte aligned."""
    import pytest
    import torch

    from weave_moe.backends.weave.backend import WeaveBackend, WeaveError
    from weave_moe.backends.weave.exchange import CallSlots, RoutingMessage
    from weave_moe.models import MoESpec

    spec = MoESpec(8, 2, 32, 16)
    backend = WeaveBackend.__new__(WeaveBackend)   # the host-side logic only
    backend.world_size = 1
    events = []

    class Coordinator:
        timeout_s = 5.0

        def check_usable(self):
            pass

        def header(self):
            return [1, 2, 3, 0]

        def take_failure(self):
            return None

        def poll(self, is_done, what, timeout_s=None):
            raise AssertionError("no wait expected")

    class Event:
        def record(self, stream=None):
            events.append("record")

        def query(self):
            return True

    class Graphs:
        def __init__(self):
            self.runs, self.fail = [], False

        def run(self, name, build, in_capture=None):
            self.runs.append((name, in_capture))
            if self.fail:
                raise RuntimeError("launch failed")
            build()

    class Message:
        def __init__(self):
            self.packs = 0

        def pack_call(self, *args):
            self.packs += 1

    backend.spec, backend.num_local_experts, backend.device = spec, 8, torch.device("cpu")
    backend.resident, backend.no_tokens = True, None
    backend.broken, backend.coordinator, backend.timeout_s = None, Coordinator(), 5.0
    backend.kernel_variants, backend.compiled = frozenset({"k"}), {"k"}
    backend.status_copied, backend.status_numpy = Event(), torch.zeros(8, dtype=torch.int32).numpy()
    backend.slots, backend.message = CallSlots(RoutingMessage(8, 2), torch.device("cpu"), num_slots=16), Message()
    backend.graphs, backend.resident_graph_names = Graphs(), {}
    backend.workspace = type("W", (), {"generation": 1, "flags": lambda self, parity: None})()
    backend.send_routing = backend.header_device = backend.io = backend.status = backend.ctrl = None
    backend.fixed_plan, backend.calls, backend.debug_poison, backend.debug_skip_launch = None, 0, False, False
    backend._grouped_configs = lambda rows: None
    backend._current_stream = lambda: None
    built = []
    backend.decode_tokens = 3   # calls of <= 3 tokens are decode calls (KernelConfig.decode_stages)
    backend.pair_dispatches = []
    backend.config = KernelConfig()   # chain_pairs="capture": paired calls of 1 token under a caller's capture
    tokens_seen = []   # the T each call's graph is built for (the paired combine's grid)
    backend._resident_call = lambda configs, from_slot, decode, paired, chain, call_tokens: (
        tokens_seen.append(call_tokens),
        built.append(("paired", chain, paired.max_call_tokens) if paired is not None
                     else from_slot if decode else "not decode"))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])

    x, ids, w = torch.randn(3, 32).bfloat16(), torch.zeros(3, 2, dtype=torch.int32), torch.rand(3, 2)
    out = torch.empty(3, 32, dtype=torch.bfloat16)
    assert backend.forward(x, ids, w, out=out) is out
    assert backend.slots.written == 1 and built == [True] and backend.message.packs == 0 and events == ["record"]
    assert tokens_seen == [3]
    assert backend.slots.slots_numpy[0].tolist() == [x.data_ptr(), out.data_ptr(), ids.data_ptr(), w.data_ptr(),
                                                     3, 0, 0, 6]
    # x and out that start off the kernel's 16-byte alignment (peers.ROW_ALIGNMENT): the slot gets a copy of x
    # and the backend's own out, which it returns (the layer copies it into the caller's)
    odd_x = torch.cat([x.flatten(), x.flatten()[:1]])[1:].view(3, 32)
    odd_out = torch.empty(3 * 32 + 1, dtype=torch.bfloat16)[1:].view(3, 32)
    assert odd_x.data_ptr() % 16 and odd_out.data_ptr() % 16
    result = backend.forward(odd_x, ids, w, out=odd_out)
    slot = backend.slots.slots_numpy[1].tolist()
    assert result is not odd_out and slot[1] == result.data_ptr() and slot[0] % 16 == 0 and slot[1] % 16 == 0
    assert backend.slots.written == 2 and built == [True, True] and events == ["record", "record"]
    capturing[0] = True   # inside a caller's capture: the argument pack, no slot, no event
    backend.forward(x, ids, w)
    assert backend.slots.written == 2 and built[-1] is False and backend.message.packs == 1 and len(events) == 2
    capturing[0] = False
    backend.debug_skip_launch = True   # the stalled-peer hook: nothing enqueued
    backend.forward(x, ids, w)
    assert backend.slots.written == 2 and len(built) == 3
    backend.debug_skip_launch = False
    backend.forward(torch.cat([x, x]), torch.cat([ids, ids]), torch.cat([w, w]))   # 6 tokens: not a decode call
    assert built[-1] == "not decode" and backend.slots.written == 3
    # a decode call's graph never serves a longer call with the same grouped configs (here: none for both): its
    # early dispatch covers at most DECODE_TOKENS tokens (an H100 run at 4b27543 timed out on that)
    names = [name for name, _ in backend.graphs.runs]
    assert names[0] != names[-1] and names[0].endswith(".decode") and names[-1].endswith(".full"), names
    # KernelConfig.pair_dispatch: calls of at most its tokens run the paired graph, longer decode calls the other
    from weave_moe.backends.weave.kernels.pair_combine import PairCombine

    backend.pair_dispatches = [type("Pairs", (), {"max_call_tokens": 2})()]
    backend.pair_combine = PairCombine(32, 2, 3, 2)   # one column block: a grid of T rounded up to a power of two
    backend.resident_graph_names.clear()
    backend.forward(x[:2], ids[:2], w[:2])
    backend.forward(x, ids, w)
    names = [name for name, _ in backend.graphs.runs]
    assert built[-2:] == [("paired", False, 2), True] and names[-2].endswith(".paired2.g2") \
        and names[-1].endswith(".decode"), names
    # KernelConfig.chain_pairs ("capture"): a paired call of one token under a caller's capture is chained, one of two
    # tokens and an eager one are not
    capturing[0] = True
    for tokens, chain in ((1, True), (2, False)):
        backend.forward(x[:tokens], ids[:tokens], w[:tokens])
        assert built[-1] == ("paired", chain, 2), built
    capturing[0] = False
    backend.forward(x[:1], ids[:1], w[:1])
    assert built[-1] == ("paired", False, 2), built
    # size classes (KernelConfig.pair_tokens over decode_tokens): each call takes the shortest class that holds it
    # (calls under a caller's capture here: they write no slot of the ring)
    backend.pair_dispatches = [type("Pairs", (), {"max_call_tokens": most})() for most in (1, 3)]
    capturing[0] = True
    for tokens, most in ((1, 1), (2, 3), (3, 3)):
        backend.forward(x[:tokens], ids[:tokens], w[:tokens])
        assert built[-1] == ("paired", tokens == 1, most), built
    capturing[0] = False
    # ... and eager calls of two classes with the same grouped configs (here: none) never share a graph: the decode
    # class's pair dispatch covers its own calls' tokens only; within a class, calls of one power-of-two range of
    # tokens share one (the combine's grid), those of another do not
    backend.resident_graph_names.clear()
    for tokens in (1, 2, 3, 2):
        backend.forward(x[:tokens], ids[:tokens], w[:tokens])
    names = [name for name, _ in backend.graphs.runs][-4:]
    assert [name.rsplit(".", 2)[-2:] for name in names] == [["paired1", "g1"], ["paired3", "g2"], ["paired3", "g4"],
                                                            ["paired3", "g2"]], names
    backend.pair_dispatches = [type("Pairs", (), {"max_call_tokens": 2})()]
    backend.graphs.fail = True
    with pytest.raises(RuntimeError, match="launch failed"):
        backend.forward(x, ids, w)
    assert backend.slots.written == 11 and backend.broken and "enqueued" in backend.broken
    with pytest.raises(WeaveError, match="failed earlier"):
        backend.forward(x, ids, w)


@pytest.mark.parametrize("fused, early", [(False, False), (True, False), (False, True), (True, True)])
def test_resident_tables_plan_in_the_counts_launch_or_after_it(monkeypatch, fused, early):
    """KernelConfig.fused_planner: an adaptive policy's resident call plans inside the counts launch (the counts get
    the layer's plans buffer, no planner launch follows), else the planner is its own launch on the counts; the task
    tables read the chunk counts from the same plans buffer either way, and wait for that launch first, or with
    KernelConfig.early_scan before they read the chunk counts (never at their end: the independent scan of a fixed
    plan)."""
    import dataclasses

    from weave_moe.backends.weave import backend as backend_module
    from weave_moe.backends.weave.exchange import RoutingMessage

    backend, launched, _ = _host_backend(monkeypatch, None, resident=True)
    backend.config = dataclasses.replace(backend.config, fused_planner=fused, early_scan=early)
    backend.message = RoutingMessage(8, 2)
    backend.all_routing = torch.zeros(1, backend.message.words, dtype=torch.int32)
    backend.plans_device = torch.zeros(1, 4, dtype=torch.int32)
    backend.table_counters = None

    class Counts:
        planner = "the layer's planner" if fused else None

        def build(self, messages, status, rank, verdict, plans=None, tiles=None):
            assert verdict and messages is backend.all_routing
            launched.append(("counts", plans is backend.plans_device if fused else plans))
            return "counts vector"

    class Planner:
        def launch(self, counts, out):
            assert counts == "counts vector" and out is backend.plans_device
            launched.append("planner")

    backend.device_counts, backend.device_planner = Counts(), Planner()

    def tables(ids, weights, tokens, chunks, rank, num_experts, previous_writes, buffers, **options):
        assert chunks.data_ptr() == backend.plans_device[:, 1].data_ptr()
        assert previous_writes == ("chunks" if early else "any")
        assert buffers == "the layer's tables"   # not new tables per call (nor per captured row count)
        launched.append("tables")

    monkeypatch.setattr(backend_module, "build_layout_triton", tables)
    backend._resident_tables(decode=False)
    assert launched == ([("counts", True), "tables"] if fused else [("counts", None), "planner", "tables"])


@pytest.mark.parametrize("interleaved", [True, False])
def test_grouped_configs_run_on_the_w13_the_layer_holds(monkeypatch, interleaved):
    """KernelConfig.interleave_w13 off: the layer keeps w13 as given, so GEMM0's configs (tuned for the interleaved
    w13) run with gate and up as two MMAs and without the stream-K schedule; GEMM1's are unchanged. Interleaved: every
    config as the table gives it. The first call compiles the same configs the calls pick."""
    from weave_moe.backends.weave import backend as backend_module
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.backend import WeaveBackend
    from weave_moe.plan import Plan

    backend, _, _ = _host_backend(monkeypatch, Plan(4, 1, 0, 0.0, "serial"), grouped=True)
    backend.interleaved, backend.grouped_configs = interleaved, {}
    tuned = {0: gc.GemmConfig(block_m=16, block_n=128, block_k=128, epilogue=0, stream_k=True),
             1: gc.GemmConfig(block_m=16, block_n=128, block_k=128, epilogue=2)}
    monkeypatch.setattr(backend_module.gemm_configs, "default_config", lambda gemm, *shape, **options: tuned[gemm])
    configs = WeaveBackend._grouped_configs(backend, 8)
    assert configs[1] == tuned[1]
    if interleaved:
        assert configs[0] == tuned[0]
    else:
        assert configs[0] == tuned[0].with_(interleaved=False, stream_k=False)
    assert [backend._held_layout(g, tuned[g]) for g in (0, 1)] == list(configs)


@pytest.mark.parametrize("independent", [True, False])
def test_resident_tables_of_a_fixed_plan_run_beside_the_counts(monkeypatch, independent):
    """A fixed plan: no planner; the counts launch writes nothing the tables read, so the scan waits for it only at
    its end (KernelConfig.independent_scan), or first without it; KernelConfig.early_scan changes nothing here."""
    import dataclasses

    from weave_moe.backends.weave import backend as backend_module
    from weave_moe.backends.weave.exchange import RoutingMessage
    from weave_moe.plan import Plan

    backend, launched, _ = _host_backend(monkeypatch, Plan(2, 2, 0, 0.0, "static:2,2"), resident=True)
    backend.config = dataclasses.replace(backend.config, independent_scan=independent, early_scan=True)
    backend.message = RoutingMessage(8, 2)
    backend.all_routing = torch.zeros(1, backend.message.words, dtype=torch.int32)
    backend.plans_device = torch.zeros(1, 4, dtype=torch.int32)
    backend.table_counters, backend.device_planner = None, None

    class Counts:
        planner = None

        def build(self, messages, status, rank, verdict, plans=None, tiles=None):
            assert plans is None
            launched.append("counts")

    backend.device_counts = Counts()
    monkeypatch.setattr(backend_module, "build_layout_triton", lambda *args, previous_writes, buffers, **options:
                        launched.append((previous_writes, buffers)))
    backend._resident_tables(decode=True)
    assert launched == ["counts", ("none" if independent else "any", "the layer's decode tables")]


def test_grouped_stage_buffers_are_the_layers_not_each_calls(monkeypatch):
    """The grouped GEMMs' tile tables (per tile kinds) and Triton's scratch (per size) are allocated once per layer
    and handed to every later call, so that the CUDA graph captured for a row count allocates none of its own."""
    import functools

    from weave_moe.backends.weave import backend as backend_module
    from weave_moe.backends.weave.backend import WeaveBackend
    from weave_moe.plan import Plan

    backend, _, _ = _host_backend(monkeypatch, Plan(4, 1, 0, 0.0, "serial"), grouped=True)
    backend.ctrl = torch.zeros(64, dtype=torch.int32)
    backend.max_pairs = 64
    filled = []
    monkeypatch.setattr(backend_module.grouped_tiles, "fill_tile_tables",
                        lambda tables, offsets, rows, *args, **options: filled.append((tables, rows)))
    offsets = torch.zeros(9, dtype=torch.int32)
    prologue = functools.partial(WeaveBackend._grouped_prologue, backend)   # the real one (_host_backend stubs it)
    first = prologue(offsets, ((16, False), (64, True)), False)
    again = prologue(offsets.clone(), ((64, True), (16, False), (16, False)), False)
    other = prologue(offsets, ((128, False),), False)
    assert first[0] is again[0] and first[1] is again[1]          # same kinds: the same tables and rows
    assert other[0] is not first[0] and set(other[0]) == {(128, False)}
    assert len(filled) == 3 and all(tables is result[0] for (tables, _), result in zip(filled, [first, again, other]))
    scratch = backend._gemm_scratch(4096, 128, None)
    assert backend._gemm_scratch(4096, 128, None) is scratch and scratch.numel() == 4096
    assert backend._gemm_scratch(8192, 128, None) is not scratch
    assert backend.gemm_launch["scratch"] == backend._gemm_scratch


@pytest.mark.parametrize("decode", [True, False])
def test_decode_calls_only_where_the_layer_has_decode_compiles(monkeypatch, decode):
    """A call of at most DECODE_TOKENS tokens (T = 0 included) runs the decode compiles and tables when the layer has
    them (KernelConfig.decode_stages); without them every call, T = 0 too, runs the others (it once counted as a
    decode call: a compile the layer never made, and tables it does not hold)."""
    backend, _, _ = _host_backend(monkeypatch, None, resident=True, decode=decode)
    assert [backend._decode_call(t) for t in (0, 1, DECODE_TOKENS, DECODE_TOKENS + 1)] == \
        [decode, decode, decode, False]


def test_x_and_out_reach_the_kernel_aligned_for_its_vector_copies():
    """The megakernel reads x and writes out with 16-byte vector accesses (peers.ROW_ALIGNMENT): a contiguous view
    that starts off that alignment is copied (x) or replaced by the backend's own tensor (out, which the layer then
    copies into); aligned tensors pass through untouched."""
    from weave_moe.backends.weave.backend import _aligned_io
    from weave_moe.backends.weave.kernels.peers import ROW_ALIGNMENT

    storage = torch.randn(4 * 64 + 8, dtype=torch.float32).to(torch.bfloat16)
    x = storage[:4 * 64].view(4, 64)
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    assert x.data_ptr() % ROW_ALIGNMENT.value == 0
    kept_x, kept_out = _aligned_io(x, out)
    assert kept_x is x and kept_out is out
    odd_x = storage[1:1 + 4 * 64].view(4, 64)               # 2 bytes past an aligned start
    odd_out = torch.empty(4 * 64 + 1, dtype=torch.bfloat16)[1:].view(4, 64)
    copied, dropped = _aligned_io(odd_x, odd_out)
    assert copied.data_ptr() % ROW_ALIGNMENT.value == 0 and torch.equal(copied, odd_x) and dropped is None
    assert _aligned_io(odd_x[:0], None)[0].numel() == 0     # T = 0: nothing is read, nothing copied


def test_layer_hands_backends_a_contiguous_x(monkeypatch):
    """The kernels address x's rows by its address and H: a non-contiguous x reaches the backend as a contiguous copy
    with the same values (the layer's forward), so it cannot be read with the wrong strides."""
    from weave_moe.layer import ExpertParallelMoE
    from weave_moe.testing import make_experts

    spec = MoESpec(4, 2, 16, 8)
    layer = ExpertParallelMoE(spec, group=None, backend="reference", max_tokens_per_rank=8, device="cpu")
    layer.load_experts(*make_experts(spec, seed=0))
    seen = []
    forward = layer.backend.forward
    monkeypatch.setattr(layer.backend, "forward", lambda x, *args, **kwargs: (seen.append(x), forward(x, *args,
                                                                                                      **kwargs))[1])
    wide = torch.randn(3, 2 * spec.hidden_size).to(torch.bfloat16)
    x = wide[:, ::2]                                         # [3, H], every other column: not contiguous
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    weights = torch.full((3, 2), 0.5)
    result = layer(x, ids, weights)
    assert seen[0].is_contiguous() and torch.equal(seen[0], x)
    assert torch.equal(result, layer(x.contiguous(), ids, weights))


def test_fixed_plan_is_made_once_for_the_policies_whose_plan_does_not_depend_on_the_routing():
    """`fixed_plan_for`: serial and static plans once per layer; the adaptive policy's too at EP = 1 in a resident
    layer with the grouped GEMMs where the planner plans serial (KernelConfig.serial_at_ep1), else per call."""
    import dataclasses
    import math

    from weave_moe.backends.weave.backend import fixed_plan_for
    from weave_moe.backends.weave.config import KernelConfig
    from weave_moe.models import MoESpec
    from weave_moe.plan import HardwareProfile

    spec, profile, config = MoESpec.from_name("qwen3-30b-a3b"), HardwareProfile.default(), KernelConfig()
    N = profile.num_sms
    made = fixed_plan_for(spec, 1, 2048, "weave", profile, config, True)
    # the serial policy's plan: serial on a grid of any size, also one of more SMs than the profile's
    assert (made.c, made.K, made.n_steal, made.policy) == (N, 1, 0, "serial") and math.isnan(made.predicted_us)
    assert made.is_serial(N + 16)
    assert fixed_plan_for(spec, 1, 2048, "serial", profile, config, True).c == N
    assert (fixed_plan_for(spec, 2, 2048, "static:20,2", profile, config, True).c,
            fixed_plan_for(spec, 2, 2048, "static:20,2", profile, config, True).K) == (20, 2)
    for world_size, policy, changed, grouped in ((2, "weave", {}, True),                 # EP > 1: per call
                                                 (1, "spatial", {}, True),               # never serial
                                                 (1, "weave", dict(serial_at_ep1=False), True),
                                                 (1, "weave", dict(resident="off"), True),
                                                 (1, "weave", {}, False)):               # no grouped GEMMs
        assert fixed_plan_for(spec, world_size, 2048, policy, profile, dataclasses.replace(config, **changed),
                              grouped) is None, (world_size, policy, changed, grouped)
    # a profile whose planner splits this layer at EP = 1 (the grouped GEMMs no faster than the megakernel's tiles)
    assert fixed_plan_for(spec, 1, 2048, "weave", HardwareProfile.load_named("h200_default"), config, True) is None


@pytest.mark.parametrize("gemm0_gather, ws_gather", [(True, False), (False, False), (True, True), (False, True)])
def test_ws_gemm_runs_the_warp_specialised_kernels_at_prefill_sizes(monkeypatch, gemm0_gather, ws_gather):
    """KernelConfig.ws_gemm: the layer's configs where the weights stream are ws_gemm's, at decode sizes ws_decode's
    (GEMM0 of a layer that gathers in its Triton GEMM0 keeps that one at prefill sizes, unless ws_gather lets the
    Gluon GEMM0 gather too); a warp-specialised GEMM0 reads its rows in expert order from y after the gather launch,
    or with ws_gather the receive buffer through the gather rows with no gather launch; GEMM1 reads h and writes y."""
    import dataclasses
    import types

    from weave_moe.backends.weave import backend as backend_module
    from weave_moe.backends.weave.backend import WeaveBackend
    from weave_moe.backends.weave.kernels import ws_decode, ws_gemm
    from weave_moe.plan import Plan

    backend, _, _ = _host_backend(monkeypatch, Plan(4, 1, 0, 0.0, "serial"), grouped=True)
    backend.config = dataclasses.replace(backend.config, gemm0_gather="on" if gemm0_gather else "off",
                                         ws_gather=ws_gather, scatter_rows=False)   # the copy by pair: "gather" below
    backend.ws_gemm, backend.grouped_configs = True, {}
    del backend._grouped_configs   # the real one
    monkeypatch.setattr(WeaveBackend, "_held_layout", lambda self, gemm, config: config)
    analytical = backend_module.gemm_configs.analytical_config   # no table on the CPU
    assert backend.num_local_experts == 8
    decode = ws_decode.default_config(8 * 8, 8)   # 8 rows per expert: the decode kernels
    assert WeaveBackend._grouped_configs(backend, 8 * 8) == (decode, decode) and decode.block_t == 16
    # 128 rows per expert: the prefill kernels, but GEMM0 of a layer that reads through the gather rows keeps
    # Triton's where the Gluon one would need the gather launch
    backend.grouped_configs = {}
    assert WeaveBackend._grouped_configs(backend, 128 * 8) == (
        analytical(0, 128 * 8, 8) if gemm0_gather and not ws_gather else ws_gemm.DEFAULT_CONFIG,
        ws_gemm.DEFAULT_CONFIG)
    # 512 rows per expert: the Triton kernels, also where only the Gluon GEMM0 would read the gather rows
    assert WeaveBackend._grouped_configs(backend, 512 * 8) == (analytical(0, 512 * 8, 8), analytical(1, 512 * 8, 8))
    backend.ws_gemm, backend.grouped_configs = False, {}   # not an sm_90 GPU, or ws_gemm off: never a Gluon kernel
    assert WeaveBackend._grouped_configs(backend, 8 * 8) == (analytical(0, 8 * 8, 8), analytical(1, 8 * 8, 8))
    backend.ws_gemm = True
    configs = (ws_gemm.DEFAULT_CONFIG, ws_gemm.DEFAULT_CONFIG)
    calls = []
    backend._gather_rows = lambda index, rows, count_ready: calls.append(("gather", index))
    backend._current_stream = lambda: types.SimpleNamespace(wait_event=lambda event: None)
    monkeypatch.setattr(ws_gemm, "ws_gemm0", lambda a, w, out, tiles, config, gather, chained:
                        calls.append(("ws gemm0", a, out, tiles, config, gather)))
    monkeypatch.setattr(ws_gemm, "ws_gemm1", lambda a, w, out, tiles, config, chained:
                        calls.append(("ws gemm1", a, out, tiles, config)))
    layout = types.SimpleNamespace(gather_rows=torch.arange(5, dtype=torch.int32))
    WeaveBackend._grouped_gemms(backend, layout, configs, early=({(64, False): "table"}, None, None))
    ws = backend.workspace
    if ws_gather:   # GEMM0 reads the receive buffer through the gather rows: no gather launch
        assert [call[0] for call in calls] == ["ws gemm0", "ws gemm1"]
        assert calls[0][1].data_ptr() == ws.recv().data_ptr() and calls[0][5] is layout.gather_rows
        calls.insert(0, None)
    else:
        assert [call[0] for call in calls] == ["gather", "ws gemm0", "ws gemm1"]
        assert calls[0][1] is layout.gather_rows and calls[1][5] is None
        assert calls[1][1].data_ptr() == ws.y().data_ptr()
    assert calls[1][2].data_ptr() == ws.h().data_ptr()
    assert calls[2][1].data_ptr() == ws.h().data_ptr() and calls[2][2].data_ptr() == ws.y().data_ptr()
    assert calls[1][3] == calls[2][3] == "table" and calls[1][4] == configs[0]
    # a tuned table's Gluon GEMM0 that cannot gather (split tails, ping-pong) keeps the gather launch
    for config in (ws_gemm.WsConfig(split_tail=True), ws_gemm.WsConfig(block_n=128, num_warps=4, consumers=2)):
        assert not WeaveBackend._gathers_in_gemm0(backend, config)
    assert WeaveBackend._gathers_in_gemm0(backend, decode) is False


def test_ws_gemm_decode_configs_run_the_decode_kernels(monkeypatch):
    """KernelConfig.ws_gemm below 64 rows per expert: both GEMMs of a paired call run kernels/ws_decode.py on the
    call's tile tables (rows in y, h between them); with KernelConfig.ws_chain both chained (GEMM1 launched
    programmatically after GEMM0), and not where either GEMM is a Triton one; with KernelConfig.chain_pairs GEMM0
    preloads (launched programmatically after the pair dispatch), chained or not, where it is the decode form."""
    from weave_moe.backends.weave.backend import WeaveBackend
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels import grouped_gemm as gg
    from weave_moe.backends.weave.kernels import ws_decode, ws_gemm
    from weave_moe.plan import Plan

    backend, _, _ = _host_backend(monkeypatch, Plan(4, 1, 0, 0.0, "serial"), grouped=True)
    calls = []
    monkeypatch.setattr(ws_decode, "ws_decode_gemm0", lambda a, w, out, tiles, config, chained, preload:
                        calls.append(("gemm0", a.data_ptr(), out.data_ptr(), tiles, chained)
                                     + (("preload",) if preload else ())))
    monkeypatch.setattr(ws_decode, "ws_decode_gemm1", lambda a, w, out, tiles, config, chained:
                        calls.append(("gemm1", a.data_ptr(), out.data_ptr(), tiles, chained)))
    monkeypatch.setattr(gg, "grouped_gemm1", lambda a, w, out, tiles, config, **launch:
                        calls.append(("triton gemm1", launch.get("chained"))))
    config = ws_decode.WsDecodeConfig(block_t=8)
    ws = backend.workspace
    y, h = ws.y().data_ptr(), ws.h().data_ptr()
    for chain in (False, True):
        backend.ws_chain = chain
        calls.clear()
        WeaveBackend._paired_gemms(backend, (config, config), {(8, False): "decode table"})
        assert calls == [("gemm0", y, h, "decode table", chain), ("gemm1", h, y, "decode table", chain)]
        for chain_pairs in (False, True):   # KernelConfig.chain_pairs, for this call
            preload = WeaveBackend._preloads(backend, (config, config), chain_pairs)
            assert preload is chain_pairs
            calls.clear()
            WeaveBackend._paired_gemms(backend, (config, config), {(8, False): "decode table"}, preload=preload)
            assert calls == [("gemm0", y, h, "decode table", chain) + (("preload",) if chain_pairs else ()),
                             ("gemm1", h, y, "decode table", chain)], calls
    triton = gc.analytical_configs(1)[0]
    assert not WeaveBackend._preloads(backend, (gc.analytical_configs(0)[0], config), True)   # a Triton GEMM0 does not
    assert not WeaveBackend._chains(backend, (config, triton)) and WeaveBackend._chains(backend, (config, config))
    # the prefill form never chains (DeepSeek-V3 at 2048 tokens ran slower chained)
    prefill = ws_gemm.DEFAULT_CONFIG
    assert not WeaveBackend._chains(backend, (prefill, prefill)) and not WeaveBackend._chains(backend, (config, prefill))
    backend.ws_chain = False
    assert not WeaveBackend._chains(backend, (config, config))


@pytest.mark.parametrize("setting", ["off", "on", "capture"])
def test_paired_calls_take_the_chain_of_eager_or_captured_calls(monkeypatch, setting):
    """KernelConfig.chain_pairs: "on" chains every paired call of at most CHAIN_PAIRS_MAX_TOKENS tokens, "capture"
    only those made under a caller's CUDA-graph capture, "off" none; longer calls and layers without the pair
    dispatch never. `_resident_call` runs the paired call with the chain it is given (`_forward_resident` passes
    `_chained` of the call's tokens), after the pack from the slot for eager calls (`from_slot`)."""
    from weave_moe.backends.weave.backend import WeaveBackend
    from weave_moe.backends.weave.config import CHAIN_PAIRS_MAX_TOKENS, KernelConfig

    backend, launched = _tables_host(monkeypatch)
    backend.config = KernelConfig.from_text(f"chain_pairs={setting}", "test")
    backend.pair_dispatches = [object()]
    short, longer = CHAIN_PAIRS_MAX_TOKENS, CHAIN_PAIRS_MAX_TOKENS + 1
    chained = tuple(WeaveBackend._chained(backend, short, captured) for captured in (False, True))
    assert chained == {"off": (False, False), "on": (True, True), "capture": (False, True)}[setting]
    assert WeaveBackend._chained(backend, 0, True) is chained[1]   # a refused call (no tokens) as a short one
    assert not any(WeaveBackend._chained(backend, longer, captured) for captured in (False, True))
    backend.pair_dispatches = []
    assert not any(WeaveBackend._chained(backend, short, captured) for captured in (False, True))
    backend.slots = type("Slots", (), {"launch": lambda self, *args: launched.append("pack from the slot")})()
    backend.send_routing = backend.header_device = backend.ctrl = None   # the pack's arguments (recorded only)
    backend._resident_paired = lambda configs, dispatch, chain, call_tokens: launched.append(
        ("paired", configs, dispatch, chain, call_tokens))
    for from_slot in (True, False):
        for chain in (False, True):
            launched.clear()
            WeaveBackend._resident_call(backend, "configs", from_slot, True, paired="class", chain=chain,
                                        call_tokens=short)
            paired = [("paired", "configs", "class", chain, short)]
            assert launched == (["pack from the slot"] if from_slot else []) + paired, launched


def test_paired_calls_fall_in_size_classes_each_compiled_for_its_own_calls(monkeypatch):
    """KernelConfig.pair_tokens above decode_tokens: the paired calls in two size classes (`pair_size_classes`), the
    decode calls' (the compile a decode layer has) and the longer ones'; one class where no paired call is longer
    than a decode call. `_pair_classes` gives each class its calls' range and `_paired_chains` of a range the chains
    of those calls only (KernelConfig.chain_pairs)."""
    from types import SimpleNamespace

    from weave_moe.backends.weave.backend import WeaveBackend, pair_size_classes
    from weave_moe.backends.weave.config import KernelConfig

    assert pair_size_classes(64, 64) == [(64, 1)] and pair_size_classes(32, 64) == [(32, 1)]
    assert pair_size_classes(512, 64) == [(64, 1), (512, 1)] and pair_size_classes(65, 64) == [(64, 1), (65, 1)]
    assert pair_size_classes(8, 1) == [(1, 1), (8, 1)]
    # KernelConfig.pair_programs: the long class's pair dispatch only (a decode class may be pipelined too on a GPU
    # of few SMs, and keeps its programs)
    assert pair_size_classes(512, 64, 4) == [(64, 1), (512, 4)] and pair_size_classes(64, 64, 4) == [(64, 1)]
    backend, _ = _tables_host(monkeypatch)
    backend.config = KernelConfig.from_text("chain_pairs=on", "test")
    short, longer = SimpleNamespace(max_call_tokens=1), SimpleNamespace(max_call_tokens=8)
    backend.pair_dispatches = [short, longer]
    assert WeaveBackend._pair_classes(backend) == [(short, 1, 1), (longer, 2, 8)]
    assert [WeaveBackend._pair_dispatch_for(backend, t) for t in (0, 1, 2, 8, 9)] == [short, short, longer, longer,
                                                                                     None]
    assert WeaveBackend._paired_chains(backend, 1, 1) == {True}
    assert WeaveBackend._paired_chains(backend, 2, 8) == {False}
    assert WeaveBackend._paired_chains(backend) == {False, True}
    backend.pair_dispatches = []
    assert WeaveBackend._pair_classes(backend) == [] and WeaveBackend._paired_chains(backend) == set()
