"""Host side of the Weave megakernel: one call of one layer on one rank.

  1. pack this rank's top-k ids and weights (+ its token count and the call's coordination header) into its routing
     message and all-gather the messages (`exchange.RoutingMessage`; a few hundred KB over NVLink);
  2. count rows per (source, destination) and pairs per expert on the device (`kernels/counts.py`, one launch in a
     CUDA graph; the vector's layout: `exchange.CountsFormat`) and copy the counts to the host: the one host sync of
     the call (it also returns the previous call's status word, so a kernel error surfaces at the latest on the next
     call, or at `synchronize()`). Then every rank raises together if any rank's header carries an error code or
     names another layer or call (`CallCoordinator.finish`), or if any rank sent ids outside [-1, E);
  3. plan every rank from the same counts (deterministic, so every rank knows every destination's chunk count K);
  4. build this rank's task tables on the device (`layout.build_layout`, one CUDA-graph replay) and launch the
     megakernel (`launch.launch`; for the `serial` policy, once per stage, each launch compiled for its stage).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import torch

from weave_moe.backends import raise_on_bad_ids
from weave_moe.backends.coordination import (CODE_OK, HEADER_WORDS, CallCoordinator, CallOrderError, PeerError,
                                             code_name)
from weave_moe.backends.weave import launch as mk_launch
from weave_moe.backends.weave.config import (DECODE_ROWS, KernelConfig, decode_block_h, timeout_s_from_env,
                                             unsupported_device)
from weave_moe.backends.weave.exchange import CallSlots, CountsFormat, LayoutCounts, RoutingMessage, copy_status
from weave_moe.backends.weave.graphs import GraphCache, LayoutBuilder
from weave_moe.backends.weave.kernels import gemm_configs, grouped_gemm, grouped_tiles
from weave_moe.backends.weave.kernels.counts import DeviceCounts
from weave_moe.backends.weave.kernels.early_dispatch import EarlyDispatch, PairDispatch, TablesDispatch
from weave_moe.backends.weave.kernels.pair_combine import PairCombine, PeerPairCombine
from weave_moe.backends.weave.kernels.megakernel import CTRL_SIZE_FIXED, EVENT_NAMES, STAGE_COMBINE_REDUCE
from weave_moe.backends.weave.kernels.peers import ROW_ALIGNMENT
from weave_moe.backends.weave.kernels.planner import DevicePlanner
from weave_moe.backends.weave.kernels.routing_exchange import exchange_routing
from weave_moe.backends.weave.kernels.tables import TableBuffers, build_layout_triton, counter_words
from weave_moe.backends.weave.kernels import sync
from weave_moe.backends.weave.kernels.sync import ERROR_NAMES
from weave_moe.backends.weave.layout import COMBINE_COLUMNS, META_FIELDS
from weave_moe.backends.weave.workspace import SymmetricWorkspace
from weave_moe.models import MoESpec
from weave_moe.plan import MAX_CHUNKS, HardwareProfile, Plan, Workload, parse_policy, plan, plans_serial
from weave_moe.sim.measured import events_from_buffer

__all__ = ["WeaveBackend", "WeaveError", "WeaveTimeoutError"]

#: int32 words of the kernel's status word: [error code, flag tag, value seen, value expected] (kernels/sync.py)
STATUS_WORDS = sync.STATUS_WORDS
#: Seconds the ranks may drift apart while compiling for a first call: the barrier after the compile waits at least
#: this long (a cold compile of the task tables alone took ~22 s on a fresh H200 machine).
COMPILE_SKEW_S = 300.0


class WeaveError(RuntimeError):
    """The megakernel reported an error; the layer's buffers are in an unknown state (rebuild the layer)."""


class WeaveTimeoutError(WeaveError):
    """A bounded wait in the megakernel ran past its deadline (a peer stalled or died)."""


#: the launches without GEMM (keys of `stage_constants`), which have decode compiles ("decode", key)
_ROW_STAGES = (0, STAGE_COMBINE_REDUCE.value, (STAGE_COMBINE_REDUCE.value, "grouped serial"))


def paired_call_tokens(config: KernelConfig, world_size: int, max_tokens: int, spec: MoESpec,
                       resident_grouped: bool) -> int:
    """The most tokens per rank of a layer's paired calls (`WeaveBackend._resident_paired`; 0: none), by
    KernelConfig.pair_dispatch: a resident layer of a fixed serial plan's grouped GEMMs (`resident_grouped`), top_k
    <= E_local and H a multiple of 8; at EP = 1 its calls of at most `pair_tokens` tokens, at EP > 1
    (KernelConfig.pair_peers) all its calls if its T_max is at most `pair_tokens` (every rank's layer has the same
    T_max, so every rank pairs every call), else none."""
    if not (config.pair_dispatch and resident_grouped and spec.top_k <= spec.num_experts // world_size
            and spec.hidden_size % 8 == 0):
        return 0
    if world_size == 1:
        return min(config.pair_tokens, max_tokens)
    return max_tokens if config.pair_peers and max_tokens <= config.pair_tokens else 0


def pair_size_classes(pair_tokens: int, decode_tokens: int, pair_programs: int = 1) -> list[tuple[int, int]]:
    """(longest call, programs per SM of its pair dispatch: `PairDispatch(spread=)`) of each size class of a layer's
    paired calls (KernelConfig.pair_dispatch), shortest first: the decode calls' (at most `decode_tokens` tokens;
    one program per SM at most), then the longer ones up to `pair_tokens` (the layer's
    `min(KernelConfig.pair_tokens, T_max)`; KernelConfig.pair_programs), one pair dispatch compiled for each."""
    return [(most, pair_programs if most > decode_tokens else 1)
            for most in sorted({min(pair_tokens, decode_tokens), pair_tokens})]


def _tile_keys(configs) -> list:
    """(block_m, split_tail) of each grouped-GEMM config: the tile table it runs on."""
    return [(config.block_m, config.split_tail) for config in configs]


def stage_constants(constants: mk_launch.MegakernelConstants, hidden_size: int) -> dict:
    """The megakernel's compiles of a layer by launch (`WeaveBackend._stages`): STAGE -1 (every phase in one launch),
    0 and 1 (dispatch, the GEMMs: one serial stage each) and 4 (combine + reduce), (STAGE, "grouped serial") for
    the resident adaptive calls that may run the grouped GEMMs, and ("decode", key) for the launches without GEMM
    at decode sizes (KernelConfig.decode_stages: DECODE_ROWS rows per task, whole rows per step)."""
    table = {stage: dataclasses.replace(constants, STAGE=stage) for stage in (-1, 0, 1, STAGE_COMBINE_REDUCE.value)}
    table.update({(stage, "grouped serial"): dataclasses.replace(constants, STAGE=stage, GROUPED_SERIAL=True)
                  for stage in (-1, STAGE_COMBINE_REDUCE.value)})
    table.update({("decode", key): dataclasses.replace(
        table[key], DISPATCH_ROWS=DECODE_ROWS, COMBINE_ROWS=DECODE_ROWS, REDUCE_ROWS=DECODE_ROWS,
        BLOCK_H=decode_block_h(hidden_size)) for key in _ROW_STAGES})
    return table


def _aligned_io(x: torch.Tensor, out: torch.Tensor | None) -> tuple:
    """(x, out) as the kernels may address them (peers.ROW_ALIGNMENT): an x whose start is not aligned (a
    contiguous view at an odd offset) is copied; such an out is replaced by None, a tensor of the backend's own,
    which the layer copies into the caller's out. Every tensor torch allocates is aligned, so a call normally keeps
    both (two address checks). Without this, the resident call's kernel would fault on such a tensor, and the
    host-driven call would compile another specialisation of the megakernel (its launch is specialised on the
    alignment too) inside the call while its peers wait."""
    if x.numel() and x.data_ptr() % ROW_ALIGNMENT.value:
        x = x.clone()
    if out is not None and out.numel() and out.data_ptr() % ROW_ALIGNMENT.value:
        out = None
    return x, out


class _HostClock:
    """Adds the host milliseconds between laps to `totals` (a dict) when it is not None; costs nothing otherwise."""

    def __init__(self, totals):
        self.totals = totals
        self.last = time.perf_counter() if totals is not None else 0.0

    def lap(self, name: str) -> None:
        if self.totals is not None:
            now = time.perf_counter()
            key = f"host_{name}_ms"
            self.totals[key] = self.totals.get(key, 0.0) + (now - self.last) * 1e3
            self.last = now


def _quantize(value: int) -> int:
    """~4 % wide logarithmic buckets (0 stays 0)."""
    return 0 if value <= 0 else int(round(16.0 * math.log2(1.0 + value)))


