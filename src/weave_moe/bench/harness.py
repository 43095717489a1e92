"""The benchmark harness: models x tokens per rank x routing x variants, every variant on the same inputs.

One command spawns its own ranks (NCCL on GPUs, gloo on the CPU), or joins the ranks `torchrun` started. Per model
each rank makes its experts' weights once; every variant loads the same weights and runs the same inputs:

    for model:                       weights made once per rank, freed before the next model
        for tokens, routing:         R rotating input sets (fresh routing each: hot experts move between sets), the
                                     floor, the check reference, the library compute anchor (lib_compute_ms)
        for variant:                 one ExpertParallelMoE, freed before the next variant (weights may be re-laid out)
            for tokens, routing:
                --check              set 0: output rows vs the reference (below), before any timing
                warm-up              max(warmup, R) calls, every set seen once; records each set's plan
                timed loop           iters calls, set i % R, each timed alone (CUDA events / perf_counter)

Rounds (`config.rounds` = N > 1): every variant's layer of a model is built first and kept; per (tokens, routing)
each is checked and warmed up, then the timed calls come in N rounds of about iters / N calls, the variants in
another order each round (rotated, every other round reversed), so that a drift of the GPU's clocks or of the
machine's load over the minutes a configuration takes reaches every variant alike instead of whichever ran last.
The library compute anchor takes part as one more slot of each round's order (`config.anchor`): timed once before
every variant, it could not see a drift that reached the calls timed after it (on one H100, nccl's DeepSeek-V3 call
at 8192 tokens took 11.42 and 13.14 ms in two runs minutes apart while the anchor took 10.58 and 10.50;
bench/results/h100-c787491).
It holds every variant's layer (and their copies of the weights) at once.

Timing: `torch.cuda.synchronize()` + `dist.barrier()` before the timed loop only; inside it nothing but the layer
call and two event records per call, so the loop holds no host sync beyond what the backend does itself. A call's
latency is the max over ranks of that call's time (the layer waits for its slowest rank); the row reports the median
(and p10 / p90) of those over calls.

Check: a fixed random subset of `check_rows` rows per rank is gathered from every rank (x, ids, weights and the
variant's output). The reference is computed distributed, without any rank holding all experts: each rank runs
`reference_moe` on the gathered rows with ids outside its experts set to -1 (its local weights), and the fp32
partials are summed over ranks. This equals `reference_moe` on the full weights up to the bf16 rounding of each
partial (<= 2^-9 relative, below the 1e-2 tolerance by 5x). Every variant is compared with that reference; the full
output is also checked for NaN/Inf on every rank. Each variant is checked on two calls of set 0: its layer's first
call of the configuration (the first of all compiles and captures graphs) and one after the warm-up (a replay); the
row keeps the larger error (a fault can be in either alone: one in the compiling first call was seen).

Outcomes: a variant whose backend cannot be constructed on this machine (ImportError or RuntimeError from its
constructor: no NVSHMEM, no deep_ep, no CUDA) is SKIPPED, its reason in the rows' `skipped`; any other exception,
while being built or run, FAILS its rows, the message in `error`. The ranks agree on the outcome through a collective
after each step, so a failure that is the same on every rank never hangs the run.

Own process: the variants of a backend in `config.own_process` (NVSHMEM's `symm`, which cannot share a process with
the CUDA-IPC weave workspace) run in ranks spawned for them after the others; their rows join the same result files.

Single GPU: `config.emulate_ep = N` runs every variant at EP = 1 on the per-rank work of EP = N
(`weave_moe.bench.config.emulated_spec`); rows keep the model's name and record `emulate_ep`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
import traceback
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from weave_moe.bench import report
from weave_moe.bench.config import BenchConfig, emulated_spec
from weave_moe.bench.floor import layer_floor, rank_traffic
from weave_moe.models import MoESpec

__all__ = ["BenchConfig", "BenchRefused", "launch", "run_rank", "bench_routing", "cpu_bytes_per_rank",
           "cpu_size_problem", "process_groups", "round_orders"]


class BenchRefused(ValueError):
    """The run was refused before any rank started (the message says why and what to do instead)."""


# --------------------------------------------------------------------------------------------------------------------
# launching


def launch(config: BenchConfig, nproc: int | None = None, device: str = "auto") -> list[dict]:
    """Run the benchmark and return the rows (rank 0 also writes the result files).

    Under `torchrun` (RANK / WORLD_SIZE / MASTER_ADDR set) this process is one rank and joins the existing job.
    Otherwise it spawns `nproc` ranks (default: every GPU when there are >= 2, else one GPU; 2 gloo ranks on the
    CPU; one rank with `config.emulate_ep` > 1), then the ranks of each own-process backend, one group after another.

    Args:
        device: "auto", "cuda" or "cpu".

    Raises:
        BenchRefused: before anything starts: shapes too big for a CPU-only run, more ranks than GPUs, an EP that
            does not divide the experts, own-process variants under torchrun.
    """
    use_cuda = _use_cuda(device)
    under_torchrun = all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    num_gpus = torch.cuda.device_count() if use_cuda else 0
    if under_torchrun:
        world_size = int(os.environ["WORLD_SIZE"])
    elif nproc is not None:
        world_size = nproc
    elif config.emulate_ep > 1:
        world_size = 1
    elif use_cuda:
        world_size = num_gpus if num_gpus >= 2 else 1
    else:
        world_size = 2
    _refuse_early(config, world_size, use_cuda, num_gpus, under_torchrun)
    if under_torchrun:
        return _rank_main(int(os.environ["RANK"]), world_size, None, config, use_cuda)
    # NVLink multicast stays off on the lent machines; setdefault keeps whatever the user chose.
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)
    groups = process_groups(config)
    if len(groups) == 1:
        return _spawn(config, world_size, use_cuda)
    parts, failure = [], None
    for index, variants in enumerate(groups):
        part = dataclasses.replace(config, variants=variants, name=f"{config.name}.part{index}",
                                   attention=config.attention and index == 0, anchor=config.anchor and index == 0)
        parts.append(report.result_paths(part)["json"])
        try:
            _spawn(part, world_size, use_cuda)
        except Exception as exc:  # noqa: BLE001 - the other groups still run; raised after the merge
            failure = failure or exc
    rows = report.combine_parts(parts, config, world_size)
    if failure is not None:
        raise failure
    return rows


def process_groups(config: BenchConfig) -> list[tuple]:
    """The variants of each set of ranks, in order: every variant that shares a process, then, per backend of
    `config.own_process` that has variants, that backend's variants. Empty groups are left out."""
    shared = tuple(v for v in config.variants if v.backend not in config.own_process)
    groups = [shared] if shared else []
    for backend in dict.fromkeys(v.backend for v in config.variants if v.backend in config.own_process):
        groups.append(tuple(v for v in config.variants if v.backend == backend))
    return groups


