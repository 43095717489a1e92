"""What one benchmark run measures (`BenchConfig`), shared by the harness (which runs it) and the report (which
records it), so neither imports the other for it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from weave_moe.bench.floor import FloorConstants
from weave_moe.bench.variants import Variant, default_variants, parse_variants
from weave_moe.models import MoESpec
from weave_moe.reference import DEFAULT_TOLERANCE

__all__ = ["BenchConfig", "config_to_dict", "emulated_spec"]


@dataclass(frozen=True)
class BenchConfig:
    """Everything a rank needs to run the benchmark (picklable: it travels to spawned ranks).

    Attributes:
        models: the MoE shapes, in order.
        tokens: tokens per rank, e.g. (2048, 4096, 8192).
        routings: "uniform" and/or "skewed".
        skew: busiest-expert / mean target of skewed routing.
        variants: the variants (`weave_moe.bench.variants.Variant`), in order.
        iters, warmup: timed and warm-up calls per configuration.
        rounds: 1: each variant timed in one block (its layer built, timed on every configuration, freed); N > 1:
            every variant's layer kept, the timed calls of each configuration in N interleaved rounds (harness
            module docstring).
        rotate: input sets per configuration (R >= 1; >= 4 by default so caches do not flatter).
        check: compare every variant with the reference before timing.
        check_rows: rows per rank compared (all when T is smaller).
        tolerance: relative Frobenius error allowed by the check.
        seed: base of every seed (weights, routing, x).
        floor: rates the physical floor uses.
        out_dir, name: results go to out_dir/name.{json,csv,md} and pictures beside them.
        metadata: written into the JSON as is (command line, git commit, ...), filled by the launcher.
        timeout_s: process-group timeout: a collective stuck this long raises instead of hanging.
        show_progress: a progress bar on rank 0.
        breakdown: after the timed loop, one untimed call per input set with `timings={}` (per-stage ms from the
            backends that report them; CUDA only).
        attention: also time each model's attention block and shared experts per token count, for the end-to-end
            estimate (bench/attention.py).
        attention_seq_len: tokens per causal sequence in that timing (0: all of a rank's tokens in one sequence).
        anchor: time the library compute anchor (`lib_compute_ms`, bench/anchor.py) per configuration.
        emulate_ep: N > 1 runs every variant at EP = 1 on the per-rank work of EP = N (`emulated_spec`); needs one
            rank. 1 = off.
        own_process: backends whose variants run in ranks of their own, spawned after the others by the same
            command (a backend that cannot share a process with another, e.g. NVSHMEM next to CUDA IPC).
        cpu_limit_mib: without CUDA, refuse shapes whose estimated memory per rank exceeds this (0 = no limit).
        max_tokens_per_rank: the layers' T_max (`ExpertParallelMoE(max_tokens_per_rank=)`), what their buffers and
            per-call padding are sized for; 0 = the largest of `tokens`. A serving engine sizes it for its largest
            batch (e.g. 8192) and then calls it with 1-token decode batches: set it so to time decode as served.
        graph: time the calls of each variant whose layer is `capturable` (ExpertParallelMoE.capturable: weave's
            device-resident call, nccl at EP = 1) as replays of that call captured in a CUDA graph (one graph per
            input set, captured after the warm-up and checked once more), as serving engines run decode: no host
            time inside a call. Other variants stay eager; each row's `timing` says which. CUDA only (eager on the
            CPU).
    """

    models: tuple
    tokens: tuple = (2048, 4096, 8192)
    routings: tuple = ("uniform", "skewed")
    skew: float = 3.0
    variants: tuple = field(default_factory=lambda: tuple(parse_variants(default_variants())))
    iters: int = 20
    warmup: int = 3
    rounds: int = 1
    rotate: int = 4
    check: bool = False
    check_rows: int = 256
    tolerance: float = DEFAULT_TOLERANCE
    seed: int = 0
    floor: FloorConstants = field(default_factory=FloorConstants)
    out_dir: str = "bench/results"
    name: str = "bench"
    metadata: dict = field(default_factory=dict)
    timeout_s: float = 300.0
    show_progress: bool = True
    breakdown: bool = True
    attention: bool = False
    attention_seq_len: int = 0
    anchor: bool = True
    emulate_ep: int = 1
    own_process: tuple = ("symm",)
    cpu_limit_mib: float = 1024.0
    max_tokens_per_rank: int = 0
    graph: bool = False

    def __post_init__(self) -> None:
        if self.iters < 1 or self.warmup < 0 or self.rotate < 1 or not 1 <= self.rounds <= self.iters:
            raise ValueError(f"iters >= 1, warmup >= 0, rotate >= 1 and 1 <= rounds <= iters needed; got "
                             f"{self.iters}, {self.warmup}, {self.rotate}, {self.rounds}")
        for routing in self.routings:
            if routing not in ("uniform", "skewed"):
                raise ValueError(f"routing must be 'uniform' or 'skewed', got {routing!r}")
        for tokens in self.tokens:
            if not isinstance(tokens, int) or tokens < 1:
                raise ValueError(f"tokens per rank must be positive ints, got {tokens!r}")
        if not isinstance(self.max_tokens_per_rank, int) or not (
                self.max_tokens_per_rank == 0 or self.max_tokens_per_rank >= max(self.tokens)):
            raise ValueError(f"max_tokens_per_rank must be 0 (the largest of tokens) or at least the largest of tokens "
                             f"({max(self.tokens)}), got {self.max_tokens_per_rank!r}")
        for variant in self.variants:
            if not isinstance(variant, Variant):
                raise TypeError(f"variants must be Variant (weave_moe.bench.variants.parse_variants), got {variant!r}")
        if not isinstance(self.emulate_ep, int) or self.emulate_ep < 1:
            raise ValueError(f"emulate_ep must be an int >= 1, got {self.emulate_ep!r}")
        for spec in self.models:
            emulated_spec(spec, self.emulate_ep)  # ValueError now, not in a rank

    @property
    def layer_max_tokens(self) -> int:
        """T_max of every layer the run builds (`max_tokens_per_rank`, or the largest of `tokens`)."""
        return self.max_tokens_per_rank or max(self.tokens)


def emulated_spec(spec: MoESpec, emulate_ep: int) -> MoESpec:
    """The EP = 1 layer that does one rank's work of `spec` at EP = `emulate_ep` (the spec itself for 1).

    At EP = N with T tokens per rank and uniform routing, a rank holds E / N experts and receives the pairs of those
    experts from every rank: N * T * k * (1 / N) = T * k pairs, N * T * k / E rows per local expert. An EP = 1 layer
    with E / N experts, the same top-k and the same T tokens has exactly that: T * k pairs, T * k / (E / N) rows per
    expert, E / N experts' weights, the same FLOPs. What it does not reproduce (docs/benchmarking.md): the number of
    distinct tokens a rank receives (~N * T * (1 - (1 - 1/N)^k) at EP = N, T here), so the dispatch gather reads and
    the combine writes fewer rows, and there is no NVLink traffic at all.
    """
    if emulate_ep == 1:
        return spec
    if spec.num_experts % emulate_ep:
        raise ValueError(f"--emulate-ep {emulate_ep}: {spec.name} has E={spec.num_experts} experts, not divisible by "
                         f"{emulate_ep}")
    num_local_experts = spec.num_experts // emulate_ep
    if spec.top_k > num_local_experts:
        raise ValueError(f"--emulate-ep {emulate_ep}: {spec.name} has top_k={spec.top_k} > E / EP = "
                         f"{num_local_experts} local experts; a token could not pick k distinct local experts")
    return MoESpec(num_local_experts, spec.top_k, spec.hidden_size, spec.intermediate_size, spec.num_shared_experts,
                   spec.shared_intermediate_size, spec.name)


def config_to_dict(config: BenchConfig) -> dict:
    """The JSON form of a config (models as their shapes, variants as dicts, no metadata)."""
    data = asdict(config)
    data["models"] = [spec.to_dict() for spec in config.models]
    data["variants"] = [asdict(v) for v in config.variants]
    data.pop("metadata", None)
    return data