def _plan_key(counts: LayoutCounts, world_size: int, num_local_experts: int, block_m: int) -> tuple:
    """A coarse signature of every rank's workload: what the cost model reads, bucketed by `_quantize`."""
    key = []
    for d in range(world_size):
        rows = counts.expert_pairs[d * num_local_experts:(d + 1) * num_local_experts]
        m_tiles = sum(-(-r // block_m) for r in rows)
        key.append((_quantize(counts.num_tokens[d]), _quantize(m_tiles), _quantize(max(rows, default=0)),
                    tuple(_quantize(v) for v in counts.send_rows[d])))
    return tuple(key)


def fixed_plan_for(spec: MoESpec, world_size: int, max_tokens: int, policy: str, profile: HardwareProfile,
                   config: KernelConfig, grouped_capable: bool) -> Plan | None:
    """The plan of every call of a layer whose plan does not depend on the routing, made once when it is built
    (validating the policy string then, not at the first call), or None: the plan is made per call.

    `serial` and `static:<c>,<K>` never look at the routing. Nor, in practice, does the adaptive policy ("weave")
    at EP = 1 in a resident layer whose serial plans run the grouped GEMMs (`grouped_capable`), where the planner,
    with their speed (cost_model A8), picks the serial plan for balanced routing at every size up to T_max
    (KernelConfig.serial_at_ep1, `weave_moe.plan.plans_serial`). The plan's predicted_us is NaN: a prediction needs
    a call's workload, which the layer then never looks at."""
    name = parse_policy(policy)[0]
    serial_at_ep1 = bool(name == "weave" and world_size == 1 and config.serial_at_ep1 and grouped_capable
                         and config.resident_at(world_size)
                         and plans_serial(spec, 1, max_tokens, profile.with_grouped_serial()))
    if name not in ("serial", "static") and not serial_at_ep1:
        return None
    zero = Workload.from_counts(spec, world_size, 0, send_rows=[0] * world_size, recv_rows=[0] * world_size,
                                expert_rows=[0] * (spec.num_experts // world_size), num_tokens=0)
    # serial_at_ep1: the serial policy's plan, as such (serial on a grid of any size: Plan.is_serial)
    made = plan(zero, profile, "serial" if serial_at_ep1 else policy)
    return dataclasses.replace(made, predicted_us=float("nan"))


class WeaveBackend:
    """The `weave` backend (module docstring); implements `weave_moe.backends.Backend`.

    Bounded waits (the layer's timeout_s, held by its CallCoordinator): the host never blocks inside NCCL; it polls
    the event behind the routing exchange's counts (so a peer that never calls makes this rank raise
    CollectiveTimeoutError within timeout_s) and, in `synchronize`, the event behind the kernel. Inside the kernel
    every wait for a peer has its own deadline (kernels/sync.py: WeaveTimeoutError at the next call or
    `synchronize`). A layer's first call lines the ranks up twice (`_line_up`: after compiling its kernels, before
    the routing exchange; after the first-time compiles of its table kernels, before the first launch with waits for
    peers), each barrier waiting up to max(timeout_s, COMPILE_SKEW_S): a cold compile on one rank is legitimate skew.

    Options:
        profile: HardwareProfile for the planner (default: the shipped H200 profile); its tile shape must match the
            KernelConfig's.
        timeout_s: deadline of every wait inside the kernel (default: the smaller of WEAVE_MOE_TIMEOUT_S (default
            5 s) and the coordinator's timeout_s, the layer's own).
        coordinator: the layer's CallCoordinator (default: one of its own, with the default timeout).
        timeline: record per-task %globaltimer events (see `last_timeline`).
        num_sms: CTAs of the persistent grid (default: the device's SM count).
        config: KernelConfig (default: `KernelConfig.from_env()`).
        debug_skip_launch: test hook; this rank skips its kernel launch (a stalled peer).
        debug_poison: fill each output with NaN before the launch, so a row the kernel never writes fails checks.
        use_cuda_graph: replay the counts and the task tables from captured CUDA graphs (default) instead of ~150
            eager torch ops per call.
    """

    name = "weave"
    #: ids outside [-1, E) are found in the counts this backend reads anyway, on every rank in the same call
    checks_expert_ids = True

    def __init__(self, spec: MoESpec, group, rank: int, world_size: int, max_tokens_per_rank: int,
                 device: torch.device, policy: str = "weave", *, profile: HardwareProfile | None = None,
                 timeout_s: float | None = None, timeline: bool = False, num_sms: int | None = None,
                 config: KernelConfig | None = None, debug_skip_launch: bool = False, debug_poison: bool = False,
                 use_cuda_graph: bool = True, coordinator: CallCoordinator | None = None):
        unsupported = unsupported_device(device)
        if unsupported is not None:
            raise RuntimeError(unsupported)
        if world_size > 31:
            raise ValueError(f"the weave backend supports EP <= 31 (one bit per rank in a 32-bit mask), got {world_size}")
        self.spec, self.group, self.rank, self.world_size = spec, group, rank, world_size
        self.max_tokens, self.device, self.policy = max_tokens_per_rank, device, policy
        self.config = config or KernelConfig.from_env()
        self.profile = profile or HardwareProfile.default()
        self.config.check_profile(self.profile)
        self.coordinator = coordinator or CallCoordinator(group, rank, world_size, device)
        self.timeout_s = (timeout_s if timeout_s is not None
                          else min(timeout_s_from_env(), self.coordinator.timeout_s))
        self.timeout_ns = int(1e9 * self.timeout_s)
        self.debug_skip_launch, self.debug_poison = debug_skip_launch, debug_poison
        self.num_sms = num_sms or torch.cuda.get_device_properties(device).multi_processor_count
        self.num_local_experts = spec.num_experts // world_size
        H, I = spec.hidden_size, spec.intermediate_size
        cfg = self.config
        # a serial plan's GEMM stage may run as two grouped-GEMM launches (KernelConfig.grouped_gemm; see below; the
        # GPU is a Hopper or newer: unsupported_device)
        grouped_capable = bool(cfg.grouped_gemm and H % 8 == 0 and I % 8 == 0)
        self.fixed_plan = fixed_plan_for(spec, world_size, max_tokens_per_rank, policy, self.profile, cfg,
                                         grouped_capable)
        max_pairs = world_size * max_tokens_per_rank * min(spec.top_k, self.num_local_experts)
        self.message = RoutingMessage(max_tokens_per_rank, spec.top_k)
        # The fixed serial policy runs its GEMM stage as two grouped-GEMM launches (KernelConfig.grouped_gemm) over an
        # interleaved w13 (gate j, up j neighbours). So does a resident call of an adaptive policy whose device plan
        # is serial (`grouped_serial`: the grouped launches are in its graph and do nothing under another plan, a
        # few microseconds each; its planner knows the grouped GEMMs' speed, cost_model A8); its megakernel reads
        # the same interleaved w13, so the layer holds one copy. Host-driven calls of adaptive policies keep the
        # megakernel's GEMMs for serial plans: there every extra launch costs host time, and routing them through
        # the grouped GEMMs measured 45-75% slower at 2048 tokens on small models
        # (bench/results/eval6-emu-h200-2b24350).
        self.only_serial = self.fixed_plan is not None and self.fixed_plan.is_serial(self.num_sms)
        self.grouped = grouped_capable and self.only_serial
        self.resident = cfg.resident_at(world_size)
        # the paired call (_resident_paired): its longest call; at EP > 1 every call or none (pair_peers: the ranks
        # agree by the layer, whose receive region then holds a row per pair)
        pair_tokens = paired_call_tokens(cfg, world_size, max_tokens_per_rank, spec, self.resident and self.grouped)
        self.pair_peers = world_size > 1 and pair_tokens > 0
        # one workspace per (group, device) shared by every layer, h and y included (workspace.py: the protocol)
        shared = SymmetricWorkspace.shared(group, rank, world_size, device)
        shared.claim_call_mode(self.resident)
        self.workspace = shared.attach(max_tokens_per_rank, H, I, max(max_pairs, 1),
                                       routing_words=self.message.words,
                                       recv_rows=world_size * max_tokens_per_rank * spec.top_k if self.pair_peers
                                       else 0)
        max_mtiles = max_pairs // cfg.block_m + MAX_CHUNKS * self.num_local_experts + 1
        self.ctrl = torch.zeros(CTRL_SIZE_FIXED + max_mtiles, dtype=torch.int32, device=device)
        # [0:4] the live status word, [4:8] the resident call's reported rejection (kernels/sync.py)
        self.status = torch.zeros(2 * STATUS_WORDS, dtype=torch.int32, device=device)
        self.live_status = self.status[:STATUS_WORDS]   # what the kernels read and write
        self.all_routing = torch.empty(world_size, self.message.words, dtype=torch.int32, device=device)
        # at EP = 1 this rank's message is the whole exchange: it is packed there directly (no copy)
        self.send_routing = (self.all_routing[0] if world_size == 1 else
                             torch.empty(self.message.words, dtype=torch.int32, device=device))
        self.routing_pad = self.message.pad(device)
        # this call's coordination header: written on the host (through numpy, no torch op), one copy to the device
        self.header_host = torch.zeros(HEADER_WORDS, dtype=torch.int32).pin_memory()
        self.header_host_numpy = self.header_host.numpy()
        self.header_device = torch.zeros(HEADER_WORDS, dtype=torch.int32, device=device)
        self.no_tokens = (torch.empty(0, spec.top_k, dtype=torch.int32, device=device),
                          torch.empty(0, spec.top_k, dtype=torch.float32, device=device))
        self.token_counts = torch.arange(max_tokens_per_rank + 1, dtype=torch.int32, device=device)
        self.counts_format = CountsFormat(world_size, spec.num_experts, STATUS_WORDS)
        self.counts_host = torch.zeros(self.counts_format.size, dtype=torch.int32).pin_memory()
        self.counts_ready = torch.cuda.Event()
        # KernelConfig.fork_prologue (CUDA streams)
        self.fork_prologue = cfg.fork_prologue and device.type == "cuda"
        self.side_streams: dict[str, torch.cuda.Stream] = {}   # by purpose, each made at its first use (_fork)
        # KernelConfig.device_plan: every rank's plan from the GPU, read back with the counts (kernels/planner.py)
        # KernelConfig.resident: the plan is made on the GPU for every adaptive policy (the host never sees counts)
        self.narrows_int64_ids = self.resident   # the resident call's pack launch narrows them (RoutingMessage.pack_call)
        self.capturable = self.resident   # the host-driven call copies the counts to the host
        self.plans_device = torch.zeros(world_size, 4, dtype=torch.int32, device=device)
        if self.fixed_plan is not None:  # every rank's (c, K, n_steal): the resident call's tables read K here
            p = self.fixed_plan
            self.plans_device.copy_(torch.tensor([[p.c, p.K, p.n_steal, 0]] * world_size, dtype=torch.int32))
        # the resident call's errors: the status word copied to the host after every call, read at the next one
        self.status_host = torch.zeros(2 * STATUS_WORDS, dtype=torch.int32).pin_memory()
        self.status_copied: torch.cuda.Event | None = None
        self.plans_host = torch.zeros(world_size, 4, dtype=torch.int32).pin_memory()
        self.timeline_events = 2048 if timeline else 0
        self.timeline_buf = torch.zeros(self.num_sms, max(self.timeline_events, 1), 4, dtype=torch.int64,
                                        device=device)
        self.chunks_host = torch.zeros(world_size, dtype=torch.long).pin_memory()
        self.chunks_device = torch.ones(world_size, dtype=torch.long, device=device)
        self.last_chunks: list[int] | None = None
        self.graphs = GraphCache(device, use_cuda_graph, wait_for=lambda is_done: self.coordinator.poll(
            is_done, "the routing exchange (before a CUDA-graph capture)"))
        self.layout_builder = LayoutBuilder(cfg.compile_layout)
        self.calls = 0
        self.compiled: set = set()
        self.first_launch_lined_up = False   # _launch lines the ranks up once, before the layer's first launch
        self.last_plan: Plan | None = None
        self.last_plans: list[Plan] = []
        self.plan_memo: dict = {}
        self.broken: str | None = None
        self.w13 = self.w2 = None
        self.descriptors: dict = {}
        self.use_tma = bool(cfg.tma and H % 8 == 0 and I % 8 == 0 and cfg.block_n1 >= 256)
        self.grouped_serial = grouped_capable and self.resident and self.fixed_plan is None
        # KernelConfig.interleave_w13 off: w13 kept as given (no copy); the grouped GEMM0 then runs gate and up as two
        # MMAs (GemmConfig.interleaved off, `_held_layout`), as the megakernel's tiles do
        self.interleaved = (self.grouped or self.grouped_serial) and cfg.interleave_w13
        # KernelConfig.ws_gemm: the grouped GEMMs as the warp-specialised Gluon kernels, written for sm_90 (wgmma)
        self.ws_gemm = bool(cfg.ws_gemm and self.interleaved and torch.cuda.get_device_capability(device)[0] == 9)
        self.ws_chain = self.ws_gemm and cfg.ws_chain and sync.PDL   # _chains
        self.grid_c = torch.full((1,), self.num_sms, dtype=torch.int32, device=device)   # c of a serial plan
        self.gemm0_gather = cfg.gathers_in_gemm0(I)   # the grouped GEMM0 reads its rows itself (_grouped_gemms)
        # a layer whose serial plans run the grouped GEMMs plans with their measured speed (cost_model A8)
        self.device_planner = (DevicePlanner(spec, world_size, self.profile.with_grouped_serial()
                                             if self.grouped_serial else self.profile, policy)
                               if (cfg.device_plan or self.resident) and self.fixed_plan is None else None)
        # KernelConfig.fused_planner: the counts kernel's last program plans too (no planner launch after it)
        self.device_counts = DeviceCounts(self.counts_format, self.message, device,
                                          planner=self.device_planner if cfg.fused_planner else None)
        self.grouped_configs: dict[int, tuple] = {}   # rows -> (GEMM0, GEMM1) configs (_grouped_configs)
        self.resident_graph_names: dict[tuple, str] = {}   # (workspace generation, rows) -> the call's graph name
        self.max_pairs = max_pairs
        self.local_rows = 0       # rows of this rank's experts in the current call (host, from the counts)
        self.constants = mk_launch.MegakernelConstants.from_config(
            cfg, spec.top_k, MAX_CHUNKS, self.timeline_events, self.use_tma,
            resident=self.resident, interleaved=self.interleaved)
        self.stage_constants = stage_constants(self.constants, spec.hidden_size)
        # KernelConfig.decode_stages: resident calls of at most `decode_tokens` tokens (the graph of a call is per row
        # count, so per T: its launches and tables are fixed at capture)
        self.decode_tokens = cfg.decode_tokens if cfg.decode_stages and self.resident else 0
        # KernelConfig.early_dispatch: a decode call's rows dispatched right after the counts, beside the tables
        # (a layer of fewer than `decode_tokens` tokens per rank: its every call; seen on an H200 at 3ec8976, where
        # such a layer refused to build)
        self.early_dispatch = (EarlyDispatch(world_size, spec.num_experts, spec.top_k, H, self.max_tokens,
                                             min(self.decode_tokens, self.max_tokens), self.num_sms)
                               if cfg.early_dispatch and self.decode_tokens and H % 8 == 0 else None)
        # KernelConfig.dispatch_beside_emit: a longer call's rows dispatched right after the bases, beside the emit
        self.tables_dispatch = (TablesDispatch(world_size, H, self.max_tokens, self.num_sms)
                                if cfg.dispatch_beside_emit and self.resident and cfg.triton_tables and H % 8 == 0
                                else None)
        # KernelConfig.pair_dispatch: a decode call's rows sent once per (token, expert) pair, in expert order, right
        # after the counts (at EP = 1 into y, at EP > 1 into the destination's receive region); GEMM0 reads them
        # through TMA, the combine reads y by the pairs' rows (at EP > 1 the peer combine), no task tables
        # (_resident_paired); a fixed serial plan's calls only (an adaptive policy's took it as well, gated on the
        # device by its plan: 4-20% slower at 2-8 tokens on an H100, removed; docs/perf-notes.md 42, 53)
        # One pair dispatch per size class (`pair_size_classes`, `_pair_dispatch_for`), each compiled for its longest
        # call (its ids tile, its pairs per step), so a decode call in a layer of long paired calls keeps the compile
        # of a decode layer's
        self.pair_dispatches: list[PairDispatch] = (
            [PairDispatch(world_size, spec.num_experts, spec.top_k, H, self.max_tokens, most, self.num_sms,
                          spread=spread, recv_rows=self.workspace.recv_rows)
             for most, spread in pair_size_classes(pair_tokens, cfg.decode_tokens, cfg.pair_programs)]
            if pair_tokens >= 1 else [])
        self.peer_pair_combine = (PeerPairCombine(world_size, spec.num_experts, spec.top_k, H, self.max_tokens,
                                                  pair_tokens, self.num_sms) if self.pair_peers else None)
        self.pair_combine = (PairCombine(H, spec.top_k, pair_tokens, self.num_sms)
                             if self.pair_dispatches and world_size == 1 else None)
        if self.pair_dispatches:
            # every class's rows table: a prefix of the longest class's (row (t, j) at t * k + j in each)
            self.pair_rows = torch.zeros(self.pair_dispatches[-1].rows_shape, dtype=torch.int32, device=device)
        # the resident call's task tables (kernels/tables.py): one set per kind of call (decode or not), rewritten by
        # every call, so that the CUDA graph captured for each row count holds no tables of its own
        self.table_buffers = {}
        self.tile_buffers: dict[tuple, tuple] = {}   # the grouped GEMMs' tile tables per tile kinds (_grouped_prologue)
        self.gemm_scratch: dict[int, torch.Tensor] = {}   # Triton scratch per size (_gemm_scratch)
        self.stream_k_scratch = grouped_gemm.StreamKScratch(device)   # a stream-K GEMM's parts and flags per size
        for decode in sorted({False, bool(self.decode_tokens)}) if self.resident and cfg.triton_tables else ():
            self.table_buffers[decode] = self._new_table_buffers(decode)
        self.kernel_variants = self._kernel_variants()
        # the resident call: addresses of this call's x and out, and its T (the token word of the routing message)
        self.io = torch.zeros(2, dtype=torch.int64, device=device)
        # ... which its graph's first kernel reads, with the ids' and weights' addresses, from a slot the host wrote
        # (CallSlots); the host reads the status word through a numpy view
        self.slots = CallSlots(self.message, device) if self.resident else None
        # ... and its task tables count into these (kernels/tables.py: zero between calls, no memset in the graph)
        self.table_counters = torch.zeros(counter_words(world_size, spec.num_experts), dtype=torch.int32,
                                          device=device)
        self.status_numpy = self.status_host.numpy()
        self.stream_cache = (None, None)   # (raw handle, torch.cuda.Stream) of the current stream (_current_stream)
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.tokens_word = self.send_routing[2 * self.message.id_words:2 * self.message.id_words + 1]
        if self.resident and world_size > 1:
            # compiled now, so that no rank compiles inside its first exchange while its peers wait there
            exchange_routing(self.workspace, self.message, self.send_routing, self.all_routing, self.live_status,
                             self.timeout_ns, compile_only=True)
        if self.resident:
            # the header's call number lives on the device (incremented by every call's tables, so that a captured
            # CUDA graph advances it on every replay); identity and creation index are fixed
            self.header_device.copy_(torch.tensor(self.coordinator.header(), dtype=torch.int32))

    # ---- contract ---------------------------------------------------------------------------------------------------
    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """w13 [E_local, 2I, H], w2 [E_local, H, I] bf16 on this device (checked by the layer)."""
        self.w2 = w2.contiguous()
        # one copy of w13: interleaved (gate j, up j neighbours) when the layer may run the grouped GEMMs, which the
        # megakernel's GEMM tiles then read too (W13_INTERLEAVED); else as given
        self.w13 = grouped_gemm.interleave_w13(w13) if self.interleaved else w13.contiguous()
        self.descriptors = self._tma_descriptors() if self.use_tma else dict(w13_desc=None, w2_desc=None)
        # the resident call's graphs captured the old weights' addresses and descriptors: capture again on next use
        self.graphs.drop("resident.")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                timings: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k] int32 global ids (-1 = none; int64 too in the device-resident call, whose
        pack kernel narrows them), topk_weights [T, k] fp32 -> [T, H] bf16.

        `timings`, when given, accumulates host milliseconds per step (host_exchange_ms, host_sync_ms, ...). `out`:
        the result's tensor (written by the kernel; NaN rows where a call is refused); None: a new one. x and out
        whose first row is not 16-byte aligned are copied, or not used (`_aligned_io`)."""
        x, out = _aligned_io(x, out)
        if self.resident:
            return self._forward_resident(x, topk_ids, topk_weights, timings, out)
        if self.broken:
            raise WeaveError(f"this layer failed earlier ({self.broken}); build a new layer")
        coordinator = self.coordinator
        coordinator.check_usable()
        self._compile_before_call()   # a first call, before it enqueues anything
        clock = _HostClock(timings)
        # 1. routing exchange, with the call's header (its error code set if this rank cannot make the call)
        self._write_header()
        try:
            self.message.pack(self.send_routing, topk_ids, topk_weights, self.routing_pad, self.token_counts,
                              self.header_device)
        except Exception as error:  # noqa: BLE001 - the peers wait in the exchange: send T = 0 and the error code
            coordinator.fail(error)
            torch.cuda.current_stream(self.device).synchronize()  # the header's pinned copy has been read
            self._write_header()
            self.message.pack(self.send_routing, *self.no_tokens, self.routing_pad, self.token_counts,
                              self.header_device)
        if self.world_size > 1:
            # flat output: gloo (CUDA tensors on one GPU, validate --shared-gpu) takes no [EP, words] one
            work = torch.distributed.all_gather_into_tensor(self.all_routing.view(-1), self.send_routing,
                                                            group=self.group, async_op=True)
            coordinator.wait(work, "the routing exchange", host=False)  # bounded below, at the counts' event
        clock.lap("exchange")  # at EP = 1 send_routing is all_routing[0]
        # 2. counts to the host (the one sync), with the previous call's status word. While the host waits, the GPU
        #    already builds this call's task tables with the previous call's chunk counts (a pure function of the
        #    routing and the counts, so it is simply built again below in the rare call whose plan changes K).
        counts_device = self.graphs.run("counts", lambda: self._counts(verdict=False))
        self.counts_host.copy_(counts_device, non_blocking=True)
        if self.device_planner is not None:
            plans = (self.plans_device if self.device_counts.planner is not None
                     else self.device_planner.launch(counts_device, self.plans_device))
            self.plans_host.copy_(plans, non_blocking=True)
        self.counts_ready.record(torch.cuda.current_stream(self.device))
        parity = self.workspace.parity  # of the group's call sequence, shared by its layers
        layout = self._layout(parity) if self.last_chunks is not None else None
        if out is None:
            out = torch.empty(x.shape[0], self.spec.hidden_size, dtype=torch.bfloat16, device=self.device)
        if self.debug_poison:
            out.fill_(float("nan"))
        # The one host sync, bounded: a peer that never joins the exchange makes this raise CollectiveTimeoutError.
        coordinator.poll(self.counts_ready.query, "the routing exchange")
        counts, bad_ids, headers, status = self.counts_format.parse(self.counts_host.tolist())
        clock.lap("sync")
        self._raise_on_status(status)
        # Every rank sees every rank's header and bad-id count and raises here, before any kernel of this call: the
        # layer stays usable. A failing rank raises its own error, the others PeerError (or CallOrderError).
        coordinator.finish(headers)
        raise_on_bad_ids(bad_ids, self.spec.num_experts)
        # 3. every rank's plan (same counts everywhere -> same plans everywhere)
        plans = ([self.fixed_plan] * self.world_size if self.fixed_plan is not None else
                 self.device_planner.decode(self.plans_host) if self.device_planner is not None else
                 self._plans(counts))
        self.last_plan, self.last_plans = plans[self.rank], plans
        first = self.rank * self.num_local_experts
        self.local_rows = sum(counts.expert_pairs[first:first + self.num_local_experts])
        clock.lap("plan")
        # 4. task tables (one CUDA-graph replay, unless built above with the right chunk counts) and launch
        chunks = [p.K for p in plans]
        if chunks != self.last_chunks:
            self.chunks_host[:] = torch.tensor(chunks)
            self.chunks_device.copy_(self.chunks_host, non_blocking=True)
            self.last_chunks = chunks
            layout = self._layout(parity)
        clock.lap("layout")
        self._launch(x, out, layout, plans[self.rank], parity)
        clock.lap("launch")
        self.calls += 1
        self.workspace.finish_call()
        return out

    def _write_header(self) -> None:
        """This call's coordination header into `header_device` (one host-to-device copy from pinned memory; the
        previous call's copy has run: every call waits for its counts, which come after it in stream order)."""
        self.header_host_numpy[:] = self.coordinator.header()
        self.header_device.copy_(self.header_host, non_blocking=True)

    # ---- the device-resident call (KernelConfig.resident) --------------------------------------------------------
    def _forward_resident(self, x, topk_ids, topk_weights, timings, out) -> torch.Tensor:
        """One call that never waits for the GPU: the routing exchange, counts, checks, plan and task tables are
        device work enqueued behind each other (at EP = 1 one CUDA-graph replay), then the kernel.

        Checks the host used to make after reading the counts are made on the device, by the counts kernel
        (kernels/counts.py, with `CountsFormat.verdict`'s rules): a refused call writes a rejection into the status
        word, its kernel does nothing and returns NaN rows, and the host raises the named error at the next call or
        `synchronize()` (`_raise_status`). Works under a caller's `torch.cuda.graph` capture once the layer has made
        one call outside it (the first call compiles and captures the layer's own graphs); errors of captured
        replays surface at `synchronize()`.
        """
        if self.broken:
            raise WeaveError(f"this layer failed earlier ({self.broken}); build a new layer")
        coordinator = self.coordinator
        coordinator.check_usable()
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and not self.kernel_variants <= self.compiled:
            raise RuntimeError("weave: call the layer once outside CUDA-graph capture before capturing it (the first "
                               "call compiles the kernels and captures the layer's own graphs)")
        if not capturing:
            self._raise_deferred()
            self._compile_before_call()   # a first call, before it enqueues anything
        clock = _HostClock(timings)
        # a rank that failed its local checks still takes part (T = 0, its error code in the header): every peer's
        # verdict refuses the call; this rank raises its own error after enqueueing it, the peers PeerError later
        code = coordinator.header()[3]
        failure = coordinator.take_failure() if code != CODE_OK else None
        if failure is not None:
            if capturing:
                raise failure
            x, out = x[:0], None
            topk_ids, topk_weights = self.no_tokens
        # this call's x and out, by address: the kernel reads them from `io`, so one captured launch serves any call
        if out is None:
            out = torch.empty(x.shape[0], self.spec.hidden_size, dtype=torch.bfloat16, device=self.device)
        if self.debug_poison:
            out.fill_(float("nan"))
        # the call is one graph (per grouped-GEMM config pair, picked from T on the host), the routing exchange
        # included
        rows = x.shape[0] * self._rows_per_token()
        name = self.resident_graph_names.get((self.workspace.generation, rows))
        configs = self._grouped_configs(rows)
        decode = self._decode_call(x.shape[0])   # a function of rows, as the graph's name is
        paired = self._pair_dispatch_for(x.shape[0])   # and so is this
        chain = paired is not None and self._chained(x.shape[0], capturing)   # and, eager or captured, this
        if name is None:  # the name holds the configs' repr, ~5 us of host time to format: once per row count
            # ... and the kind of call: a decode call's graph (decode compiles, the early or pair dispatch of at most
            # `decode_tokens` tokens) must not serve a longer call whose configs are the same; nor a paired call's
            # graph one of another size class (its pair dispatch covers that class's tokens only), of another
            # chain, or of another combine grid (`PairCombine.grid`). Names serve eager calls only (a captured call
            # is recorded into the caller's graph), whose chain is a function of T.
            kind = ("decode" if decode else "full") if paired is None else (
                f"paired{paired.max_call_tokens}{'.chain' if self._chained(x.shape[0], False) else ''}"
                f".{'peers' if self.pair_combine is None else f'g{self.pair_combine.grid(x.shape[0])}'}")
            name = self.resident_graph_names[(self.workspace.generation, rows)] = (
                f"resident.{self.workspace.generation}.{configs}.{kind}")
        if capturing:
            # the pack with this call's tensors as arguments, recorded into the caller's graph: the routing message,
            # the addresses, the call number, the status word's carried rejection, and the zeroed control block and
            # flags (this rank's parity-0 flags, before its message leaves: workspace.py)
            self.message.pack_call(self.send_routing, topk_ids, topk_weights, self.header_device, self.io, x, out,
                                   code, self.status, self.ctrl, self.workspace.flags(0), self.spec.num_experts)
            self.graphs.run(name, lambda: self._resident_call(configs, False, decode, paired, chain,
                                                              call_tokens=x.shape[0]), in_capture=True)
        elif self.debug_skip_launch:
            return out  # test hook (a stalled peer): this rank never reaches the call's exchange
        else:  # the same pack, first in the call's graph, from this call's slot (CallSlots)
            self.slots.write(x, out, topk_ids, topk_weights, code,
                             lambda is_done: coordinator.poll(is_done, "a free call slot (the GPU is behind)",
                                                              timeout_s=self.timeout_s + coordinator.timeout_s))
            clock.lap("pack")
            try:
                self.graphs.run(name, lambda: self._resident_call(configs, True, decode, paired, chain,
                                                                  call_tokens=x.shape[0]), in_capture=False)
            except BaseException as error:
                # the slot may or may not have been read: the ring and the device cursor could have parted
                self.broken = f"a call failed while it was enqueued: {type(error).__name__}: {error}"
                raise
        # the host does not know an adaptive policy's plan (it is on the device, in plans_device): last_plan is None
        self.last_plan = self.fixed_plan
        if not capturing:  # the graph ends with the status word's copy to the host (_resident_call)
            if self.status_copied is None:
                self.status_copied = torch.cuda.Event()
                self.slots.track_calls(self.status_copied)   # the ring outlives the layer until it has passed
            self.status_copied.record(self._current_stream())
        clock.lap("launch")
        self.calls += 1
        if failure is not None:
            raise failure
        return out

    def _resident_call(self, grouped_configs, from_slot: bool, decode: bool, paired: PairDispatch | None = None,
                       chain: bool = False, *, call_tokens: int) -> None:
        """The resident call's device work: the pack from this call's slot (`from_slot`; else the caller launched
        `pack_call` before), the exchange and the tables, then the kernel (dummy x / out: it reads this call's from
        `io`); `decode`: `_decode_call`; `paired`: `_pair_dispatch_for` (not None: `_resident_paired` with it,
        with `chain`: `_chained`); `call_tokens`: the call's T (the paired combine's grid, `PairCombine.grid`: the
        same for every call of the graph, whose name holds it)."""
        if from_slot:
            self.slots.launch(self.send_routing, self.header_device, self.io, self.status, self.ctrl,
                              self.workspace.flags(0), self.spec.num_experts)
        if paired is not None:   # its combine copies the status words itself
            self._resident_paired(grouped_configs, paired, chain=chain, call_tokens=call_tokens)
            return
        early = []   # a fixed serial plan's grouped-GEMM tile tables, built beside the emit (_resident_tables)
        dispatched = []   # the event of the dispatch beside the tables (early_dispatch, dispatch_beside_emit),
        #                   joined before the GEMMs
        layout = self._resident_tables(decode, grouped_configs, early, dispatched)
        dummy = self.workspace.y()[:1]
        self._launch(dummy, dummy, layout, self.fixed_plan, 0, grouped_configs, decode,
                     early=early[0] if early else None, dispatched=dispatched[0] if dispatched else None)
        # the status word to the host, read at the next call once the event recorded after the call has passed
        # (_raise_deferred); in a caller's capture too (harmless: nothing reads it without that event)
        copy_status(self.status, self.status_host)

    def _resident_paired(self, configs, dispatch: PairDispatch, chain: bool, call_tokens: int) -> None:
        """A decode call's device work under KernelConfig.pair_dispatch (EP = 1, or EP > 1 under
        KernelConfig.pair_peers; a fixed serial plan, the grouped GEMMs), after the pack: at EP > 1 the routing
        exchange; the counts (and their verdict); the grouped GEMMs' tile tables from the counts
        vector's pairs of this rank's experts, forked (KernelConfig.fork_prologue) beside the pair dispatch (each
        (token, expert) pair's row at its place in expert order, into y, and the pairs' rows); GEMM0 reading those
        rows in place through TMA once both are done, GEMM1 into y, and the combine of y by the pairs' rows into out
        (kernels/pair_combine.py). No task tables and no megakernel launch: at EP = 1 nothing else needs them. The
        chain to GEMM0 is pack -> counts -> pair dispatch (the tile tables beside it), not pack -> counts -> bases
        -> emit (-> gather) (docs/perf-notes.md entry 37).
        `chain` (KernelConfig.chain_pairs, for eager calls or those under a caller's capture): the tile tables are
        written by the counts launch instead (no prologue launch, no fork), the pair dispatch is launched
        programmatically after it, and a decode-form GEMM0 programmatically after the pair dispatch, loading its
        first weight blocks while the rows are sent (`_preloads`): the chain to GEMM0's weights is pack -> counts ->
        pair dispatch's start (docs/perf-notes.md entry 53); the pair combine is launched programmatically.
        Either way the pair combine, the call's last kernel, also copies the status words to the host (what
        `copy_status`, the last kernel of a call with task tables, does), so the call has no last kernel for it.
        At EP > 1 (KernelConfig.pair_peers; never chained) the pairs' rows go into their destinations' receive
        regions (the dispatch's last program waits, bounded, for every row this rank is owed), GEMM0 reads them
        there, and the combine is `PeerPairCombine`'s send and reduce, then `copy_status`.
        `dispatch`: the pair dispatch of the call's size class (`_pair_dispatch_for`); `call_tokens`: the call's T,
        the combine's grid (EP = 1)."""
        all_ids, all_weights, tokens = self.message.unpack(self.all_routing)
        rows = self.pair_rows[:dispatch.rows_shape[0]]
        keys, filled = _tile_keys(configs), None
        if self.world_size > 1:   # KernelConfig.pair_peers: the routing exchange first, as `_resident_tables`'
            exchange_routing(self.workspace, self.message, self.send_routing, self.all_routing, self.live_status,
                             self.timeout_ns)
        # the layer's tile tables, filled by the counts launch (chain)
        tables = self._tile_tables(keys)[0] if chain else None
        counts = self._counts(verdict=True, tiles=list(tables.values()) if chain else None)
        if tables is None:
            tables, _, filled = self._grouped_prologue(self._pairs(counts, local=True), keys, False,
                                                       side=self.fork_prologue, form="counts")
        dispatch.launch(all_ids, tokens, self._pairs(counts), self.io, self.workspace, self.live_status, self.rank,
                        self.timeout_ns, None, rows, self._local_pair_rows(), pdl=chain)
        if filled is not None:
            self._current_stream().wait_event(filled)
        self._paired_gemms(configs, tables, preload=self._preloads(configs, chain))
        if self.peer_pair_combine is None:
            self.pair_combine.launch(self.workspace.y(), rows, all_weights, tokens, self.io, self.live_status,
                                     self.rank, pdl=chain, report=(self.status, self.status_host),
                                     call_tokens=call_tokens)
            return
        # at EP > 1: this rank's sums of every source's tokens to the sources, then out from what its destinations
        # sent (a bounded wait), then the status words to the host (what the EP = 1 combine does itself)
        self.peer_pair_combine.send(all_ids, all_weights, tokens, self.workspace.y(), self.workspace,
                                    self.live_status, self.rank)
        self.peer_pair_combine.reduce(all_ids, tokens, self.io, self.workspace, self.live_status, self.rank,
                                      self.timeout_ns)
        copy_status(self.status, self.status_host)

    def _local_pair_rows(self) -> torch.Tensor | None:
        """The pair dispatch's `local` rows: this rank's y at EP = 1, None at EP > 1 (the destinations' receive
        regions, `pair_peers`)."""
        return self.workspace.y() if self.world_size == 1 else None

    def _pair_rows(self) -> torch.Tensor:
        """The rows GEMM0 of a paired call reads, where the pair dispatch left them (`_local_pair_rows`, else this
        rank's receive region)."""
        local = self._local_pair_rows()
        return self.workspace.recv() if local is None else local

    def _pairs(self, counts: torch.Tensor, local: bool = False) -> torch.Tensor:
        """The counts vector's (token, expert) pairs per expert: every expert's [E], or this rank's experts' [E_local]
        (`local`)."""
        start, size = self.counts_format.expert_pairs_offset, self.spec.num_experts
        if local:
            start, size = start + self.rank * self.num_local_experts, self.num_local_experts
        return counts[start:start + size]

    def _pair_dispatch_for(self, tokens: int) -> PairDispatch | None:
        """The pair dispatch with which a resident call of `tokens` tokens runs `_resident_paired`
        (KernelConfig.pair_dispatch): the shortest size class that holds the call; None: the call is not paired."""
        return next((dispatch for dispatch in self.pair_dispatches if tokens <= dispatch.max_call_tokens), None)

    def _pair_classes(self) -> list[tuple[PairDispatch, int, int]]:
        """(pair dispatch, its shortest call, its longest call) of each size class, shortest first."""
        bounds = [0] + [dispatch.max_call_tokens for dispatch in self.pair_dispatches]
        return [(dispatch, low + 1, dispatch.max_call_tokens) for dispatch, low in zip(self.pair_dispatches, bounds)]

    def _chained(self, tokens: int, captured: bool) -> bool:
        """Whether a paired call of `tokens` tokens, made under a caller's CUDA-graph capture or not (`captured`),
        takes KernelConfig.chain_pairs' chain (its tile tables written by the counts launch, the pair dispatch and
        GEMM0 launched programmatically: `_resident_paired`)."""
        return bool(self.pair_dispatches) and self.world_size == 1 and self.config.chains_pairs(captured, tokens)

    def _paired_chains(self, low: int = 1, high: int | None = None) -> set:
        """The chains the paired calls of this layer of `low` to `high` tokens (default: all of them) can take
        (`_chained`, eager or captured), which its first call compiles. The rule takes calls of at most
        CHAIN_PAIRS_MAX_TOKENS tokens: the shortest and the longest call of the range decide."""
        if not self.pair_dispatches:
            return set()
        high = self.pair_dispatches[-1].max_call_tokens if high is None else high
        return {self._chained(tokens, captured) for tokens in (low, high) for captured in (False, True)}

    def _rows_per_token(self) -> int:
        """GEMM rows per token on this rank at most: its (token, expert) pairs, k, or E_local when fewer."""
        return min(self.spec.top_k, self.num_local_experts)

    def _resident_tables(self, decode: bool, grouped_configs=None, early: list | None = None,
                         dispatched: list | None = None):
        """The resident call's tables: counts, the verdict, the plan (adaptive policies) and the task tables for the
        planned chunk counts (the pack launch before them zeroed the control block and the flags, the resident call
        always using parity 0, and advanced the call number). The grouped-GEMM tile tables of a layer whose serial
        plans run the grouped GEMMs (`_grouped_prologue` on the side stream, appended to `early`) are forked off
        after the bases kernel, so they run beside the emit: beside the dispatch launch they waited for its CTAs to
        leave the SMs (ending 4-7 us after it at 2048 tokens on an H200, bench/results/h200-42828c2), and an
        adaptive policy's ran after its first launch.
        With KernelConfig.early_dispatch a decode call's
        rows are dispatched on a side stream once the counts and the plan are written, with
        KernelConfig.dispatch_beside_emit a longer call's once the bases kernel is (its event appended to
        `dispatched`, which the caller joins before the GEMMs: `_launch(dispatched=)`)."""
        if self.world_size > 1:  # through the symmetric workspace, bounded (kernels/routing_exchange.py); at EP = 1
            #                        send_routing is all_routing[0]
            exchange_routing(self.workspace, self.message, self.send_routing, self.all_routing, self.live_status,
                             self.timeout_ns)
        counts = self._counts(verdict=True)
        if self.device_planner is not None and self.device_counts.planner is None:
            self.device_planner.launch(counts, self.plans_device)
        cfg = self.config
        all_ids, _, tokens = self.message.unpack(self.all_routing)
        if decode and self.early_dispatch is not None and dispatched is not None:
            dispatched.append(self._fork("dispatch", lambda: self.early_dispatch.launch(
                all_ids, tokens, self.plans_device[:, 1], self.io, self.workspace, self.live_status, self.rank,
                self.timeout_ns)))
        # the Triton tables count into the layer's persistent counters, which their bases kernel zeroes again
        # a fixed plan: the counts kernel just launched writes nothing the tables read, which then run beside it;
        # an adaptive plan: the launch just before (the planner, or the counts with it) writes only the chunk counts
        if self.device_planner is None:
            previous_writes = "none" if cfg.independent_scan else "any"
        else:
            previous_writes = "chunks" if cfg.early_scan else "any"
        beside = []   # what is forked off between the bases and the emit, given the tables
        if (self.grouped or self.grouped_serial) and grouped_configs is not None and early is not None \
                and self.fork_prologue:
            beside.append(lambda tables: early.append(self._grouped_prologue(
                tables.tensors["expert_offsets"], _tile_keys(grouped_configs), self.grouped_serial, side=True)))
        if not decode and self.tables_dispatch is not None and dispatched is not None:
            beside.append(lambda tables: dispatched.append(self._fork("dispatch", lambda: self.tables_dispatch.launch(
                tables, tokens, self.plans_device[:, 1], self.io, self.workspace, self.live_status, self.rank,
                self.timeout_ns))))
        return self._build_tables(decode, previous_writes, beside)

    def _build_tables(self, decode: bool, previous_writes: str, beside: list = ()):
        """Enqueue this call's task tables on the current stream (kernels/tables.py; the torch op chain without
        KernelConfig.triton_tables) and return the layout. `previous_writes`: what the launch enqueued just before
        writes that the tables read (`build_layout_triton`); `beside`: what to fork off between the bases and the
        emit, each given the tables (Triton tables only)."""
        cfg, spec = self.config, self.spec
        all_ids, all_weights, tokens = self.message.unpack(self.all_routing)
        # a layer whose serial plans run the grouped GEMMs: no GEMM task rows under a serial plan (nothing reads them);
        # a fixed serial policy's plan is serial whatever its c (Plan.is_serial), the device plan's by its c
        options = (dict(serial_plan=self.plans_device[self.rank, 0:1] if self.grouped_serial else self.grid_c,
                        num_sms=self.num_sms)
                   if self.grouped or self.grouped_serial else {})
        if beside:
            options["beside_emit"] = lambda tables: [fork(tables) for fork in beside]
        build = (functools.partial(build_layout_triton, counters=self.table_counters,
                                   previous_writes=previous_writes, buffers=self.table_buffers[decode], **options)
                 if cfg.triton_tables
                 else self.layout_builder)
        return build(
            all_ids, all_weights, tokens, self.plans_device[:, 1], self.rank, spec.num_experts,
            hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, block_m=cfg.block_m,
            block_n0=cfg.block_n0, block_n1=cfg.block_n1, **self._table_rows(decode))

    def _counts(self, verdict: bool, tiles: list | None = None) -> torch.Tensor:
        """Enqueue the counts kernel on the gathered routing (kernels/counts.py); returns the counts vector. With
        `KernelConfig.fused_planner` it also writes every rank's plan into `plans_device`; with `tiles` (TileTable
        buffers) the tile tables of this rank's experts (KernelConfig.chain_pairs)."""
        return self.device_counts.build(self.all_routing, self.live_status, self.rank, verdict=verdict,
                                        plans=self._counts_plans(), tiles=tiles)

    def _counts_plans(self) -> torch.Tensor | None:
        """The counts kernel's `plans` argument: every rank's plan where it plans (KernelConfig.fused_planner)."""
        return self.plans_device if self.device_counts.planner is not None else None

    def _raise_deferred(self) -> None:
        """Raise the error an earlier resident call left in the status word, if its copy has reached the host (no
        wait: a copy still in flight is read at a later call or at `synchronize()`)."""
        # the words first (a numpy read, 0.6 us on the H200 host; tolist() ~4, the event query ~0.9): a code seen is
        # acted on only once the copy has landed (the event), so a torn or early read never raises
        words = self.status_numpy
        if (words[0] or words[STATUS_WORDS]) and self.status_copied is not None and self.status_copied.query():
            self._raise_status(self.status_host.tolist())

    def _current_stream(self) -> torch.cuda.Stream:
        """torch.cuda.current_stream(device), cached by its raw handle: building the Stream object costs ~6 us of
        host time per call on the H200 machine, reading the handle well under one."""
        raw = torch._C._cuda_getCurrentRawStream(self.device_index)
        if raw != self.stream_cache[0]:
            self.stream_cache = (raw, torch.cuda.current_stream(self.device))
        return self.stream_cache[1]

    def _raise_status(self, words: list[int]) -> None:
        """Raise what the status tensor holds (kernels/sync.py), read when the calls before have ended: a kernel error
        in the live word (the layer is broken), else a rejection, the reported one first (both words are then
        cleared and the layer goes on)."""
        live, reported = words[:STATUS_WORDS], words[STATUS_WORDS:]
        if 0 < live[0] < sync.REJECT_FIRST:
            self._raise_on_status(live)
        status = reported if reported[0] != 0 else live
        code = status[0]
        if code == 0:
            return
        self.status.zero_()
        self.status_host.zero_()
        rank, detail, call = status[1:]
        where = (f"in call {call} of this layer; that call, and any made before this error surfaced, returned NaN "
                 "rows (errors of the device-resident call surface at the next call or at synchronize())")
        if code == sync.REJECT_BAD_IDS:
            raise ValueError(f"topk_ids must be in [-1, {self.spec.num_experts}) (-1 = no expert); {detail} ids out of "
                             f"range on rank {rank} {where}")
        if code == sync.REJECT_PEER_FAILED:
            if rank == self.rank:
                return  # this rank raised its own error in that call
            raise PeerError(f"rank {self.rank}: rank {rank} {code_name(detail)} {where}", {rank: code_name(detail)})
        if code == sync.REJECT_CALL_ORDER:
            # the verdict compares (layer identity, creation index, call number); detail is the peer's call number
            peer = ("was in a call of another MoE layer" if detail == call else
                    f"was at its call {detail} (of this layer or another)")
            raise CallOrderError(f"rank {self.rank}: rank {rank} {peer} while this rank was {where}; every rank must "
                                 "call the MoE layers of a process group in the same order")
        raise WeaveError(f"rank {self.rank}: unknown status {status}")

    def synchronize(self) -> None:
        """Wait for the last call (its stream, not the whole GPU) and raise WeaveTimeoutError if its kernel reported
        an error."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        # the kernel's own waits end within self.timeout_s; the bound here only guards against anything else
        self.coordinator.poll(done.query, "synchronize", timeout_s=self.timeout_s + self.coordinator.timeout_s)
        self._raise_status(self.status.tolist())

    def last_timeline(self) -> list:
        """The last call's events as `weave_moe.sim.measured.Event` (cta, kind, start_ns, end_ns, ready_ns), times
        relative to its first event, "spin" events for time outside tasks (timeline=True)."""
        if not self.timeline_events:
            raise RuntimeError("build the layer with timeline=True to record timelines")
        return events_from_buffer(self.timeline_buf.cpu().numpy(), EVENT_NAMES)

    # ---- internals --------------------------------------------------------------------------------------------------
    def _tma_descriptors(self) -> dict:
        return mk_launch.tma_descriptors(self.config, self.constants, self.w13, self.w2)

    def _workload(self, dest: int, counts: LayoutCounts) -> Workload:
        n, local = self.world_size, self.num_local_experts
        return Workload.from_counts(self.spec, n, dest, send_rows=list(counts.send_rows[dest]),
                                    recv_rows=[counts.send_rows[s][dest] for s in range(n)],
                                    expert_rows=list(counts.expert_pairs[dest * local:(dest + 1) * local]),
                                    num_tokens=counts.num_tokens[dest])

    def _plans(self, counts: LayoutCounts) -> list[Plan]:
        """Every rank's plan for this call's counts, memoised on a coarse signature of the workload.

        Planning in Python costs ~0.1 ms per rank on a fast host and ~0.3 ms on the H200 machine's, and the GPU waits
        for it (the plan is a kernel argument). Calls whose workloads agree to within ~4 % in every quantity the cost
        model reads (tokens, rows sent between every pair of ranks, M tiles and largest expert per rank) reuse the
        plans of the first such call. Every rank sees the same counts in the same order, so the memo, and the plans,
        stay identical on every rank.
        """
        key = _plan_key(counts, self.world_size, self.num_local_experts, self.config.block_m)
        plans = self.plan_memo.get(key)
        if plans is None:
            plans = [plan(self._workload(d, counts), self.profile, self.policy) for d in range(self.world_size)]
            if len(self.plan_memo) >= 4096:
                self.plan_memo.clear()
            self.plan_memo[key] = plans
        return plans

    def _layout(self, parity: int):
        """This call's task tables, with the control block and the next call's flags zeroed (one graph replay)."""
        def build():
            self.ctrl.zero_()
            self.workspace.flags(1 - parity).zero_()
            cfg, spec = self.config, self.spec
            all_ids, all_weights, tokens = self.message.unpack(self.all_routing)
            return self.layout_builder(
                all_ids, all_weights, tokens, self.chunks_device, self.rank, spec.num_experts,
                hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, block_m=cfg.block_m,
                block_n0=cfg.block_n0, block_n1=cfg.block_n1, dispatch_rows=cfg.dispatch_rows,
                combine_rows=cfg.combine_rows, reduce_rows=cfg.reduce_rows)

        return self.graphs.run(f"layout{parity}.{self.workspace.generation}", build)

    def _raise_on_status(self, status: list[int]) -> None:
        code = status[0]
        if code == 0:
            return
        what, tag = ERROR_NAMES.get(code, (f"unknown error code {code}", "tag"))
        self.broken = what
        raise WeaveTimeoutError(
            f"weave megakernel on rank {self.rank}: {what} within {self.timeout_s:.1f} s "
            f"({tag} = {status[1]}, counter saw {status[2]} of {status[3]}); a peer stalled, died or ran a "
            "different layer. The caller's tensors are untouched. At EP > 1 every rank calls "
            "weave_moe.backends.weave.workspace.retire_shared(group), then rebuilds the group's layers.")

    def _compile_before_call(self) -> None:
        """A layer's first call: compile every kernel variant a call can launch and line the ranks up
        (`_compile_kernels`, `_line_up`) before the call enqueues anything. The warm-ups run kernels (the grouped
        GEMMs on empty tile tables); had they run after the call's own work was enqueued, as they once did, whatever
        they touched that the call reads would have been overwritten (the decode fault of 13165e6..49f0f99: the warm-up refilled
        the call's tile tables, whose GEMMs then ran no tile). Specialised as the calls are: the resident call's
        dummy x / out (a host-driven call's x and out are 16-byte aligned too, `_aligned_io`, and T is not a
        specialised argument) and the layer's table buffers (a set made for this where it holds none: the tables'
        tensors are all int32 / fp32 of torch's alignment either way)."""
        if self.kernel_variants <= self.compiled:
            return
        tables = self.table_buffers.get(False) or self._new_table_buffers(False)
        dummy = self.workspace.y()[:1]
        self._compile_kernels(*self._megakernel_args(dummy, dummy, tables.layout(), self.fixed_plan, 0))
        self._line_up("the barrier after compiling the kernel")   # before this call's routing exchange

    def _megakernel_args(self, x, out, layout, my_plan: Plan | None, parity: int) -> tuple:
        """(MegakernelArgs, launch options) of a launch for `my_plan` (None: the plan on the device) on `layout`."""
        ws, spec, grid = self.workspace, self.spec, self.num_sms
        serial = my_plan is not None and my_plan.is_serial(grid)
        num_comm_ctas = grid if serial or my_plan is None else my_plan.c
        num_steal = (1 << 30) if serial or my_plan is None else my_plan.n_steal
        if x.shape[0] == 0:  # the kernel never touches x or out then, but needs valid pointers
            x = out = ws.y()[:1]
        args = mk_launch.MegakernelArgs(
            x_ptr=x, out_ptr=out, w13_ptr=self.w13, w2_ptr=self.w2,
            recv_ptr=ws.recv(), h_ptr=ws.h(), y_ptr=ws.y(), comb_ptr=ws.comb(parity),
            peer_base_ptr=ws.peer_bases, recv_offset=ws.recv_offset, comb_offset=ws.comb_offsets[parity],
            flags_offset=ws.flags_offsets[parity], arrival_ptr=ws.flags(parity), comb_flag_ptr=ws.comb_flags(parity),
            ctrl_ptr=self.ctrl, status_ptr=self.live_status, meta_ptr=layout.meta, plan_ptr=self.plans_device,
            io_ptr=self.io, tokens_ptr=self.tokens_word, timeline_ptr=self.timeline_buf,
            dispatch_tasks_ptr=layout.dispatch_tasks, send_token_ptr=layout.send_token,
            send_slot_ptr=layout.send_slot, gemm_tasks_ptr=layout.gemm_tasks, gather_ptr=layout.gather_rows,
            arrival_expected_ptr=layout.arrival_expected, gemm1_expected_ptr=layout.gemm1_expected,
            combine_tasks_ptr=layout.combine_tasks, combine_token_ptr=layout.combine_token,
            combine_pos_ptr=layout.combine_pos, combine_weight_ptr=layout.combine_weight,
            token_mask_ptr=layout.token_dest_mask, combine_expected_ptr=layout.combine_expected,
            rank=self.rank, world_size=self.world_size, max_tokens=self.max_tokens, num_tokens=x.shape[0],
            H=spec.hidden_size, I=spec.intermediate_size,
            num_comm_ctas=num_comm_ctas, num_steal=num_steal,
            timeout_ns=self.timeout_ns, PHASE_FIRST=0, PHASE_LAST=3)
        return args, dict(grid=grid, descriptors=self.descriptors, num_warps=self.config.num_warps,
                          num_stages=self.config.num_stages)

    def _launch(self, x, out, layout, my_plan: Plan | None, parity: int, grouped_configs=None,
                decode: bool = False, early=None, dispatched=None) -> None:
        """Launch the kernel (its stages) for `my_plan`; None: the plan is on the device (`plans_device`, read by the
        kernel: KernelConfig.resident with an adaptive policy), in one launch, or with `grouped_configs` given (a
        layer with `grouped_serial`) as the launches that run the grouped GEMMs if that plan is serial. `decode`:
        the decode compiles of the launches without GEMM (`layout` cut for them, `_table_rows`). `early`: the grouped
        GEMMs' tile tables already forked off (`_grouped_prologue(side=True)`; None: forked here, when they are).
        `dispatched`: the event after the dispatch beside the tables (KernelConfig.early_dispatch or
        dispatch_beside_emit, `_resident_tables`): the rows are sent and have arrived once it has passed, so a
        dispatch-only first launch is left out, a first launch of every phase starts at its GEMM phase (PHASE_FIRST
        1), and the launches wait for the event first.
        The layer has compiled before this call enqueued anything (`_compile_before_call`)."""
        if not self.kernel_variants <= self.compiled:
            raise RuntimeError("weave: internal error: a launch before the layer compiled its kernels (a call must "
                               "run _compile_before_call before it enqueues anything)")
        if not self.first_launch_lined_up:
            # the first call's task-table kernels compiled at their first launch, after the barrier of
            # _compile_before_call (KernelConfig.compile_layout: ~22 s for a fresh process's first layer shape on a
            # fresh machine, ~5 s for each further shape; bench/results/first-call-h200x2-6d28893.json)
            self._line_up("the barrier before the layer's first launch")
            self.first_launch_lined_up = True
        if self.timeline_events:
            self.timeline_buf.zero_()
        args, launch_options = self._megakernel_args(x, out, layout, my_plan, parity)
        serial = my_plan is not None and my_plan.is_serial(self.num_sms)
        if self.debug_skip_launch:
            return
        device_serial = my_plan is None and grouped_configs is not None
        stages = self._stages(serial, device_serial, decode)
        if dispatched is not None:
            if stages[0] in (0, ("decode", 0)):
                stages = stages[1:]
            self._current_stream().wait_event(dispatched)
        configs = (grouped_configs or self._grouped_configs(self.local_rows)) if "grouped" in stages else None
        # a fixed serial plan's first launch is the dispatch alone, which the tile tables do not wait for: they are
        # built beside it, on a side stream, unless the resident call built them beside its emit already (`early`;
        # an adaptive plan's are built there or after its first launch)
        if early is None and configs is not None and not device_serial and self.fork_prologue:
            early = self._grouped_prologue(layout.expert_offsets, _tile_keys(configs), False, side=True)
        for index, stage in enumerate(stages):
            if stage == "grouped":
                # the row gather loads its indices ahead of its wait only behind a launch after the emit's
                self._grouped_gemms(layout, configs, device_serial, early, gather_ahead=index > 0 or
                                    dispatched is None)
                continue
            # after the early dispatch, a first launch of every phase (STAGE -1) starts at the GEMMs (a launch
            # compiled for one stage ignores PHASE_FIRST)
            first = dispatched is not None and index == 0 and self.stage_constants[stage].STAGE < 0
            mk_launch.launch(args=dataclasses.replace(args, PHASE_FIRST=1) if first else args,
                             constants=self.stage_constants[stage], **launch_options)

    def _kernel_variants(self) -> frozenset:
        """The megakernel compiles (`stage_constants` values) a call of this layer can launch; `_compile_kernels`
        compiles them all before the first call enqueues anything. Whether a call runs the serial schedule
        (`_launch`): a fixed plan's answer; an adaptive policy's resident call has its plan on the device and is one
        launch; its host-driven call can be either."""
        serial_choices = ((self.fixed_plan.is_serial(self.num_sms),) if self.fixed_plan is not None
                          else (False,) if self.resident else (False, True))
        decode_choices = (False, True) if self.decode_tokens else (False,)
        stages = [self._stages(serial, decode=decode) for serial in serial_choices for decode in decode_choices]
        if self.grouped_serial:
            stages += [self._stages(False, device_serial=True, decode=decode) for decode in decode_choices]
        return frozenset(self.stage_constants[stage] for launches in stages for stage in launches
                         if stage != "grouped")

    def _stages(self, serial: bool, device_serial: bool = False, decode: bool = False) -> tuple:
        """The launches of one call, in order: keys of `stage_constants` (STAGE -1: phases PHASE_FIRST..PHASE_LAST =
        0..3 in one launch; 0, 1: that stage alone, compiled for it; 4: combine + reduce; (STAGE, "grouped serial"):
        the GROUPED_SERIAL compiles) or "grouped" (the grouped GEMMs, `_grouped_gemms`). `device_serial`: a resident
        adaptive call whose serial plan, decided on the device, runs the grouped GEMMs (the other plans run whole in
        the first launch). `decode`: the launches without GEMM as their decode compiles (`_decode_call`)."""
        combine_reduce = STAGE_COMBINE_REDUCE.value
        if device_serial:
            stages = ((-1, "grouped serial"), "grouped", (combine_reduce, "grouped serial"))
        elif serial and self.grouped:
            stages = (0, "grouped", combine_reduce)
        elif serial and not self.config.fused_serial:
            stages = (0, 1, combine_reduce)
        else:
            stages = (-1,)
        return tuple(("decode", stage) if decode and stage in _ROW_STAGES else stage for stage in stages)

    def _decode_call(self, tokens: int) -> bool:
        """Whether a resident call of `tokens` tokens runs the decode compiles (KernelConfig.decode_stages) and the
        task tables cut for them (`_table_rows`); never without them (a call of T = 0 included)."""
        return 0 < self.decode_tokens and tokens <= self.decode_tokens

    def _table_rows(self, decode: bool) -> dict:
        """Rows per dispatch / combine / reduce task of a call's tables: the compiles' (decode: DECODE_ROWS). A
        table's tasks may hold fewer rows than a launch's blocks (its reduce tasks past the rows then do nothing),
        never more: a decode call's tables serve its other launches too."""
        cfg = self.config
        if decode:
            return dict(dispatch_rows=DECODE_ROWS, combine_rows=DECODE_ROWS, reduce_rows=DECODE_ROWS)
        return dict(dispatch_rows=cfg.dispatch_rows, combine_rows=cfg.combine_rows, reduce_rows=cfg.reduce_rows)

    def _new_table_buffers(self, decode: bool) -> TableBuffers:
        """The memory of the Triton task tables of a call of this layer (decode: `_table_rows`)."""
        cfg, spec, rows = self.config, self.spec, self._table_rows(decode)
        return TableBuffers.for_layer(
            self.world_size, self.max_tokens, spec.top_k, spec.num_experts, hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size, block_m=cfg.block_m, block_n0=cfg.block_n0,
            block_n1=cfg.block_n1, dispatch_rows=rows["dispatch_rows"], combine_rows=rows["combine_rows"],
            device=self.device)

    def _grouped_configs(self, rows: int) -> tuple | None:
        """The (GEMM0, GEMM1) grouped-GEMM configs for about `rows` rows (None when the layer runs no grouped GEMM)."""
        if not (self.grouped or self.grouped_serial):
            return None
        configs = self.grouped_configs.get(rows)
        if configs is None:  # looked up once per row count (the lookup costs tens of microseconds of host time)
            H, I = self.spec.hidden_size, self.spec.intermediate_size
            # KernelConfig.ws_gemm: the table or the Gluon kernels' rule may pick them (gemm_configs, "Kernels")
            configs = tuple(self._held_layout(g, gemm_configs.default_config(
                g, rows, self.num_local_experts, H, I, warp_specialized=self.ws_gemm,
                gathers=self.config.gemm0_gathers(I)))
                for g in (0, 1))
            self.grouped_configs[rows] = configs
        return configs

    def _held_layout(self, gemm: int, config):
        """A grouped-GEMM config (tuned or analytical, for the interleaved w13) as it runs on the w13 this layer
        holds: unchanged when interleaved (and for GEMM1), else GEMM0's gate and up as two MMAs on w13 as given (the
        same tiles of h; the stream-K schedule, written for the interleaved accumulator, dropped)."""
        if gemm != 0 or self.interleaved or not isinstance(config, gemm_configs.GemmConfig) or not config.interleaved:
            return config
        return config.with_(interleaved=False, stream_k=False)

    @property
    def gemm_launch(self) -> dict:
        """The grouped GEMMs' launch options, for the calls and the first call's warm-up alike (a compile per value
        of the first two; `scratch`: the layer's, `_gemm_scratch`). A stream-K config (GemmConfig.stream_k, which the
        tuned table may pick) uses the rest: its parts and flags (the layer's, one pair per size, made when the first
        call compiles every config, outside any CUDA-graph capture), the status word its bounded waits report into
        and their deadline."""
        return dict(early_release=self.config.gemm_early_release, pdl=self.config.grouped_pdl,
                    scratch=self._gemm_scratch, stream_k_scratch=self.stream_k_scratch, status=self.live_status,
                    timeout_ns=self.timeout_ns)

    def _gemm_scratch(self, size: int, alignment: int, stream) -> torch.Tensor:
        """Triton's global scratch for the grouped GEMMs' device-made TMA descriptors: one buffer per size, the
        layer's (not a tensor per launch, which inside a CUDA-graph capture would come from that graph's memory
        pool). One launch at a time uses it: the GEMMs run one after another on the call's stream. Buffers from
        torch's allocator are 512-byte aligned, more than Triton asks for."""
        buffer = self.gemm_scratch.get(size)
        if buffer is None:
            buffer = self.gemm_scratch[size] = torch.empty(size, dtype=torch.int8, device=self.device)
        return buffer

    def _grouped_gemms(self, layout, configs, device_serial: bool = False, early=None,
                       gather_ahead: bool = True) -> None:
        """The serial GEMM stage as grouped GEMMs: gather the received rows into expert order (into y, which GEMM1
        overwrites afterwards; with KernelConfig.gemm0_gather GEMM0 reads them through the gather rows instead),
        GEMM0 + SiLU-mul -> h, GEMM1 -> y (the combine launch after them starts once they have ended: it needs no
        counters of their tiles). `device_serial`: only if this rank's device plan is serial;
        under another plan the gather copies no row and the tile tables hold no tile (the kernel's first launch did
        the GEMMs), all without a host sync. `early`: the side-stream prologue enqueued before the dispatch launch
        (`_resident_tables` or `_launch`; the stage then waits for it). `gather_ahead`: a launch stands between the
        task tables' emit and the row gather on this stream (the dispatch's), so the gather may load its indices
        before it waits for its predecessor (`gather_rows(count_ready=)`); False with the early dispatch, where
        the emit may be the gather's predecessor, still writing them."""
        keys = _tile_keys(configs)
        tables, rows, filled = early or self._grouped_prologue(layout.expert_offsets, keys, device_serial)
        if filled is not None:
            self._current_stream().wait_event(filled)
        chained = self._chains(configs)
        if self._gathers_in_gemm0(configs[0]):  # GEMM0 reads the received rows through the gather rows itself
            self._gemm0(self.workspace.recv(), tables[keys[0]], configs[0], gather=layout.gather_rows, chained=chained)
        else:
            if self.config.scatter_rows:
                meta = META_FIELDS.index("num_combine_tasks")
                self._scatter_rows(layout.gather_rows, layout.combine_pos, layout.combine_tasks,
                                   layout.meta[meta:meta + 1], rows)
            else:
                self._gather_rows(layout.gather_rows, rows, count_ready=filled is not None and gather_ahead)
            self._gemm0(self.workspace.y(), tables[keys[0]], configs[0], chained=chained)
        self._gemm1(tables[keys[1]], configs[1], chained=chained)

    def _gathers_in_gemm0(self, config) -> bool:
        """Whether GEMM0 of `config` reads the received rows through the gather rows (`gemm_configs.reads_gather_rows`:
        the Triton kernel with gemm0_gather, the warp-specialised one with ws_gather), else after the gather launch."""
        return gemm_configs.reads_gather_rows(config, self.config, self.spec.intermediate_size)

    def _chains(self, configs) -> bool:
        """Whether a call's GEMM1 of `configs` is launched programmatically after its GEMM0 (KernelConfig.ws_chain:
        both the warp-specialised decode form; kernels/ws_ring.py, "Chained launches")."""
        return self.ws_chain and all(gemm_configs.kernel_of(c) == "ws_decode" for c in configs)

    def _preloads(self, configs, chain: bool) -> bool:
        """Whether a paired call's GEMM0 of `configs` is launched programmatically after the pair dispatch, its first
        weight blocks loaded before it waits (`chain`: KernelConfig.chain_pairs; the decode form's PRELOAD)."""
        return chain and gemm_configs.kernel_of(configs[0]) == "ws_decode"

    def _gemm0(self, a: torch.Tensor, tiles, config, gather: torch.Tensor | None = None,
               chained: bool = False, preload: bool = False) -> None:
        """h = GEMM0 + SiLU-mul of rows `a` (in expert order, or through `gather`) on `tiles`, with the kernel of
        `config` (`grouped_gemm.launch_gemm`: the Triton grouped GEMM0, or a warp-specialised one, `chained` to the
        GEMM1 after it: `_chains`; `preload`: launched programmatically after the pair dispatch, `_preloads`)."""
        if preload:
            launch = dict(chained=chained, preload=True)
        else:
            launch = dict(chained=True) if chained else self.gemm_launch
        grouped_gemm.launch_gemm(0, config, a, self.w13, self.workspace.h(), tiles, gather=gather, **launch)

    def _gemm1(self, tiles, config, chained: bool = False) -> None:
        """y = GEMM1 of h on `tiles`, as `_gemm0` picks its kernel."""
        launch = dict(chained=True) if chained else self.gemm_launch
        grouped_gemm.launch_gemm(1, config, self.workspace.h(), self.w2, self.workspace.y(), tiles, **launch)

    def _paired_gemms(self, configs, tables, preload: bool = False) -> None:
        """The grouped GEMMs after a pair dispatch (`_resident_paired`), on its tile `tables` (`_grouped_prologue`'s,
        or the counts launch's): GEMM0 reading the pair rows (in expert order, `_pair_rows`) contiguously through
        TMA (no gather; `preload`: launched programmatically after the pair dispatch, `_preloads`), and GEMM1 into y
        (rows in the same expert order; it starts once GEMM0 has ended)."""
        keys, chained = _tile_keys(configs), self._chains(configs)
        self._gemm0(self._pair_rows(), tables[keys[0]], configs[0], chained=chained, preload=preload)
        self._gemm1(tables[keys[1]], configs[1], chained=chained)

    def _grouped_prologue(self, offsets, keys, device_serial: bool, side: bool = False,
                          form: str = "offsets") -> tuple:
        """The grouped GEMMs' tile tables (`grouped_tiles.fill_tile_tables`, one launch) for the
        (block_m, split_tail) `keys` (its compiles depend on their sorted set); `device_serial`: no tile unless
        this rank's device plan is serial. `side`: on the layer's side stream, after the work enqueued so far, beside
        what the current stream runs next (KernelConfig.fork_prologue); the buffers are allocated on the current
        stream, which reads them, and in a CUDA-graph capture the fork and the join are edges of the graph. Returns
        (tables, rows to gather, the event after the launch or None), for `_gather_rows` and the GEMMs. The tables
        are the layer's for these tile kinds (rewritten by every call, as the task tables are: no allocation inside
        the CUDA graph of a row count); the first call's compile fills them too, before that call enqueues anything
        (`_compile_before_call`). `form`: what `offsets` holds (`fill_tile_tables(form=)`: the prefix sum of rows per
        local expert, or the rows themselves)."""
        tables, rows = self._tile_tables(keys)
        fill = functools.partial(grouped_tiles.fill_tile_tables, tables, offsets, rows,
                                 plan=self.plans_device[self.rank, 0:1] if device_serial else None,
                                 num_sms=self.num_sms, form=form)
        if not side:
            fill()
            return tables, rows, None
        return tables, rows, self._fork("prologue", fill)

    def _tile_tables(self, keys) -> tuple:
        """The layer's tile tables for the (block_m, split_tail) `keys` and the rows-to-gather scalar beside them
        (allocated at their first use, on the current stream; rewritten by every call that uses them)."""
        kinds = tuple(sorted(set(keys)))
        buffers = self.tile_buffers.get(kinds)
        if buffers is None:   # sized by E_local + 1 offsets
            shape = torch.empty(self.num_local_experts + 1, dtype=torch.int32, device=self.device)
            buffers = self.tile_buffers[kinds] = (grouped_tiles.empty_tile_tables(shape, kinds, self.max_pairs),
                                                  torch.empty(1, dtype=torch.int32, device=self.device))
        return buffers

    def _fork(self, name: str, enqueue) -> torch.cuda.Event:
        """Enqueue `enqueue()` on the layer's side stream for `name` (made at its first use) after the work enqueued so
        far on the current stream, beside what the current stream runs next; returns the event after it, for the join.
        In a CUDA-graph capture the fork and the join are edges of the graph."""
        stream = self.side_streams.get(name)
        if stream is None:
            stream = self.side_streams[name] = torch.cuda.Stream(self.device)
        stream.wait_stream(self._current_stream())
        with torch.cuda.stream(stream):
            enqueue()
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def _gather_rows(self, index, rows, count_ready: bool) -> None:
        """The received rows into expert order for the grouped GEMMs (into y, which GEMM1 overwrites afterwards):
        `rows` (the prologue's device scalar) rows of recv at `index`. `count_ready`: the prologue was forked and
        joined before this launch (`gather_rows(count_ready=)`)."""
        grouped_tiles.gather_rows(self.workspace.recv(), index, self.workspace.y(), rows, 4 * self.num_sms,
                                  count_ready=count_ready)

    def _scatter_rows(self, index, pos, tasks, num_tasks, rows) -> None:
        """`_gather_rows`' copy by received row (KernelConfig.scatter_rows): each received row of recv read once and
        written to its pairs' rows in y, listed by the layout's combine tables (`pos`, `tasks` and their count
        `num_tasks`); `rows` 0 copies nothing."""
        grouped_tiles.scatter_rows(self.workspace.recv(), index, pos, self.workspace.y(), tasks, num_tasks, rows,
                                   4 * self.num_sms, COMBINE_COLUMNS.index("start"), COMBINE_COLUMNS.index("count"))

    def _compile_kernels(self, args, launch_options) -> None:
        """Compile every megakernel variant a call can launch (`kernel_variants`), every grouped-GEMM config it may
        pick and the dispatches beside the tables (KernelConfig.early_dispatch, dispatch_beside_emit), for these
        arguments' specialisation. Called by `_compile_before_call` before a call enqueues anything, so what the warm-ups write (the layer's tile tables,
        filled with no tile) is rewritten by the call before it is read; its `_line_up` right after waits for the
        warm-up launches to end."""
        for constants in sorted(self.kernel_variants, key=lambda variant: variant.STAGE):
            mk_launch.warmup(args=args, constants=constants, **launch_options)
        chains = self._paired_chains()   # KernelConfig.chain_pairs (none without the pair dispatch)
        if self.grouped or self.grouped_serial:  # compile every grouped-GEMM variant a call may pick, on no tiles
            empty = torch.zeros(self.num_local_experts + 1, dtype=torch.int32, device=self.device)
            y = self.workspace.y()
            shape = (self.num_local_experts, self.spec.hidden_size, self.spec.intermediate_size)
            configs = [[self._held_layout(gemm, c)
                        for c in gemm_configs.default_configs(gemm, *shape, warp_specialized=self.ws_gemm)]
                       for gemm in (0, 1)]
            for config in configs[0]:
                table = grouped_tiles.build_tile_table(empty, config.block_m, self.max_pairs, config.split_tail)
                # gemm0_gather: the receive buffer through any int32 rows (the tables hold no tile, nothing reads
                # them); the pair rows in y (_paired_gemms); the gathered rows in y (the gather launch's)
                # KernelConfig.ws_chain: a Gluon GEMM0 chained to a Gluon GEMM1 too (_chains)
                for chained in (False, True) if self._chains([config]) else (False, ):
                    if self._gathers_in_gemm0(config):
                        self._gemm0(self.workspace.recv(), table, config, gather=self.ctrl, chained=chained)
                    if not self._gathers_in_gemm0(config):
                        self._gemm0(y, table, config, chained=chained)
                    if self.pair_dispatches:   # the pair rows where the pair dispatch leaves them (_paired_gemms)
                        self._gemm0(self._pair_rows(), table, config, chained=chained)
                    if self._preloads([config], True in chains):   # the chained paired call's GEMM0
                        self._gemm0(y, table, config, chained=chained, preload=True)
            for config in configs[1]:
                table = grouped_tiles.build_tile_table(empty, config.block_m, self.max_pairs, config.split_tail)
                for chained in (False, True) if self._chains([config]) else (False, ):
                    self._gemm1(table, config, chained=chained)
            # the (GEMM0, GEMM1) pairs of tile kinds a call may take
            for pair in {tuple(sorted(set(_tile_keys((c0, c1))))) for c0 in configs[0] for c1 in configs[1]}:
                _, rows, _ = self._grouped_prologue(empty, pair, self.grouped_serial)
                if not self.gemm0_gather or self.ws_gemm:   # otherwise a call makes no gather launch
                    # both compiles: after a forked prologue (its count read ahead: here a count written long
                    # before, the zeros) and after one on this stream (here the prologue just enqueued)
                    self._gather_rows(self.ctrl, empty[-1:], count_ready=True)
                    self._gather_rows(self.ctrl, rows, count_ready=False)
                    if self.config.scatter_rows:   # a zero count: no table read, nothing written
                        pos = self.ctrl[:self.spec.top_k].view(1, -1)
                        tasks = self.ctrl[:len(COMBINE_COLUMNS)].view(1, -1)
                        self._scatter_rows(self.ctrl, pos, tasks, empty[-1:], empty[-1:])
                if True in chains:
                    # the counts launch fills them (allocated here, outside any capture), compiled for them here: a
                    # chained call may come first under a caller's capture (chain_pairs="capture")
                    tables = list(self._tile_tables(pair)[0].values())
                    self.device_counts.warmup(self.all_routing, self.live_status, self.rank, verdict=True,
                                              plans=self._counts_plans(), tiles=tables)
                if False in chains:
                    # the prologue from the counts' pairs (_resident_paired), on zeros placed as the counts' pairs
                    # are (the same specialisation): no row, no tile. Not on the counts buffer itself, whose
                    # contents before a first call are anything (an H100 run at 81dd1fe: a prior layer's memory
                    # there made the gather warm-up after it read past the buffers)
                    self._grouped_prologue(self._pairs(torch.zeros_like(self.device_counts.counts), local=True),
                                           pair, False, form="counts")
        if self.early_dispatch is not None or self.tables_dispatch is not None or self.pair_dispatches:
            all_ids, all_weights, tokens = self.message.unpack(self.all_routing)
        if self.early_dispatch is not None:
            self.early_dispatch.warmup(all_ids, tokens, self.plans_device[:, 1], self.io, self.workspace,
                                       self.live_status, self.rank, self.timeout_ns)
        for dispatch, low, high in self._pair_classes():
            rows = self.pair_rows[:dispatch.rows_shape[0]]
            for chain in sorted(self._paired_chains(low, high)):
                dispatch.warmup(all_ids, tokens, self._pairs(self.device_counts.counts), self.io, self.workspace,
                                self.live_status, self.rank, self.timeout_ns, None, rows, self._local_pair_rows(),
                                pdl=chain)
                if self.pair_combine is not None:
                    self.pair_combine.warmup(self.workspace.y(), rows, all_weights, tokens, self.io,
                                             self.live_status, self.rank, pdl=chain,
                                             report=(self.status, self.status_host))
        if self.peer_pair_combine is not None:
            self.peer_pair_combine.warmup(all_ids, all_weights, tokens, self.workspace.y(), self.io, self.workspace,
                                          self.live_status, self.rank, self.timeout_ns)
        if self.tables_dispatch is not None:
            self.tables_dispatch.warmup(self.table_buffers[False], tokens, self.plans_device[:, 1], self.io,
                                        self.workspace, self.live_status, self.rank, self.timeout_ns)
        self.compiled |= self.kernel_variants

    def _line_up(self, what: str) -> None:
        """Wait for this rank's work so far, then for every rank to get here (bounded: max(timeout_s,
        COMPILE_SKEW_S)), so that no rank's waits for a peer time out while that peer is still compiling (a cold
        compile takes far longer than the kernels' deadlines)."""
        torch.cuda.synchronize(self.device)
        if self.world_size > 1:
            work = torch.distributed.barrier(group=self.group, async_op=True)
            self.coordinator.poll(work.is_completed, what, timeout_s=max(self.coordinator.timeout_s, COMPILE_SKEW_S))
            work.wait()