def _spawn(config: BenchConfig, world_size: int, use_cuda: bool) -> list[dict]:
    import torch.multiprocessing as mp

    from weave_moe.testing import free_port

    # Rank 0 writes the result files; the rows come back through them (a queue could fill its pipe and block the
    # child's exit while the parent waits in join).
    json_path = report.result_paths(config)["json"]
    try:
        mp.start_processes(_rank_main, args=(world_size, free_port(), config, use_cuda), nprocs=world_size,
                           join=True, start_method="spawn")
    except Exception:
        # A rank died (CUDA error, a killed process): keep the pictures of what was measured, then fail loudly.
        rows = report.load_rows(json_path)
        if rows:
            report.write_all(rows, config, partial=True, world_size=world_size,
                             attention=report.load_attention(json_path))
        raise
    return report.load_rows(json_path)


def _refuse_early(config: BenchConfig, world_size: int, use_cuda: bool, num_gpus: int, under_torchrun: bool) -> None:
    if world_size < 1:
        raise BenchRefused(f"--nproc must be >= 1, got {world_size}")
    if config.emulate_ep > 1 and world_size != 1:
        raise BenchRefused(f"--emulate-ep {config.emulate_ep} runs every backend at EP=1 on one rank; got {world_size} "
                           f"ranks (drop --nproc, or run without --emulate-ep for a real EP={world_size} run)")
    if use_cuda and not under_torchrun and world_size > num_gpus:
        raise BenchRefused(f"--nproc {world_size} needs {world_size} GPUs, found {num_gpus} (--device cpu runs gloo "
                           f"ranks; --emulate-ep {world_size} measures the per-rank work of EP={world_size} on one "
                           f"GPU)")
    for spec in config.models:
        if spec.num_experts % world_size:
            raise BenchRefused(f"{spec.name}: E={spec.num_experts} is not divisible by EP={world_size}")
    if not use_cuda:
        problem = cpu_size_problem(config, world_size)
        if problem:
            raise BenchRefused(problem)
    own = [v.name for v in config.variants if v.backend in config.own_process]
    if under_torchrun and len(process_groups(config)) > 1:
        raise BenchRefused(f"variants {', '.join(own)} run in ranks of their own (--own-process), which ranks started "
                           f"by torchrun cannot spawn: run them in a separate torchrun job (--variants "
                           f"{','.join(own)}), start the bench with `weave-moe bench` (it spawns its own ranks), or "
                           f"pass --own-process '' to run them beside the others")


def cpu_bytes_per_rank(spec: MoESpec, tokens: int, world_size: int) -> float:
    """Estimated peak bytes of one CPU rank running `spec` with `tokens` tokens per rank at EP = `world_size`.

    Its experts in bf16 plus one fp32 copy (a backend without a bf16 grouped GEMM upcasts them once; the reference
    computes in fp32), and per (token, expert) pair it may receive (T * EP * k) the activations in fp32: x row, gate
    and up, h, output row = 4 B x (2H + 3I).
    """
    num_local_experts = spec.num_experts // max(1, world_size)
    weights = num_local_experts * 3 * spec.hidden_size * spec.intermediate_size * (2 + 4)
    pairs = tokens * world_size * spec.top_k
    return float(weights + pairs * 4 * (2 * spec.hidden_size + 3 * spec.intermediate_size))


