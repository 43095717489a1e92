"""Host side of the Weave megakernel: routing exchange, planning, task tables, launch.

One call (one layer, one rank):
  1. pack this rank's top-k ids and weights (+ its token count) and all-gather them (a few hundred KB over NVLink);
  2. count rows per (source, destination) and pairs per expert on the device, and copy those counts to the host:
     the one host sync of the call (it also returns the previous call's status word, so a kernel error surfaces at
     the latest on the next call, or at `synchronize()`);
  3. plan every rank from the same counts (deterministic, so every rank knows every destination's chunk count K);
  4. build this rank's task tables on the device (`weave_moe.backends.weave.layout`) and launch the megakernel (or, for the
     `serial` policy, the same kernel once per stage).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from weave_moe.backends import raise_on_bad_ids
from weave_moe.backends.weave.kernels import megakernel as mk
from weave_moe.backends.weave.kernels.sync import ERROR_NAMES
from weave_moe.backends.weave.layout import MAX_CHUNKS, build_layout, count_routing, pack_routing, parse_counts, routing_pad
from weave_moe.models import MoESpec
from weave_moe.plan import HardwareProfile, Plan, Workload, plan
from weave_moe.plan.cost_model import parse_policy
from weave_moe.backends.weave.workspace import SymmetricWorkspace

__all__ = ["WeaveBackend", "WeaveError", "WeaveTimeoutError", "KernelConfig"]


class WeaveError(RuntimeError):
    """The megakernel reported an error; the layer's buffers are in an unknown state (rebuild the layer)."""


class WeaveTimeoutError(WeaveError):
    """A bounded wait in the megakernel ran past its deadline (a peer stalled or died)."""


class _HostClock:
    """Adds the host time between laps to `totals` (a dict) when it is not None; costs nothing otherwise."""

    def __init__(self, totals):
        import time

        self.totals, self.now = totals, time.perf_counter
        self.last = self.now() if totals is not None else 0.0

    def lap(self, name: str) -> None:
        if self.totals is not None:
            now = self.now()
            self.totals[name] = self.totals.get(name, 0.0) + (now - self.last) * 1e3
            self.last = now


class KernelConfig:
    """Tile shapes and launch settings of the megakernel (tests and calibration may override)."""

    def __init__(self, block_m=128, block_n0=128, block_n1=256, block_k=64, dispatch_rows=16, combine_rows=16,
                 reduce_rows=16, block_h=512, num_warps=8, num_stages=3, dot_fp32=False, stages0=4, stages1=4,
                 block_k1=64, fused_serial=False, tma=True, compile_layout=True):
        self.block_m, self.block_n0, self.block_n1, self.block_k = block_m, block_n0, block_n1, block_k
        self.dispatch_rows, self.combine_rows, self.reduce_rows = dispatch_rows, combine_rows, reduce_rows
        self.block_h, self.num_warps, self.num_stages, self.dot_fp32 = block_h, num_warps, num_stages, dot_fp32
        self.stages0, self.stages1 = stages0, stages1  # software-pipeline depth of the GEMM0 / GEMM1 K loops
        self.block_k1 = block_k1                        # K step of GEMM1 (its K is I, often short)
        # The serial schedule (c = N) as ONE launch: every CTA dispatches, then every CTA takes GEMM tiles, combine and
        # reduce tasks, ordered by the kernel's flags instead of three launch boundaries (saves three launches of host
        # time and the gaps between them). Off: on the H200 pair it measured 1.002x the three launches (fef48c7,
        # bench/results/ab/summary.json), within noise.
        self.fused_serial = fused_serial
        # Expert weights through the bulk tensor copy engine (host-built descriptors, once per layer); used when
        # H and I are multiples of 8 (16-byte rows) and block_n1 >= 256. On: 1.027x faster weave calls on the H200 pair
        # (geomean of 12 rows, every row faster, up to 1.057x on deepseek-v3 at 8192 tokens; fef48c7,
        # bench/results/ab/summary.json).
        self.tma = tma
        # The task tables through torch.compile (Inductor fuses the elementwise chains into a few Triton kernels),
        # then captured as before: the eager layout graph holds ~260 small kernels, each ~1-2 us of GPU time even when
        # replayed from a graph, on the critical path of every call. Costs a compile per layer shape and rank (seconds,
        # on the first call). On: 1.19x faster weave calls on the H200 pair (geomean of 12 rows; 1.35x at 2048 tokens,
        # where this host-side chain dominates; fef48c7). compile_layout=0 in WEAVE_MOE_KERNEL_CONFIG turns it off.
        self.compile_layout = compile_layout

    @classmethod
    def from_env(cls) -> "KernelConfig":
        """Defaults, overridden by WEAVE_MOE_KERNEL_CONFIG="block_n0=128,num_stages=4" (tuning sweeps)."""
        text = os.environ.get("WEAVE_MOE_KERNEL_CONFIG", "").strip()
        values = {}
        for item in filter(None, text.split(",")):
            key, _, value = item.partition("=")
            values[key.strip()] = value.strip() not in ("0", "false", "False") \
                if key.strip() in ("dot_fp32", "fused_serial", "tma", "compile_layout") else int(value)
        return cls(**values)

    def __repr__(self) -> str:
        return "KernelConfig(" + ", ".join(f"{k}={v}" for k, v in vars(self).items()) + ")"


