"""The hardware profile: how fast one GPU moves bytes and multiplies, as a function of how many SMs do it.

Every curve is piecewise linear over measured points (`np.interp`; clamped at the ends). Units: SM counts are CTAs
(one CTA per SM), bandwidth is GB/s (1e9 B/s), GEMM throughput is TFLOP/s, fixed costs are microseconds.

The default profile (`HardwareProfile.default()`, data in `profiles/h200_measured.json`) is calibrated on 2 x H200 SXM
from the megakernel's own in-kernel timelines (`weave-moe calibrate --measure`); `profiles/h200_default.json` keeps the
uncalibrated figures (torch / copy-engine measurements on the same pair, 2026-11-29). Which numbers are measured and
which are guesses is written in each JSON's `notes` and in `source`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property
from importlib import resources
from pathlib import Path

import numpy as np

__all__ = ["HardwareProfile"]



@dataclass(frozen=True)
class HardwareProfile:
    """Throughput curves and fixed costs of one GPU model for the cost model and the simulator.

    Attributes:
        name: short name ("h200-default", or what calibration writes).
        source: where the numbers come from (a date and a document, or "calibrated on <gpu> <date>").
        num_sms: N, SMs on the GPU = CTAs of the persistent megakernel.
        comm_sms: SM counts at which the NVLink (peer-write) bandwidth was measured, ascending.
        comm_gbps: peer-write GB/s per direction at those counts, all ranks writing at once.
        local_sms: SM counts at which the local HBM copy bandwidth was measured, ascending.
        local_gbps: local copy GB/s counting read + write bytes at those counts.
        gemm_sms: SM counts at which GEMM throughput was measured, ascending.
        gemm_tflops: bf16 GEMM TFLOP/s of large, well-shaped GEMMs at those counts.
        gemm_tile_efficiency: fraction of `gemm_tflops` the megakernel's gathered-row Triton tiles reach (rows of one
            expert gathered from the receive buffer, fused SiLU-mul epilogue). 0.75 is a GUESS until calibration.
        block_m, block_n0, block_n1: GEMM tile shape: BLOCK_M rows of one local expert; GEMM0 tiles cover BLOCK_N0
            columns of h (gate and up together, so 2 * BLOCK_N0 output columns); GEMM1 tiles cover BLOCK_N1 columns
            of H.
        launch_us: kernel launch + prologue, paid once per layer.
        flag_round_trip_us: release-store on one SM to acquire-load on another (chunk arrivals, chunk done, barriers).
        role_switch_us: a CTA changing role (comm -> stolen GEMM tiles, compute -> combine), pipeline refill.
        per_tile_overhead_us: fixed cost per GEMM tile beyond its FLOPs (claim atomic, dependency check, prologue).
        call_overhead_us: fixed cost of one layer call outside the kernel (routing exchange, the counts sync, the
            task tables, launches) that the GPU waits for; the same for every schedule, so it moves every prediction
            and changes no choice. Fitted from the serial rows of a measured (c, K) sweep.
        max_comm_sms: largest comm CTA count c a split candidate may use (0: N - 1). A split with most SMs on
            communication is the serial schedule with extra flag traffic; a calibrated profile caps c at the range
            its sweep measured.
        grouped_gemm_time_ratio: the time of the serial schedule's GEMMs when they run as the persistent grouped GEMMs
            (kernels/grouped_gemm.py) over their time on the megakernel's own tiles; 1.0 = not measured. A layer
            whose serial plans run the grouped GEMMs plans with `with_grouped_serial()`.
        serial_gemm_time_ratio: the factor formula (13) applies to the serial schedule's GEMM time (plan/cost_model.py,
            A8): 1.0 for the megakernel's tiles; `with_grouped_serial()` sets it to `grouped_gemm_time_ratio`.
        hbm_read_gbps: HBM read bandwidth of the whole GPU, GB/s (`torch.sum` over a large bf16 tensor, median;
            `weave-moe calibrate --hbm`). The benchmark floor's weights term reads it; the cost model does not.
            0 = not measured (profiles written before the field existed load with 0).
        notes: free text on how each number was obtained.
    """

    name: str
    source: str
    num_sms: int
    comm_sms: tuple[int, ...]
    comm_gbps: tuple[float, ...]
    local_sms: tuple[int, ...]
    local_gbps: tuple[float, ...]
    gemm_sms: tuple[int, ...]
    gemm_tflops: tuple[float, ...]
    gemm_tile_efficiency: float = 0.75
    block_m: int = 128
    block_n0: int = 64
    block_n1: int = 128
    launch_us: float = 5.0
    flag_round_trip_us: float = 2.0
    role_switch_us: float = 1.0
    per_tile_overhead_us: float = 0.5
    call_overhead_us: float = 0.0
    max_comm_sms: int = 0
    hbm_read_gbps: float = 0.0
    grouped_gemm_time_ratio: float = 1.0
    serial_gemm_time_ratio: float = 1.0
    notes: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.num_sms, int) or self.num_sms < 2:
            raise ValueError(f"HardwareProfile.num_sms must be an int >= 2, got {self.num_sms!r}")
        for xs_name, ys_name in (("comm_sms", "comm_gbps"), ("local_sms", "local_gbps"), ("gemm_sms", "gemm_tflops")):
            xs, ys = getattr(self, xs_name), getattr(self, ys_name)
            object.__setattr__(self, xs_name, tuple(int(x) for x in xs))
            object.__setattr__(self, ys_name, tuple(float(y) for y in ys))
            xs, ys = getattr(self, xs_name), getattr(self, ys_name)
            if len(xs) == 0 or len(xs) != len(ys):
                raise ValueError(f"HardwareProfile.{xs_name} and .{ys_name} must be non-empty and of equal length")
            if any(b <= a for a, b in zip(xs, xs[1:])) or xs[0] < 1:
                raise ValueError(f"HardwareProfile.{xs_name} must be strictly ascending SM counts >= 1, got {xs}")
            if any(y <= 0 for y in ys):
                raise ValueError(f"HardwareProfile.{ys_name} must be > 0, got {ys}")
        if not 0 < self.gemm_tile_efficiency <= 1:
            raise ValueError(f"gemm_tile_efficiency must be in (0, 1], got {self.gemm_tile_efficiency}")
        for name in ("block_m", "block_n0", "block_n1"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"HardwareProfile.{name} must be > 0")
        if not 0 <= int(self.max_comm_sms) <= self.num_sms - 1:
            raise ValueError(f"HardwareProfile.max_comm_sms must be in [0, {self.num_sms - 1}], got {self.max_comm_sms}")
        for name in ("launch_us", "flag_round_trip_us", "role_switch_us", "per_tile_overhead_us", "call_overhead_us",
                     "hbm_read_gbps"):
            if getattr(self, name) < 0:
                raise ValueError(f"HardwareProfile.{name} must be >= 0")

        for name in ("grouped_gemm_time_ratio", "serial_gemm_time_ratio"):
            if not 0 < getattr(self, name) <= 2:
                raise ValueError(f"HardwareProfile.{name} must be in (0, 2], got {getattr(self, name)}")

    def with_grouped_serial(self) -> "HardwareProfile":
        """The profile of a layer whose serial plans run the grouped GEMMs: formula (13)'s GEMM time scaled by
        `grouped_gemm_time_ratio`."""
        return replace(self, serial_gemm_time_ratio=self.grouped_gemm_time_ratio)

    # ---- construction and files -------------------------------------------------------------------------------
    @classmethod
    def default(cls) -> "HardwareProfile":
        """The shipped H200 profile: calibrated on the 2 x H200 pair (profiles/h200_measured.json). The uncalibrated
        figures remain available as `load_named("h200_default")`."""
        return _default_profile()

    @classmethod
    def load_named(cls, name: str) -> "HardwareProfile":
        """A profile shipped in weave_moe/plan/profiles/, by file stem (e.g. "h200_measured", "h200_default")."""
        shipped = resources.files("weave_moe.plan").joinpath("profiles")
        path = shipped.joinpath(f"{name}.json")
        if not path.is_file():
            known = sorted(p.name[:-5] for p in shipped.iterdir() if p.name.endswith(".json"))
            raise ValueError(f"no shipped profile {name!r}; shipped: {known}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, data: dict) -> "HardwareProfile":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown HardwareProfile fields {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def load(cls, path) -> "HardwareProfile":
        """Read a profile written by `save` (or by `weave-moe calibrate`)."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        data = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @property
    def comm_sms_limit(self) -> int:
        """The largest c a split candidate may use."""
        return int(self.max_comm_sms) or self.num_sms - 1

    # ---- curves (scalar or array of SM counts) -------------------------------------------------------------------
    def comm_bandwidth_gbps(self, sms):
        """NVLink peer-write GB/s that `sms` CTAs reach together (piecewise linear, clamped)."""
        return np.interp(sms, self.comm_sms, self.comm_gbps)

    def local_bandwidth_gbps(self, sms):
        """Local HBM copy GB/s (read + write bytes) that `sms` CTAs reach together."""
        return np.interp(sms, self.local_sms, self.local_gbps)

    def gemm_throughput_tflops(self, sms):
        """TFLOP/s of the megakernel's GEMM tiles on `sms` SMs: the large-GEMM curve times `gemm_tile_efficiency`."""
        return np.interp(sms, self.gemm_sms, self.gemm_tflops) * self.gemm_tile_efficiency

    # Tables indexed by SM count 0..N (entry 0 is unused and set to entry 1), in bytes/us and FLOP/us, so the
    # planner does array lookups instead of interpolation. 1 GB/s = 1e3 B/us; 1 TFLOP/s = 1e6 FLOP/us.
    @cached_property
    def comm_bytes_per_us(self) -> np.ndarray:
        return self._table(self.comm_bandwidth_gbps) * 1e3

    @cached_property
    def local_bytes_per_us(self) -> np.ndarray:
        return self._table(self.local_bandwidth_gbps) * 1e3

    @cached_property
    def gemm_flops_per_us_per_sm(self) -> np.ndarray:
        """Per-SM FLOP/us when s SMs run GEMM tiles at once (index s)."""
        sms = np.arange(self.num_sms + 1, dtype=np.float64)
        sms[0] = 1.0
        return self.gemm_throughput_tflops(sms) * 1e6 / sms

    def _table(self, curve) -> np.ndarray:
        sms = np.arange(self.num_sms + 1, dtype=np.float64)
        sms[0] = 1.0
        return np.asarray(curve(sms), dtype=np.float64)

    # ---- tiles --------------------------------------------------------------------------------------------------
    def gemm0_tile_flops(self, hidden_size: int) -> int:
        """One GEMM0 tile: BLOCK_M rows x (BLOCK_N0 gate + BLOCK_N0 up) columns x H: 2 * BM * 2 * BN0 * H."""
        return 2 * self.block_m * 2 * self.block_n0 * hidden_size

    def gemm1_tile_flops(self, intermediate_size: int) -> int:
        """One GEMM1 tile: BLOCK_M rows x BLOCK_N1 columns of H x I: 2 * BM * BN1 * I."""
        return 2 * self.block_m * self.block_n1 * intermediate_size

    # ---- peaks (also read by weave_moe.bench.floor.FloorConstants.from_profile) --------------------------------
    @property
    def gemm_peak_tflops(self) -> float:
        """The best GEMM TFLOP/s on the large-GEMM curve (no tile efficiency): the compute floor's rate."""
        return float(max(self.gemm_tflops))

    @property
    def peer_bandwidth_gbps(self) -> float:
        """The best NVLink GB/s on the comm curve: the communication floor's rate."""
        return float(max(self.comm_gbps))


def _default_profile() -> HardwareProfile:
    global _DEFAULT
    if _DEFAULT is None:
        text = resources.files("weave_moe.plan").joinpath("profiles/h200_measured.json").read_text()
        _DEFAULT = HardwareProfile.from_dict(json.loads(text))
    return _DEFAULT


_DEFAULT: HardwareProfile | None = None