def cpu_size_problem(config: BenchConfig, world_size: int) -> str | None:
    """None when every model fits a CPU-only run under `config.cpu_limit_mib` per rank (0 = no limit); else the
    refusal message, naming the models, their estimate and what to run instead."""
    if config.cpu_limit_mib <= 0:
        return None
    tokens = config.layer_max_tokens
    too_big = []
    for model in config.models:
        need_mib = cpu_bytes_per_rank(emulated_spec(model, config.emulate_ep), tokens, world_size) / 2**20
        if need_mib > config.cpu_limit_mib:
            too_big.append(f"{model.name} ~{need_mib / 1024:.1f} GiB" if need_mib >= 1024
                           else f"{model.name} ~{need_mib:.0f} MiB")
    if not too_big:
        return None
    return (f"no GPU here, so the bench would run on the CPU, and these shapes need more than the CPU limit of "
            f"{config.cpu_limit_mib:g} MiB per rank at {tokens} tokens per rank: {', '.join(too_big)}. Paper-size "
            f"models are GPU work. On the CPU use a small registry-free model, e.g. `weave-moe bench --model-dims "
            f"8,2,64,32 --tokens 16,32 --variants nccl`, or raise the limit with --cpu-limit-mib if this machine "
            f"really has the memory (and the time).")


def _use_cuda(device: str) -> bool:
    if device == "cpu":
        return False
    if device == "cuda":
        if not torch.cuda.is_available():
            raise BenchRefused("--device cuda but CUDA is not available")
        return True
    if device != "auto":
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    return torch.cuda.is_available()


def _rank_main(rank: int, world_size: int, port: int | None, config: BenchConfig, use_cuda: bool) -> list:
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        # Ranks share the cores; oversubscription would time the OS scheduler, not the layer.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=config.timeout_s), device_id=device if use_cuda else None)
    try:
        return run_rank(config, rank, world_size, device)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------------------
# the per-rank loop


@dataclass
class _ConfigInputs:
    """One (model, tokens, routing) configuration on one rank."""

    tokens: int
    routing: str
    sets: list  # R tuples (x [T, H] bf16, topk_ids [T, k] int32, topk_weights [T, k] fp32) on the device
    floors: list  # R LayerFloor (identical on every rank)
    check_idx: torch.Tensor | None = None  # [S] int64 rows of set 0 compared with the reference
    reference: torch.Tensor | None = None  # [EP * S, H] fp32 reference of the gathered check rows
    lib_compute_ms: float | None = None  # the library compute anchor, max over ranks (None: not measured)
    lib_compute_error: str = ""  # why it is missing
    group_sizes: list | None = None  # R lists: this rank's pairs per local expert of each set (the anchor's groups)


@dataclass
class _Outcome:
    """How building a variant's layer went, the same on every rank."""

    layer: object = None
    error: str | None = None  # the variant fails: every row records this
    skipped: str | None = None  # the backend cannot run on this machine: every row records this, nothing fails


def run_rank(config: BenchConfig, rank: int, world_size: int, device: torch.device) -> list[dict]:
    """This rank's part of the benchmark; returns the rows on rank 0 (an empty list elsewhere).

    Rank 0 rewrites the JSON and CSV after each variant, so a run cut short keeps what it measured; the markdown and
    the pictures come at the end (or from the launcher, after a rank died).
    """
    from weave_moe.testing import make_experts

    progress = None
    total = len(config.models) * len(config.variants) * len(config.tokens) * len(config.routings)
    if rank == 0 and config.show_progress:
        import sys

        from tqdm import tqdm

        # Off a terminal (a log, a remote runner's captured output) redraw rarely, so the log stays readable.
        progress = tqdm(total=total, desc="bench", unit="cfg", dynamic_ncols=True,
                        mininterval=0.1 if sys.stderr.isatty() else 10.0)
    rows: list[dict] = []
    attention_rows: list[dict] = []
    for model_index, model in enumerate(config.models):
        if config.attention:
            attention_rows += _time_attention(config, model, rank, world_size, device)
        spec = emulated_spec(model, config.emulate_ep)  # the shape that runs: the model itself unless emulating
        num_local_experts = spec.num_experts // world_size
        w13, w2 = make_experts(spec, num_local_experts, first_expert=rank * num_local_experts,
                               seed=config.seed + 1000 * model_index, device=device)
        inputs: dict[tuple, _ConfigInputs] = {}
        for tokens in config.tokens:
            for routing in config.routings:
                inputs[tokens, routing] = _make_inputs(config, spec, tokens, routing, rank, world_size, device,
                                                       w13, w2)
        if config.rounds > 1:
            model_rows = _bench_in_rounds(config, model, spec, inputs, rank, world_size, device, w13, w2, progress)
            if rank == 0:
                rows += model_rows
                report.write_tables(rows, config, partial=True, world_size=world_size, attention=attention_rows)
        else:
            for variant in config.variants:
                if progress is not None:
                    progress.set_description(f"{model.name} {variant.name}")
                outcome = _build_layer(spec, variant, config, device, w13, w2)
                for tokens in config.tokens:
                    for routing in config.routings:
                        row = _bench_config(config, model, spec, variant, outcome, inputs[tokens, routing], rank,
                                            world_size, device)
                        if rank == 0:
                            rows.append(row)
                            if progress is not None:
                                progress.set_postfix_str(_short(row))
                                progress.update(1)
                del outcome
                _free(device)
                if rank == 0:
                    report.write_tables(rows, config, partial=True, world_size=world_size, attention=attention_rows)
        del w13, w2, inputs
        _free(device)
        if rank == 0 and model_index + 1 == len(config.models):  # the pictures once, at the end (or after a crash)
            report.write_all(rows, config, partial=False, world_size=world_size, attention=attention_rows)
    if progress is not None:
        progress.close()
    return rows