_COMPILED_BUILD_LAYOUT = None
#: Layer shapes (and ranks) one process may compile the task tables for before falling back to eager tables. Dynamo
#: keeps one cache per code object with a limit of 8 entries by default, and fullgraph=True turns hitting it into an
#: error: a process with more than 8 layer shapes (the validation suite) failed that way on the H200 pair (bb8bd82).
LAYOUT_COMPILE_LIMIT = 64


def _compiled_build_layout():
    """`build_layout` through torch.compile (one compile per layer shape; static shapes, no graph breaks)."""
    global _COMPILED_BUILD_LAYOUT
    if _COMPILED_BUILD_LAYOUT is None:
        _COMPILED_BUILD_LAYOUT = torch.compile(build_layout, fullgraph=True, dynamic=False)
    return _COMPILED_BUILD_LAYOUT


def build_layout_compiled_or_eager(*args, **kwargs):
    """`build_layout` through torch.compile, or eagerly (with a warning) if compiling fails, e.g. past
    LAYOUT_COMPILE_LIMIT shapes. Returns (layout, compiled: bool); the caller keeps using eager tables once it is
    False. Both give the same tables bit for bit (tests/test_layout.py)."""
    import torch._dynamo.config as dynamo_config

    field = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    try:
        with dynamo_config.patch(**{field: LAYOUT_COMPILE_LIMIT}):
            return _compiled_build_layout()(*args, **kwargs), True
    except Exception as error:  # noqa: BLE001 - any compile failure: the eager tables are the same
        import warnings

        warnings.warn(f"weave: torch.compile of the task tables failed ({type(error).__name__}: "
                      f"{str(error)[:200]}); building them eagerly for this layer")
        return build_layout(*args, **kwargs), False


def _quantize(value: int) -> int:
    """~4 % wide logarithmic buckets (0 stays 0)."""
    return 0 if value <= 0 else int(round(16.0 * math.log2(1.0 + value)))