def _time_attention(config, spec, rank, world_size, device) -> list[dict]:
    """Attention block and shared-expert ms per token count: every rank times its own GPU, the max is kept."""
    from weave_moe.bench.attention import attention_spec, time_attention, time_shared_experts

    shape = attention_spec(spec)
    found = []
    for tokens in config.tokens:
        error = None
        try:
            times = [time_attention(shape, tokens, device, seq_len=config.attention_seq_len, iters=config.iters,
                                    warmup=config.warmup),
                     time_shared_experts(spec, tokens, device, iters=config.iters, warmup=config.warmup)]
        except Exception as exc:  # noqa: BLE001 - recorded, the MoE rows still run
            error, times = _describe(exc), [math.nan, math.nan]
        error = _agree(error)
        _free(device)
        slowest = _gather_rows(torch.tensor(times, dtype=torch.float64, device=device)[None], world_size)
        attention_ms, shared_ms = slowest.max(dim=0).values.tolist()
        found.append(dict(model=spec.name, tokens_per_rank=tokens,
                          seq_len=min(config.attention_seq_len or tokens, tokens),
                          attention_ms=None if error else attention_ms, shared_ms=None if error else shared_ms,
                          error=error or "", attention=shape.to_dict()))
    return found if rank == 0 else []


def _seed(config: BenchConfig, *parts) -> int:
    """A stable seed from the base seed and a description (crc32: the same in every process, unlike hash())."""
    return (config.seed * 7919 + zlib.crc32("/".join(map(str, parts)).encode())) % (2**31)


def bench_routing(config: BenchConfig, spec: MoESpec, tokens: int, routing: str, set_index: int, world_size: int):
    """(ids, weights) of input set `set_index` for ALL ranks ([EP * tokens, k], rank r's rows r*tokens onwards): the
    routing a bench run draws, reproducible on the CPU from the config (scripts/sweep_model.py, weights_bound.py).
    Under --emulate-ep pass the emulated spec and world_size 1, as the run does."""
    from weave_moe import routing as routing_lib

    seed = _seed(config, spec.name, tokens, routing, set_index)
    if routing == "uniform":
        return routing_lib.uniform(tokens * world_size, spec.num_experts, spec.top_k, seed=seed)
    return routing_lib.skewed(tokens * world_size, spec.num_experts, spec.top_k, skew=config.skew, layer=set_index,
                              seed=seed)


def _make_inputs(config, spec, tokens, routing, rank, world_size, device, w13, w2) -> _ConfigInputs:
    from weave_moe.bench.anchor import local_group_sizes

    sets, floors, group_sizes = [], [], []
    for set_index in range(config.rotate):
        # Every rank draws the routing of ALL ranks (same seed) and keeps its slice: no exchange, and the floor and
        # the anchor see the global routing.
        ids, weights = bench_routing(config, spec, tokens, routing, set_index, world_size)
        ids_per_rank = list(torch.as_tensor(ids).view(world_size, tokens, spec.top_k))
        floors.append(layer_floor(rank_traffic(ids_per_rank, spec.num_experts), spec.hidden_size,
                                  spec.intermediate_size, config.floor))
        group_sizes.append(local_group_sizes(ids, spec.num_experts, world_size, rank))
        generator = torch.Generator(device=device)
        generator.manual_seed(_seed(config, spec.name, tokens, routing, set_index, "x", rank))
        x = torch.randn(tokens, spec.hidden_size, generator=generator, device=device).to(torch.bfloat16)
        local = slice(rank * tokens, (rank + 1) * tokens)
        sets.append((x, torch.as_tensor(ids)[local].to(device=device, dtype=torch.int32).contiguous(),
                     torch.as_tensor(weights)[local].to(device=device, dtype=torch.float32).contiguous()))
    config_inputs = _ConfigInputs(tokens=tokens, routing=routing, sets=sets, floors=floors, group_sizes=group_sizes)
    if config.check:
        generator = torch.Generator().manual_seed(_seed(config, spec.name, tokens, routing, "check"))
        num_rows = min(tokens, config.check_rows)
        check_idx = torch.randperm(tokens, generator=generator)[:num_rows].sort().values
        config_inputs.check_idx = check_idx.to(device)
        config_inputs.reference = _distributed_reference(sets[0], config_inputs.check_idx, spec, rank, world_size,
                                                         w13, w2)
    if config.anchor and config.rounds == 1:   # with rounds: timed in each round (_bench_in_rounds)
        times = []
        error = _anchor_round(config, spec, config_inputs, w13, w2, device, config.iters, times)
        config_inputs.lib_compute_ms, config_inputs.lib_compute_error = _anchor_result(times, error, world_size,
                                                                                       device)
    return config_inputs


def _anchor_round(config, spec, inputs, w13, w2, device, iters: int, times: list) -> str | None:
    """`iters` more replays of the library compute anchor on this configuration's groups, appended to `times` (ms);
    returns every rank's error (None: none), the same on every rank (a collective)."""
    from weave_moe.bench.anchor import grouped_mm_usable, library_compute_times

    error = grouped_mm_usable(device, spec.hidden_size, spec.intermediate_size)
    if error is None:
        try:
            times += library_compute_times(inputs.group_sizes, w13, w2, iters=iters, seed=config.seed)
        except Exception as exc:  # noqa: BLE001 - the anchor is missing from the rows, the variants still run
            error = _describe(exc)
    error = _agree(error)
    _free(device)
    return error


def _anchor_result(times: list, error: str | None, world_size: int, device) -> tuple[float | None, str]:
    """(max over ranks of each rank's median ms, "") or (None, why not); the same on every rank (a collective)."""
    local_ms = statistics.median(times) if times and error is None else math.nan
    slowest = _gather_rows(torch.tensor([local_ms], dtype=torch.float64, device=device), world_size).max().item()
    return (None, error) if error is not None else (slowest, "")


def _gather_rows(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """[S, ...] on every rank -> [EP * S, ...] in rank order (S equal on every rank)."""
    if world_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def _distributed_reference(input_set, check_idx, spec, rank, world_size, w13, w2) -> torch.Tensor:
    """reference_moe of the gathered check rows, with no rank holding more than its own experts (module docstring)."""
    from weave_moe.reference import reference_moe

    x, ids, weights = input_set
    x_all = _gather_rows(x[check_idx], world_size)
    ids_all = _gather_rows(ids[check_idx], world_size)
    weights_all = _gather_rows(weights[check_idx], world_size)
    first = rank * w13.shape[0]
    local_ids = torch.where((ids_all >= first) & (ids_all < first + w13.shape[0]), ids_all - first,
                            torch.full_like(ids_all, -1))
    partial = reference_moe(x_all, local_ids, weights_all, w13, w2).float()
    if world_size > 1:
        dist.all_reduce(partial)
    return partial


def _build_layer(spec, variant, config, device, w13, w2) -> _Outcome:
    """The variant's layer with the experts loaded, or why not; every rank gets the same outcome."""
    layer, error, skipped = None, None, None
    try:
        from weave_moe.layer import ExpertParallelMoE

        # The inputs are generated valid, and the id range check costs a host sync per call: off for timing.
        options = dict(group=None, backend=variant.backend, max_tokens_per_rank=config.layer_max_tokens, device=device,
                       check_expert_ids=False)
        options.update(variant.layer_options(emulated=config.emulate_ep > 1))
        try:
            layer = ExpertParallelMoE(spec, **options)
        except torch.OutOfMemoryError:  # a RuntimeError too, but a failure of the run, not a missing feature
            raise
        except (ImportError, RuntimeError) as exc:  # the backend's software or hardware is not on this machine
            skipped = _describe(exc)
        if layer is not None:
            layer.load_experts(w13, w2)
    except Exception as exc:  # noqa: BLE001 - a variant that cannot be built is a result, not a crash
        layer, error = None, _describe(exc)
    error, skipped = _agree(error), _agree(skipped)
    if error is not None:
        return _Outcome(error=error)
    if skipped is not None:
        return _Outcome(skipped=skipped)
    return _Outcome(layer=layer)


def _describe(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {os.path.basename(frame[0].filename)}:{frame[0].lineno})" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}".replace("\n", " ")[:500]


def _failed_anywhere(message: str | None) -> bool:
    """Whether any rank has a message (a collective, as `_agree`, that leaves the messages as they are)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return message is not None
    flags = [False] * dist.get_world_size()
    dist.all_gather_object(flags, message is not None)
    return any(flags)


def _agree(message: str | None) -> str | None:
    """Every rank's message, or None when no rank has one: a collective every rank reaches after each step."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return message
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    found = [(rank, text) for rank, text in enumerate(messages) if text is not None]
    if not found:
        return None
    distinct = {text for _, text in found}
    if len(distinct) == 1:
        return f"rank {','.join(str(r) for r, _ in found)}: {distinct.pop()}"
    return "; ".join(f"rank {r}: {text}" for r, text in found)


@dataclass
class _Run:
    """One variant's configuration in progress: its result so far, its error (None: fine so far), this rank's
    call times; `stopped`: some rank failed, so no rank times it further (their barriers stay in step)."""

    result: dict
    error: str | None
    local_ms: list
    stopped: bool = False
    graphs: list | None = None   # config.graph: one captured call per input set, replayed by the timed loop


def _bench_config(config, model, spec, variant, outcome, inputs, rank, world_size, device) -> dict:
    run = _start(config, outcome, inputs, world_size, device)
    _time_into(run, outcome, inputs, config.iters, device)
    return _finish(config, model, spec, variant, outcome, inputs, rank, world_size, device, run)


def _start(config, outcome, inputs, world_size, device) -> _Run:
    """The check (config.check) and the warm-up of one variant on one configuration."""
    run = _Run(dict(rel_error=None, max_norm_error=None, check_passed=None, times_ms=[], plans=[], stages_ms={},
                    timing="eager"), outcome.error, [])
    if outcome.layer is not None:
        try:
            # checked twice: the layer's first call (which compiles and captures its graphs) and a call after the
            # warm-up (a replay); a fault in either fails the row, with the larger error
            first = _check(outcome.layer, inputs, config, world_size) if config.check else None
            run.result["plans"] = _warm_up(outcome.layer, inputs.sets, config.warmup)
            if first is not None:
                again = _check(outcome.layer, inputs, config, world_size)
                _merge_check(run.result, first, again)
            if config.graph and device.type == "cuda" and outcome.layer.capturable:
                run.graphs, outputs = _capture_calls(outcome.layer, inputs.sets)
                run.result["timing"] = "graph"
                if first is not None:   # set 0's captured call checked too: its output poisoned, then one replay
                    outputs[0].fill_(float("nan"))
                    run.graphs[0].replay()
                    _merge_check(run.result, run.result, _check_output(outputs[0], outcome.layer, inputs, config,
                                                                       world_size))
        except Exception as exc:  # noqa: BLE001 - recorded in the row
            run.error = _describe(exc)
    return run


def _time_into(run: _Run, outcome, inputs, iters: int, device) -> None:
    """`iters` more timed calls of a variant that has not failed, appended to its times."""
    if outcome.layer is None or run.error is not None or run.stopped:
        return
    try:
        run.local_ms += _timed_loop(outcome.layer, inputs.sets, iters, device, run.graphs)
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        run.error = _describe(exc)


def _finish(config, model, spec, variant, outcome, inputs, rank, world_size, device, run: _Run) -> dict:
    """The variant's row of this configuration (rank 0; {} elsewhere): its times gathered from every rank."""
    error, stages = run.error, {}
    run.graphs = None   # their memory back before the next configuration's
    if outcome.layer is not None:
        if error is None:
            try:
                outcome.layer.synchronize()  # a kernel error of the last timed call surfaces here, not later
                stages = _stage_times(outcome.layer, inputs.sets, device) if config.breakdown else {}
            except Exception as exc:  # noqa: BLE001 - recorded in the row
                error = _describe(exc)
        error = _agree(error)
        if error is None:
            # The layer waits for its slowest rank: per call, the max over ranks.
            per_rank = _gather_rows(torch.tensor(run.local_ms, dtype=torch.float64, device=device)[None],
                                    world_size)
            run.result["times_ms"] = per_rank.max(dim=0).values.tolist()
            run.result["plans"] = _gather_plans(run.result["plans"], world_size)
            run.result["stages_ms"] = _gather_stages(stages, world_size)
    if rank != 0:
        return {}
    return _make_row(config, model, spec, variant, inputs, world_size, error, outcome.skipped, run.result)


def round_orders(num_variants: int, rounds: int) -> list[list[int]]:
    """The variants' order in each round of `config.rounds`: rotated by one per round, every other round reversed
    (so each variant runs first, last and between the others about equally often)."""
    orders = []
    for r in range(rounds):
        order = [(i + r) % num_variants for i in range(num_variants)]
        orders.append(order[::-1] if r % 2 else order)
    return orders


def _bench_in_rounds(config, model, spec, inputs, rank, world_size, device, w13, w2, progress) -> list[dict]:
    """Every variant of one model, timed in `config.rounds` interleaved rounds per configuration (module docstring);
    rows in the config's order (variants, then tokens and routing), on rank 0."""
    variants = config.variants
    outcomes = [_build_layer(spec, variant, config, device, w13, w2) for variant in variants]
    iters, rounds = config.iters, config.rounds
    per_round = [iters // rounds + (r < iters % rounds) for r in range(rounds)]   # config.iters calls in all
    anchor = len(variants)   # the library compute anchor's slot in each round's order (config.anchor)
    rows: dict[tuple, dict] = {}
    for key, config_inputs in inputs.items():
        runs = [_start(config, outcome, config_inputs, world_size, device) for outcome in outcomes]
        for run in runs:
            run.stopped = _failed_anywhere(run.error)
        anchor_times, anchor_error = [], None
        for calls, order in zip(per_round, round_orders(len(variants) + int(config.anchor), rounds)):
            for index in order:
                if index == anchor:
                    if anchor_error is None:
                        anchor_error = _anchor_round(config, spec, config_inputs, w13, w2, device, calls,
                                                     anchor_times)
                elif outcomes[index].layer is not None and not runs[index].stopped:
                    _time_into(runs[index], outcomes[index], config_inputs, calls, device)
                    runs[index].stopped = _failed_anywhere(runs[index].error)
        if config.anchor:
            config_inputs.lib_compute_ms, config_inputs.lib_compute_error = _anchor_result(
                anchor_times, anchor_error, world_size, device)
        for index, (variant, outcome) in enumerate(zip(variants, outcomes)):
            rows[index, key] = _finish(config, model, spec, variant, outcome, config_inputs, rank, world_size,
                                       device, runs[index])
            if progress is not None:
                progress.set_description(f"{model.name} {variant.name}")
                progress.set_postfix_str(_short(rows[index, key]))
                progress.update(1)
    del outcomes
    _free(device)
    return [rows[index, key] for index in range(len(variants)) for key in inputs] if rank == 0 else []


def _check(layer, inputs, config, world_size) -> dict:
    """A call of input set 0 against the reference."""
    return _check_output(layer(*inputs.sets[0]), layer, inputs, config, world_size)


def _merge_check(result: dict, first: dict, second: dict) -> None:
    """`result` takes the worse of two checks of one variant."""
    result.update(rel_error=max(first["rel_error"], second["rel_error"]),
                  max_norm_error=max(first["max_norm_error"], second["max_norm_error"]),
                  check_passed=first["check_passed"] and second["check_passed"])


def _check_output(out, layer, inputs, config, world_size) -> dict:
    """`out`, the layer's result for input set 0, against the reference."""
    from weave_moe.reference import moe_error

    layer.synchronize()
    finite = torch.tensor([float(torch.isfinite(out).all())], device=out.device)
    if world_size > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    out_all = _gather_rows(out[inputs.check_idx], world_size)
    rel_error, max_norm_error = moe_error(out_all.float(), inputs.reference)
    if finite.item() < 1:
        rel_error, max_norm_error = math.inf, math.inf
    return dict(rel_error=rel_error, max_norm_error=max_norm_error,
                check_passed=bool(finite.item() >= 1 and rel_error <= config.tolerance))


def _plan_summary(plan) -> dict | None:
    """The JSON form of a backend's `last_plan` (None for backends without plans)."""
    if plan is None:
        return None
    return dict(c=plan.c, K=plan.K, n_steal=plan.n_steal, predicted_us=plan.predicted_us, policy=plan.policy)


def _warm_up(layer, sets, warmup: int) -> list:
    """max(warmup, R) calls so every set is seen once; returns this rank's plan per set (None: no plan)."""
    plans = [None] * len(sets)
    for call in range(max(warmup, len(sets))):
        layer(*sets[call % len(sets)])
        plans[call % len(sets)] = _plan_summary(layer.last_plan)
    return plans


def _capture_calls(layer, sets) -> tuple[list, list]:
    """([graph per input set], [its output]): each set's call captured into a CUDA graph of its own and replayed
    once. The layer has made its eager calls (compiles, first-call checks) before; every rank captures and replays in
    step, as the timed loop does."""
    from weave_moe.backends.weave.graphs import capturing

    graphs, outputs = [], []
    for input_set in sets:
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            outputs.append(layer(*input_set))
        graph.replay()
        graphs.append(graph)
    return graphs, outputs


def _timed_loop(layer, sets, iters: int, device, graphs: list | None = None) -> list[float]:
    """This rank's time of each call, ms. Nothing in the loop syncs the host except the backend itself. With
    `graphs` (`_capture_calls` of `sets`), each call is a replay of its set's captured call."""
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        torch.cuda.synchronize(device)
        dist.barrier()
        for call in range(iters):
            starts[call].record()
            if graphs:
                graphs[call % len(graphs)].replay()
            else:
                layer(*sets[call % len(sets)])
            ends[call].record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in zip(starts, ends)]
    times = [0.0] * iters
    dist.barrier()
    for call in range(iters):
        start = time.perf_counter()
        layer(*sets[call % len(sets)])
        times[call] = (time.perf_counter() - start) * 1e3
    return times


def _stage_times(layer, sets, device) -> dict:
    """Per-stage ms of one call per input set, from backends that fill `timings` (CUDA only).

    Untimed extra calls after the timed loop: a backend that fills `timings` synchronises to read its events.
    Returns {stage: [ms per set]} for this rank ({} when the backend reports nothing).
    """
    if device.type != "cuda":
        return {}
    stages: dict[str, list] = {}
    for input_set in sets:
        timings: dict = {}
        layer(*input_set, timings=timings)
        for stage, ms in timings.items():
            stages.setdefault(stage, []).append(float(ms))
    return stages


def _gather_stages(stages: dict, world_size: int) -> dict:
    """{stage: median over sets of the max over ranks} (stages every rank reported)."""
    everyone = [stages]
    if world_size > 1:
        everyone = [None] * world_size
        dist.all_gather_object(everyone, stages)
    common = set(everyone[0]).intersection(*everyone[1:]) if everyone[0] else set()
    result = {}
    for stage in sorted(common):
        per_set = [max(values) for values in zip(*(rank_stages[stage] for rank_stages in everyone))]
        result[stage] = statistics.median(per_set) if per_set else None
    return result


def _gather_plans(plans: list, world_size: int) -> list:
    """[R][EP] plans (per set, per rank)."""
    if world_size == 1:
        return [[plan] for plan in plans]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, plans)
    return [[everyone[rank][set_index] for rank in range(world_size)] for set_index in range(len(plans))]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _make_row(config, model, spec, variant, inputs, world_size, error, skipped, result) -> dict:
    """One CSV/JSON row. `model` is the model as named, `spec` the shape that ran (they differ under --emulate-ep)."""
    floors = inputs.floors
    floor_ms = statistics.fmean(f.floor_s for f in floors) * 1e3
    flops_per_gpu = statistics.fmean(f.total_flops for f in floors) / world_size
    bytes_per_gpu = statistics.fmean(f.total_bytes_sent for f in floors) / world_size
    bounds = {f.bound for f in floors}
    row = dict(
        model=model.name, num_experts=model.num_experts, top_k=model.top_k, hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size, num_local_experts=spec.num_experts // world_size,
        world_size=world_size, emulate_ep=config.emulate_ep, tokens_per_rank=inputs.tokens, routing=inputs.routing,
        skew=config.skew if inputs.routing == "skewed" else None,
        variant=variant.name, backend=variant.backend, policy=variant.policy or "",
        iters=len(result["times_ms"]), timing=result["timing"],
        median_ms=None, p10_ms=None, p90_ms=None, min_ms=None, mean_ms=None, tflops=None, nvlink_gbps=None,
        floor_ms=floor_ms,
        floor_compute_ms=statistics.fmean(max(f.compute_s) for f in floors) * 1e3,
        floor_comm_ms=statistics.fmean(max(f.comm_s) for f in floors) * 1e3,
        floor_weights_ms=statistics.fmean(f.weights_floor_s for f in floors) * 1e3,
        floor_bound=bounds.pop() if len(bounds) == 1 else "mixed",
        pct_of_floor=None, x_floor=None,
        lib_compute_ms=inputs.lib_compute_ms, x_lib_compute=None, lib_compute_error=inputs.lib_compute_error,
        c=None, K=None, n_steal=None, predicted_ms=None, prediction_error_pct=None,
        rel_error=result["rel_error"], max_norm_error=result["max_norm_error"], check_passed=result["check_passed"],
        error=error or "", skipped=skipped or "",
        stages_ms=";".join(f"{k}={v:.4g}" for k, v in result["stages_ms"].items() if v is not None),
        times_ms=result["times_ms"], plans=result["plans"],
    )
    times = result["times_ms"]
    if times:
        median_ms = statistics.median(times)
        row.update(
            median_ms=median_ms, p10_ms=_percentile(times, 0.1), p90_ms=_percentile(times, 0.9), min_ms=min(times),
            mean_ms=statistics.fmean(times),
            tflops=flops_per_gpu / (median_ms * 1e-3) / 1e12,
            nvlink_gbps=bytes_per_gpu / (median_ms * 1e-3) / 1e9,
            pct_of_floor=100.0 * floor_ms / median_ms, x_floor=median_ms / floor_ms if floor_ms > 0 else None,
        )
        if inputs.lib_compute_ms:
            row["x_lib_compute"] = median_ms / inputs.lib_compute_ms
    # a row whose variant failed may hold no plans, or None for a set it never reached
    first_plan = next((p for p in ((result["plans"][0] if result["plans"] else None) or []) if p), None)
    if first_plan:
        row.update(c=first_plan["c"], K=first_plan["K"], n_steal=first_plan["n_steal"])
        # a plan without a prediction (fixed policies carry NaN: they never model the call's workload) counts as none
        predicted = [max(_finite((p or {}).get("predicted_us")) for p in per_set) for per_set in result["plans"]
                     if per_set]
        if any(predicted):
            row["predicted_ms"] = statistics.fmean(predicted) * 1e-3
            if row["median_ms"]:
                row["prediction_error_pct"] = 100.0 * (row["predicted_ms"] - row["median_ms"]) / row["median_ms"]
    return row


def _finite(value) -> float:
    return value if isinstance(value, (int, float)) and value == value else 0.0


def _short(row: dict) -> str:
    where = f"{row['tokens_per_rank']} {row['routing']}"
    if row.get("skipped"):
        return f"{where}: skipped"
    if row.get("error"):
        return f"{where}: error"
    return f"{where}: {row['median_ms']:.3f} ms ({row['pct_of_floor']:.0f}% floor)"


def _free(device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