def _plan_key(counts, world_size: int, num_local: int, block_m: int) -> tuple:
    """A coarse signature of every rank's workload: what the cost model reads, bucketed by `_quantize`."""
    key = []
    for d in range(world_size):
        rows = counts.expert_pairs[d * num_local:(d + 1) * num_local]
        m_tiles = sum(-(-r // block_m) for r in rows)
        key.append((_quantize(counts.num_tokens[d]), _quantize(m_tiles), _quantize(max(rows, default=0)),
                    tuple(_quantize(v) for v in counts.send_rows[d])))
    return tuple(key)


class WeaveBackend:
    """The `weave` backend (see module docstring). Follows the Backend contract of docs/architecture.md.

    Options:
        profile: HardwareProfile for the planner (default: the shipped H200 profile).
        timeout_s: deadline of every wait inside the kernel (default 5 s, env WEAVE_MOE_TIMEOUT_S).
        timeline: record per-task %globaltimer events (see `last_timeline`).
        num_sms: CTAs of the persistent grid (default: the device's SM count).
        config: KernelConfig.
        debug_skip_launch: test hook; this rank skips its kernel launch (a stalled peer).
        debug_poison: fill each output with NaN before the launch, so a row the kernel never writes fails checks.
        use_cuda_graph: build the task tables by replaying one captured CUDA graph (default) instead of ~150 eager
            torch ops; the tables have static shapes, so one capture serves every call.
    """

    #: ids outside [-1, E) are found in the counts this backend reads anyway: the layer skips its own host sync
    checks_expert_ids = True

    def __init__(self, spec: MoESpec, group, rank: int, world_size: int, max_tokens_per_rank: int,
                 device: torch.device, policy: str = "weave", *, profile: HardwareProfile | None = None,
                 timeout_s: float | None = None, timeline: bool = False, num_sms: int | None = None,
                 config: KernelConfig | None = None, debug_skip_launch: bool = False, debug_poison: bool = False,
                 use_cuda_graph: bool | None = None):
        if device.type != "cuda":
            raise RuntimeError("the weave backend runs on CUDA GPUs only; use backend='nccl' or 'reference' on CPU")
        if world_size > 31:
            raise ValueError(f"the weave backend supports EP <= 31 (one bit per rank in a 32-bit mask), got {world_size}")
        self.spec, self.group, self.rank, self.world_size = spec, group, rank, world_size
        self.max_tokens, self.device, self.policy = max_tokens_per_rank, device, policy
        self.profile = profile or HardwareProfile.default()
        self.timeout_ns = int(1e9 * (timeout_s if timeout_s is not None else
                                     float(os.environ.get("WEAVE_MOE_TIMEOUT_S", "5"))))
        self.timeline = timeline
        self.config = config or KernelConfig.from_env()
        self.debug_skip_launch = debug_skip_launch
        self.debug_poison = debug_poison
        self.num_sms = num_sms or torch.cuda.get_device_properties(device).multi_processor_count
        # Validates the policy string now, not at the first call. `serial` and `static:<c>,<K>` do not depend on the
        # routing, so their plan is made once here and the per-call planning (two Python plans per call at EP=2,
        # ~0.3 ms of host time on the H200 machine) is skipped.
        zero_plan = plan(self._workload_for(0, [[0] * world_size] * world_size, [0] * spec.num_experts,
                                            [0] * world_size), self.profile, policy)
        # Its predicted_us is NaN: a prediction needs this call's workload, which these policies never look at.
        self.fixed_plan = (dataclasses.replace(zero_plan, predicted_us=float("nan"))
                           if parse_policy(policy)[0] in ("serial", "static") else None)

        E, k, H, I = spec.num_experts, spec.top_k, spec.hidden_size, spec.intermediate_size
        self.num_local = E // world_size
        cfg = self.config
        self.workspace = SymmetricWorkspace(group, rank, world_size, max_tokens_per_rank, H, device)
        max_pairs = world_size * max_tokens_per_rank * min(k, self.num_local)
        self.h = torch.empty(max(max_pairs, 1), I, dtype=torch.bfloat16, device=device)
        self.y = torch.empty(max(max_pairs, 1), H, dtype=torch.bfloat16, device=device)
        max_mtiles = max_pairs // cfg.block_m + MAX_CHUNKS * self.num_local + 1
        self.ctrl = torch.zeros(mk.CTRL_SIZE_FIXED + max_mtiles, dtype=torch.int32, device=device)
        self.status = torch.zeros(4, dtype=torch.int32, device=device)
        words = 2 * max_tokens_per_rank * k + 1
        self.send_routing = torch.empty(words, dtype=torch.int32, device=device)
        self.routing_pad = routing_pad(max_tokens_per_rank * k, device)
        self.token_counts = torch.arange(max_tokens_per_rank + 1, dtype=torch.int32, device=device)
        self.all_routing = torch.empty(world_size, words, dtype=torch.int32, device=device)
        self.timeline_buf = (torch.zeros(self.num_sms, 2048, 4, dtype=torch.int64, device=device)
                             if timeline else torch.zeros(1, dtype=torch.int64, device=device))
        #: host milliseconds per step of forward, summed over calls (WEAVE_MOE_HOST_TIMING=1 turns it on)
        self.host_ms = {} if os.environ.get("WEAVE_MOE_HOST_TIMING") == "1" else None
        self.chunks_host = torch.zeros(world_size, dtype=torch.long).pin_memory()
        self.chunks_device = torch.ones(world_size, dtype=torch.long, device=device)
        self.last_chunks = None
        n_counts = world_size + world_size * world_size + spec.num_experts + world_size + 4
        self.counts_host = torch.zeros(n_counts, dtype=torch.int32).pin_memory()
        self.counts_ready = torch.cuda.Event()
        self.comb_flags = tuple(self.workspace.flags(p)[world_size * MAX_CHUNKS:] for p in (0, 1))
        self.use_cuda_graph = (os.environ.get("WEAVE_MOE_CUDA_GRAPH", "1") != "0" if use_cuda_graph is None
                               else use_cuda_graph)
        self.graphs = {}          # name -> (CUDAGraph, its static output)
        self.calls = 0
        self.compiled = set()
        self.last_plan: Plan | None = None
        self.last_plans: list[Plan] = []
        self.plan_memo: dict = {}
        self.broken: str | None = None
        self.w13 = self.w2 = None
        self.descriptors: dict = {}
        self.compile_layout = self.config.compile_layout  # False from the first failed compile on (eager tables)
        self.use_tma = bool(self.config.tma and spec.hidden_size % 8 == 0 and spec.intermediate_size % 8 == 0
                            and self.config.block_n1 >= 256)

    # ---- contract ---------------------------------------------------------------------------------------------------
    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13, self.w2 = w13.contiguous(), w2.contiguous()
        self.descriptors = self._tma_descriptors() if self.use_tma else {}

    def _tma_descriptors(self) -> dict:
        """Host tensor descriptors of w13 [E_local*2I, H] and w2 [E_local*H, I] for the TMA tiles."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        cfg, H, I = self.config, self.spec.hidden_size, self.spec.intermediate_size
        return dict(
            USE_TMA=True,
            w13_desc=TensorDescriptor.from_tensor(self.w13.view(-1, H), [cfg.block_n0, cfg.block_k]),
            w2_desc=TensorDescriptor.from_tensor(self.w2.view(-1, I), [cfg.block_n1 // 2, cfg.block_k1]))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.broken:
            raise WeaveError(f"this layer failed earlier ({self.broken}); build a new layer")
        spec, T = self.spec, x.shape[0]
        clock = _HostClock(self.host_ms)
        # 1. routing exchange: [ids (T_max*k, -1 padded) | weights as int32 bits | T]
        pack_routing(self.send_routing, topk_ids, topk_weights, self.routing_pad, self.token_counts)
        if self.world_size > 1:
            torch.distributed.all_gather_into_tensor(self.all_routing, self.send_routing, group=self.group)
        else:
            self.all_routing.copy_(self.send_routing[None])
        # 2. counts to the host (the one sync), with the previous call's status word. While the host waits, the GPU
        #    already builds this call's task tables with the previous call's chunk counts (a pure function of the
        #    routing and the counts, so it is simply built again below in the rare call whose plan changes K).
        clock.lap("exchange")
        counts_device = self._counts_and_status()
        self.counts_host.copy_(counts_device, non_blocking=True)
        self.counts_ready.record(torch.cuda.current_stream(self.device))
        parity = self.calls % 2
        layout = self._layout(parity) if self.last_chunks is not None else None
        out = torch.empty(T, spec.hidden_size, dtype=torch.bfloat16, device=self.device)
        if self.debug_poison:
            out.fill_(float("nan"))
        self.counts_ready.synchronize()
        host = self.counts_host.tolist()
        clock.lap("sync")
        self._raise_on_status(host[-4:])
        ep = self.world_size
        # Every rank sees every rank's count and raises here, before any kernel of this call: the layer stays usable.
        raise_on_bad_ids(host[-4 - ep:-4], spec.num_experts)
        counts = parse_counts(host[:-4 - ep], self.world_size, spec.num_experts)
        # 3. every rank's plan (same counts everywhere -> same plans everywhere)
        if self.fixed_plan is not None:
            plans = [self.fixed_plan] * self.world_size
        else:
            plans = self._plans(counts)
        my_plan = plans[self.rank]
        self.last_plan, self.last_plans = my_plan, plans
        clock.lap("plan")
        # 4. task tables (one CUDA-graph replay, unless built above with the right chunk counts) and launch
        chunks = [p.K for p in plans]
        if not all(1 <= c <= MAX_CHUNKS for c in chunks):
            raise ValueError(f"planner returned chunk counts {chunks}; each must lie in [1, {MAX_CHUNKS}]")
        if chunks != self.last_chunks:
            self.chunks_host[: self.world_size] = torch.tensor(chunks)
            self.chunks_device.copy_(self.chunks_host, non_blocking=True)
            self.last_chunks = chunks
            layout = self._layout(parity)
        clock.lap("layout")
        self._launch(x, out, layout, my_plan)
        clock.lap("launch")
        self.calls += 1
        return out

    def synchronize(self) -> None:
        """Wait for the last call (its stream, not the whole GPU) and raise WeaveTimeoutError if its kernel reported
        an error."""
        torch.cuda.current_stream(self.device).synchronize()
        self._raise_on_status(self.status.tolist())

    def last_timeline(self) -> list:
        """The last call's events as `weave_moe.sim.measured.Event` (cta, kind, start_ns, end_ns, ready_ns), times
        relative to its first event, "spin" events for time outside tasks (timeline=True)."""
        from weave_moe.sim.measured import events_from_buffer

        if not self.timeline:
            raise RuntimeError("build the layer with timeline=True to record timelines")
        return events_from_buffer(self.timeline_buf.cpu().numpy(), mk.EVENT_NAMES)

    # ---- internals --------------------------------------------------------------------------------------------------
    def _workload_for(self, dest, send_rows, expert_pairs, num_tokens) -> Workload:
        n = self.world_size
        local = self.spec.num_experts // n
        return Workload.from_counts(self.spec, n, dest, send_rows=list(send_rows[dest]),
                                    recv_rows=[send_rows[s][dest] for s in range(n)],
                                    expert_rows=list(expert_pairs[dest * local:(dest + 1) * local]),
                                    num_tokens=num_tokens[dest])

    def _plans(self, counts) -> list[Plan]:
        """Every rank's plan for this call's counts, memoised on a coarse signature of the workload.

        Planning in Python costs ~0.1 ms per rank on a fast host and ~0.3 ms on the H200 machine's, and the GPU waits
        for it (the plan is a kernel argument). Calls whose workloads agree to within ~4 % in every quantity the cost
        model reads (tokens, rows sent between every pair of ranks, M tiles and largest expert per rank) reuse the
        plans of the first such call. Every rank sees the same counts in the same order, so the memo, and the plans,
        stay identical on every rank.
        """
        key = _plan_key(counts, self.world_size, self.num_local, self.config.block_m)
        plans = self.plan_memo.get(key)
        if plans is None:
            plans = [plan(self._workload_for(d, counts.send_rows, counts.expert_pairs, counts.num_tokens),
                          self.profile, self.policy) for d in range(self.world_size)]
            if len(self.plan_memo) >= 4096:
                self.plan_memo.clear()
            self.plan_memo[key] = plans
        return plans

    def _build_layout(self):
        cfg, spec, k = self.config, self.spec, self.spec.top_k
        words = self.max_tokens * k
        all_ids = self.all_routing[:, :words].view(self.world_size, self.max_tokens, k)
        all_weights = self.all_routing[:, words:2 * words].view(torch.float32).view(self.world_size, self.max_tokens, k)
        args = (all_ids, all_weights, self.all_routing[:, -1], self.chunks_device, self.rank, spec.num_experts)
        kwargs = dict(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, block_m=cfg.block_m,
                      block_n0=cfg.block_n0, block_n1=cfg.block_n1, dispatch_rows=cfg.dispatch_rows,
                      combine_rows=cfg.combine_rows, reduce_rows=cfg.reduce_rows)
        if self.compile_layout:
            layout, self.compile_layout = build_layout_compiled_or_eager(*args, **kwargs)
            return layout
        return build_layout(*args, **kwargs)

    def _counts_and_status(self) -> torch.Tensor:
        """[EP tokens | EP*EP send rows | E expert pairs | EP bad ids | 4 status words] int32, from the static routing
        buffers. Ids outside [-1, E) are counted per source rank and replaced by -1 in place, so nothing downstream
        (counts, task tables) indexes out of range; the host then raises on every rank together."""
        def build():
            k, E = self.spec.top_k, self.spec.num_experts
            ids = self.all_routing[:, :self.max_tokens * k]
            bad = (ids < -1) | (ids >= E)
            bad_ids = bad.sum(dim=1, dtype=torch.int32)
            ids.masked_fill_(bad, -1)
            all_ids = ids.view(self.world_size, self.max_tokens, k)
            counts = count_routing(all_ids, self.all_routing[:, -1], E)
            return torch.cat([counts, bad_ids, self.status])

        return self._replay("counts", build)

    def _layout(self, parity: int):
        """This call's task tables, with the control block and the next call's flags zeroed (one graph replay)."""
        def build():
            self.ctrl.zero_()
            self.workspace.flags(1 - parity).zero_()
            return self._build_layout()

        return self._replay(f"layout{parity}", build)

    def _replay(self, name: str, build):
        """Run `build` (torch ops on static buffers, static shapes) as a captured CUDA graph: one replay instead of
        dozens of launches, each of which costs ~30 us of host time on the H200 machine. Falls back to eager
        execution, with a warning, if capture fails.

        The first call of a name runs `build` eagerly (the warm-up) and returns that run's result; the capture that
        follows records without executing. `build` need not be idempotent: the counts graph masks bad expert ids in
        place, so running it twice on one call's routing would count them once and report zero the second time.
        """
        if not self.use_cuda_graph:
            return build()
        if name in self.graphs:
            graph, output = self.graphs[name]
            graph.replay()
            return output
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            # this call's result, and the warm-up of the capture (allocator, lazy inits). Its tensors come from the
            # side stream's pool and the kernel reads them on the current stream; the synchronize below orders that
            # read after they are written, and a block freed later can only be reused by another warm-up on a side
            # stream, which first waits for the current stream (the wait_stream above), so after the kernel.
            first = build()
        # Capture with nothing in flight and in thread-local mode: the NCCL watchdog thread polls events of
        # pending collectives, and in the default ("global") mode such a call from another thread during the
        # capture invalidates it and errors in the watchdog (suspected cause of a hang seen once on the H200
        # pair when the counts graph was captured right behind the routing all-gather).
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                output = build()
        except RuntimeError as error:  # an op that synchronises cannot be captured
            import warnings

            warnings.warn(f"weave: CUDA graph capture of {name} failed ({error}); running it eagerly")
            self.use_cuda_graph = False
            return first
        self.graphs[name] = (graph, output)
        return first

    def _raise_on_status(self, status: list[int]) -> None:
        code = status[0]
        if code == 0:
            return
        what, tag = ERROR_NAMES.get(code, (f"unknown error code {code}", "tag"))
        self.broken = what
        raise WeaveTimeoutError(
            f"weave megakernel on rank {self.rank}: {what} within {self.timeout_ns / 1e9:.1f} s "
            f"({tag} = {status[1]}, counter saw {status[2]} of {status[3]}); a peer stalled, died or ran a "
            "different layer. The caller's tensors are untouched; rebuild the layer.")

    def _launch(self, x, out, layout, my_plan: Plan) -> None:
        ws, cfg, spec = self.workspace, self.config, self.spec
        parity = self.calls % 2
        if self.timeline:
            self.timeline_buf.zero_()
        flags = ws.flags(parity)
        grid = self.num_sms
        serial = my_plan.c >= grid
        if x.shape[0] == 0:  # the kernel never touches x or out then, but needs valid pointers
            x = out = self.y[:1]
        args = (
            x, out,
            self.w13, self.w2, ws.recv(), self.h, self.y, ws.comb(parity),
            ws.peer_bases, ws.recv_offset, ws.comb_offsets[parity], ws.flags_offsets[parity],
            flags, self.comb_flags[parity],
            self.ctrl, self.status, layout.meta, self.timeline_buf,
            layout.dispatch_tasks, layout.send_token, layout.send_slot,
            layout.gemm_tasks, layout.gather_rows, layout.arrival_expected, layout.gemm1_expected,
            layout.combine_tasks, layout.combine_token, layout.combine_pos, layout.combine_weight,
            layout.token_dest_mask, layout.combine_expected,
            self.rank, self.world_size, self.max_tokens, x.shape[0], spec.hidden_size, spec.intermediate_size,
        )
        constexprs = dict(
            TOP_K=spec.top_k, MAX_CHUNKS=MAX_CHUNKS, BLOCK_M=cfg.block_m, BLOCK_N0=cfg.block_n0,
            BLOCK_N1=cfg.block_n1, BLOCK_K=cfg.block_k, DISPATCH_ROWS=cfg.dispatch_rows,
            COMBINE_ROWS=cfg.combine_rows, REDUCE_ROWS=cfg.reduce_rows, BLOCK_H=cfg.block_h,
            DOT_FP32=cfg.dot_fp32, TIMELINE=self.timeline, MAX_EVENTS=self.timeline_buf.shape[1] if self.timeline else 1,
            STAGES0=cfg.stages0, STAGES1=cfg.stages1, BLOCK_K1=cfg.block_k1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_cooperative_grid=True,
        )
        stages = [(0, 0), (1, 1), (2, 2), (3, 3)] if serial and not cfg.fused_serial else [(0, 3)]
        comm = grid if serial else my_plan.c
        steal = (1 << 30) if serial else my_plan.n_steal
        self._ensure_compiled(args, constexprs, comm, steal)
        if self.debug_skip_launch:
            return
        for first, last in stages:
            mk.moe_megakernel[(grid,)](*args, comm, steal, self.timeout_ns, first, last, **constexprs,
                                       **self.descriptors)

    def _ensure_compiled(self, args, constexprs, comm, steal) -> None:
        """Compile before the first launch and line the ranks up, so no rank's waits time out while a peer is still
        compiling (a cold compile takes far longer than the kernel's deadlines). The first call's task-table compile
        (KernelConfig.compile_layout: ~22 s for a fresh process's first layer shape on a fresh machine, ~5 s for each
        further shape; bench/results/first-call-h200x2-6d28893.json) happens before this barrier too."""
        key = tuple(sorted((k, v) for k, v in constexprs.items()))
        if key in self.compiled:
            return
        mk.moe_megakernel.warmup(*args, comm, steal, self.timeout_ns, 0, 3, grid=(self.num_sms,), **constexprs,
                                 **self.descriptors)
        torch.cuda.synchronize(self.device)
        if self.world_size > 1:
            torch.distributed.barrier(group=self.group)
        self.compiled.add(key)
