"""Fit a `HardwareProfile` to in-kernel timelines of the weave megakernel, and score the cost model against benchmarks.

Input: timeline JSON files as written by `scripts/timeline_stats.py` and `weave-moe calibrate --measure`:
`[rank0, rank1, ...]`, each `{variant: {"plan": {c, K, n_steal, predicted_us}, "events": [[cta, kind, start_ns,
end_ns], ...]}}` (bench/results/timelines/README.md). A task is stamped when it is claimed and when it is done, so
flag waits sit inside tasks; the fit uses only tasks where no wait is expected.

What is fitted (everything else is copied from `base`):

* GEMM tiles. For every serial run (c = N; there every CTA is a "comm" CTA, so its tiles may be labelled
  stolen_gemm*), the median duration of GEMM0 and GEMM1 tasks after dropping each CTA's first GEMM0 task (it may wait
  for the peer's dispatch), tasks that start before the last dispatch task ends, and tasks longer than 2x the class
  median. A point is (model, stage, FLOPs of the recorded task, median us). Points of another tile shape than the
  target (`target_tiles`) are scaled by FLOPs to the target tile (same per-SM FLOP/us); points with another BLOCK_M are
  not used for the fit (a 64-row tile is less efficient per FLOP: not a FLOP rescale) and only reported. Then
      t(tile) = FLOPs / rate + overhead        (least squares on relative error; overhead >= 0)
  over the points, so rate = per-SM FLOP/us at N SMs and overhead = `per_tile_overhead_us`. The profile keeps the
  large-GEMM curve (`gemm_tflops`, the floor's peak) and sets `gemm_tile_efficiency = rate / (curve at N / N)`.
* GEMM fall-off with SM count: where a file has a static split (c < N, no stealing) and a serial run of the same
  model, the ratio of their median tile times (same shapes) gives the per-SM rate at N - c GEMM SMs relative to N.
  The curve becomes [1, N - c, N] -> [r * s0, r * (N - c) * s0, peak] with s0 = peak / N (constant per SM below N - c:
  not measured).
* Dispatch bandwidth. Dispatch tasks are blocks of `dispatch_rows` (16) rows for ONE destination, claimed in
  (destination, chunk) order, so sorted by start time the first 1/EP of a rank's tasks go to rank 0, the next 1/EP to
  rank 1, ... (APPROXIMATION: equal rows per destination, true for uniform routing at EP = 2, where ~99.6 % of tokens
  hit both ranks; tasks within 2 % of a boundary are dropped). Remote tasks (destination != rank) give NVLink GB/s
  = c * rows * 2H / median duration; local tasks give the local copy rate counting read + write bytes
  (2 * rows * 2H, the `local_gbps` convention). Both peers write at once, as in docs/platform.md's table, but one rank's
  local phase overlaps the other's remote phase, so remote rates are of mixed traffic. Measured points at the c of
  each run are turned into a ratio to the base curve there; the fitted curve is the base curve times the
  interpolated ratio (clamped at the ends), so the base curve's shape (the 32-CTA dip) is kept between points.
* Combine is reported (per-task medians and implied rates) but not fitted: a combine task also reads the GEMM rows
  of its tokens (assumption A3), so its bytes are not separable from one event.
* launch_us, flag_round_trip_us, role_switch_us: not separable from these timelines (times are relative to the first
  event; stage gaps of serial runs are reported) and kept from `base`.

Measured directly, not fitted: `hbm_read_gbps` (`measure_hbm_read_gbps`: `torch.sum` over a large bf16 tensor).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from weave_moe.models import MoESpec
from weave_moe.plan.profile import HardwareProfile

__all__ = ["TileShape", "fit_profile", "load_timeline_file", "KNOWN_TIMELINE_SHAPES", "CURRENT_TILES",
           "BRIEF_TILE_MEANS", "cost_model_accuracy", "format_fit_table", "shipped_timeline_files",
           "measure_hbm_read_gbps", "WEAVE_POLICIES"]


@dataclass(frozen=True)
class TileShape:
    """The megakernel's GEMM tile shape: GEMM0 tasks are block_m x (2 x block_n0) x H, GEMM1 tasks block_m x
    block_n1 x I (block_n1 = 256 runs as two 128-column halves sharing A)."""

    block_m: int = 128
    block_n0: int = 128
    block_n1: int = 256
    dispatch_rows: int = 16

    def flops(self, stage: int, spec: MoESpec) -> float:
        if stage == 0:
            return 2.0 * self.block_m * 2 * self.block_n0 * spec.hidden_size
        return 2.0 * self.block_m * self.block_n1 * spec.intermediate_size


#: The tile shapes of the current KernelConfig (src/weave_moe/backends/weave.py).
CURRENT_TILES = TileShape(128, 128, 256)

#: Tile shapes of the shipped timelines (bench/results/timelines/README.md and the KernelConfig at those commits).
KNOWN_TIMELINE_SHAPES = {
    "run6": (TileShape(128, 128, 128), "7658e5f"),
    "run7": (TileShape(64, 128, 128), "3a08f66 with WEAVE_MOE_KERNEL_CONFIG=block_m=64"),
}

#: Per-task means measured with the current KernelConfig on 2 x H200 (serial policy, uniform routing), as reported to
#: this module's author by the session that ran them (not in a committed file): (model, stage, TileShape of the task,
#: mean us). Qwen3's GEMM1 tasks ran as single 128-column tiles.
BRIEF_TILE_MEANS = (
    ("deepseek-v3", 0, TileShape(128, 128, 256), 113.0),
    ("deepseek-v3", 1, TileShape(128, 128, 256), 36.6),
    ("qwen3-30b-a3b", 0, TileShape(128, 128, 256), 33.0),
    ("qwen3-30b-a3b", 1, TileShape(128, 128, 128), 10.4),
)

_GEMM_KINDS = {"gemm0": 0, "gemm1": 1, "stolen_gemm0": 0, "stolen_gemm1": 1}


# ---- reading ---------------------------------------------------------------------------------------------------
def load_timeline_file(path) -> dict:
    """{"path", "model", "tokens", "shape", "shape_source", "ranks": [{variant: {"plan", "events"}}]}.

    Model and tokens come from the file name (`<tag>-<model>-<tokens>.json`, or a `meta` sidecar
    `<file>.meta.json` with {"model", "tokens", "block_m", "block_n0", "block_n1", "dispatch_rows"}); the tile shape
    from the sidecar, else from KNOWN_TIMELINE_SHAPES by name prefix, else the current KernelConfig (said in
    `shape_source`)."""
    path = Path(path)
    ranks = json.loads(path.read_text())
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        raise ValueError(f"{path}: expected a JSON list of per-rank dicts (variant -> plan, events)")
    meta_path = path.with_name(path.name + ".meta.json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    model, tokens = meta.get("model"), meta.get("tokens")
    if model is None:
        from weave_moe.models import list_models

        names = sorted((s.name for s in list_models()), key=len, reverse=True)
        model = next((n for n in names if f"-{n}-" in f"-{path.stem}-"), None)
        if model is None:
            raise ValueError(f"{path}: cannot tell the model from the file name; write {meta_path.name}")
    if tokens is None:
        found = re.search(r"-(\d+)$", path.stem)
        tokens = int(found.group(1)) if found else None
    if "block_m" in meta:
        shape = TileShape(meta["block_m"], meta["block_n0"], meta["block_n1"], meta.get("dispatch_rows", 16))
        shape_source = f"{meta_path.name}"
    else:
        prefix = path.stem.split("-")[0]
        if prefix in KNOWN_TIMELINE_SHAPES:
            shape, commit = KNOWN_TIMELINE_SHAPES[prefix]
            shape_source = f"known shipped timeline ({commit})"
        else:
            shape, shape_source = CURRENT_TILES, "assumed current KernelConfig (no sidecar)"
    return dict(path=str(path), model=model, tokens=tokens, shape=shape, shape_source=shape_source, ranks=ranks,
                meta=meta)


def _events_by_kind(events) -> dict[str, np.ndarray]:
    """kind -> [n, 3] int64 array (cta, start_ns, end_ns), sorted by start."""
    grouped = defaultdict(list)
    for cta, kind, t0, t1, *_ in events:  # newer rows add ready_ns (weave_moe.sim.measured.Event)
        grouped[kind].append((cta, t0, t1))
    out = {}
    for kind, rows in grouped.items():
        array = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        out[kind] = array[np.argsort(array[:, 1], kind="stable")]
    return out


def _is_serial(variant: str, plan: dict, num_sms: int) -> bool:
    return variant.endswith("serial") or int(plan.get("c", 0)) >= num_sms


def _gemm_durations_us(kinds: dict, stage: int, dispatch_end_ns: float) -> np.ndarray:
    """Durations of this stage's tasks after the filters in the module docstring."""
    names = [k for k, s in _GEMM_KINDS.items() if s == stage and k in kinds]
    if not names:
        return np.zeros(0)
    rows = np.concatenate([kinds[k] for k in names])
    rows = rows[np.argsort(rows[:, 1], kind="stable")]
    keep = rows[:, 1] >= dispatch_end_ns
    if stage == 0:  # each CTA's first GEMM0 task may wait for the peer's dispatch
        _, first = np.unique(rows[:, 0], return_index=True)
        keep[first] = False
    durations = (rows[keep, 2] - rows[keep, 1]) / 1e3
    if durations.size == 0:
        return durations
    return durations[durations <= 2.0 * np.median(durations)]


def _split_by_destination(rows: np.ndarray, world_size: int, rank: int, margin: float = 0.02):
    """(local durations us, remote durations us) of destination-major tasks sorted by start (equal shares)."""
    n = len(rows)
    index = np.arange(n)
    dest = np.minimum(index * world_size // max(n, 1), world_size - 1)
    bounds = np.arange(1, world_size) * n / world_size
    near = np.zeros(n, dtype=bool)
    for b in bounds:
        near |= np.abs(index - b) < max(1.0, margin * n)
    durations = (rows[:, 2] - rows[:, 1]) / 1e3
    return durations[(dest == rank) & ~near], durations[(dest != rank) & ~near]


# ---- fitting ---------------------------------------------------------------------------------------------------
def _fit_rate_overhead(flops: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    """Least squares of t = a*F + o on relative error (rows divided by t); o >= 0. Returns (rate = 1/a, o)."""
    A = np.stack([flops / times, 1.0 / times], axis=1)
    b = np.ones_like(times)
    (a, o), *_ = np.linalg.lstsq(A, b, rcond=None)
    if o < 0 or a <= 0:
        a, o = float(np.sum(flops / times) / np.sum((flops / times) ** 2)), 0.0
    return 1.0 / float(a), float(o)


def fit_profile(timeline_files, base: HardwareProfile | None = None, *, target: TileShape = CURRENT_TILES,
                tile_means=(), name: str = "h200-measured", source_note: str = "", date: str | None = None,
                fit_falloff: bool = True):
    """Fit a profile to timelines (see the module docstring). Returns (HardwareProfile, report dict).

    Args:
        timeline_files: paths of timeline JSON files.
        base: profile whose unfitted fields are kept (default `HardwareProfile.default()`).
        target: the tile shape the profile describes (its block_m / block_n0 / block_n1).
        tile_means: extra (model, stage, TileShape, mean_us) points measured with some tile shape (e.g.
            BRIEF_TILE_MEANS); for a (model, stage) they replace timeline points.
        source_note: appended to `source` (e.g. the commit of the timelines).
        date: the date written into `source` (default today, UTC).
    """
    base = HardwareProfile.default() if base is None else base
    N = base.num_sms
    files = [load_timeline_file(f) for f in timeline_files]
    if not files:
        raise ValueError("fit_profile needs at least one timeline file")
    report: dict = {"files": [], "gemm_points": [], "gemm_points_unused": [], "falloff": [], "dispatch": [],
                    "combine": [], "stage_gaps_us": []}
    points: dict[tuple[str, int], list] = defaultdict(list)
    falloff_pairs: dict[tuple[str, int, int], dict] = defaultdict(dict)
    comm_points: dict[str, list] = {"remote": [], "local": []}
    for info in files:
        spec = MoESpec.from_name(info["model"])
        shape: TileShape = info["shape"]
        report["files"].append(dict(path=info["path"], model=info["model"], tokens=info["tokens"],
                                    shape=vars(shape), shape_source=info["shape_source"]))
        world_size = len(info["ranks"])
        row_bytes = 2 * spec.hidden_size
        for rank, variants in enumerate(info["ranks"]):
            for variant, record in variants.items():
                plan = record.get("plan", {})
                kinds = _events_by_kind(record["events"])
                serial = _is_serial(variant, plan, N)
                c = N if serial else int(plan.get("c", N))
                dispatch_end = float(kinds["dispatch"][:, 2].max()) if "dispatch" in kinds else 0.0
                for stage in (0, 1):
                    durations = _gemm_durations_us(kinds, stage, dispatch_end)
                    if durations.size < 8:
                        continue
                    median = float(np.median(durations))
                    if serial:
                        task_flops = shape.flops(stage, spec)
                        point = dict(model=info["model"], stage=stage, rank=rank, file=Path(info["path"]).name,
                                     task_shape=vars(shape), task_flops=task_flops, median_us=median,
                                     n=int(durations.size), tflops_per_sm=task_flops / median / 1e6)
                        if shape.block_m != target.block_m:
                            point["why_unused"] = f"block_m={shape.block_m}, target {target.block_m}"
                            report["gemm_points_unused"].append(point)
                        else:
                            points[info["model"], stage].append(
                                dict(point, flops=target.flops(stage, spec), time_us=median * target.flops(
                                    stage, spec) / task_flops, scaled=shape != target))
                        falloff_pairs[info["path"], rank, stage][N] = median
                    elif int(plan.get("n_steal", 0)) == 0 and "stolen_gemm0" not in kinds:
                        falloff_pairs[info["path"], rank, stage][N - c] = median
                # dispatch: remote vs local by claim order
                if "dispatch" in kinds and len(kinds["dispatch"]) >= 4 * world_size:
                    local, remote = _split_by_destination(kinds["dispatch"], world_size, rank)
                    task_bytes = shape.dispatch_rows * row_bytes
                    entry = dict(file=Path(info["path"]).name, rank=rank, variant=variant, c=c,
                                 remote_median_us=float(np.median(remote)), local_median_us=float(np.median(local)),
                                 window_us=float((kinds["dispatch"][:, 2].max() - kinds["dispatch"][:, 1].min()) / 1e3))
                    entry["remote_gbps"] = c * task_bytes / entry["remote_median_us"] / 1e3
                    entry["local_gbps"] = c * 2 * task_bytes / entry["local_median_us"] / 1e3
                    report["dispatch"].append(entry)
                    comm_points["remote"].append((c, entry["remote_gbps"]))
                    comm_points["local"].append((c, entry["local_gbps"]))
                # combine after the last GEMM task (no wait for GEMM1 flags inside): report only
                gemm_end = max((float(kinds[k][:, 2].max()) for k in _GEMM_KINDS if k in kinds), default=0.0)
                if "combine" in kinds and int(plan.get("K", 1)) == 1:  # K > 1: chunk-major, not source-major
                    rows = kinds["combine"][kinds["combine"][:, 1] >= gemm_end]
                    if len(rows) >= 4 * world_size:
                        local, remote = _split_by_destination(rows, world_size, rank)
                        report["combine"].append(dict(
                            file=Path(info["path"]).name, rank=rank, variant=variant, tasks=int(len(rows)),
                            remote_median_us=float(np.median(remote)), local_median_us=float(np.median(local)),
                            window_us=float((kinds["combine"][:, 2].max() - kinds["combine"][:, 1].min()) / 1e3)))
                if serial and "dispatch" in kinds and "gemm0" in kinds:
                    report["stage_gaps_us"].append(dict(
                        file=Path(info["path"]).name, rank=rank,
                        dispatch_to_gemm0=float((kinds["gemm0"][:, 1].min() - dispatch_end) / 1e3)))
    # extra per-task means replace timeline points of the same (model, stage)
    for model, stage, shape, mean_us in tile_means:
        spec = MoESpec.from_name(model)
        task_flops = shape.flops(stage, spec)
        if shape.block_m != target.block_m:
            continue
        report.setdefault("gemm_points_replaced", []).extend(points.get((model, stage), []))
        points[model, stage] = [dict(model=model, stage=stage, rank=None, file="tile_means", task_shape=vars(shape),
                                     task_flops=task_flops, median_us=mean_us, n=None,
                                     tflops_per_sm=task_flops / mean_us / 1e6, flops=target.flops(stage, spec),
                                     time_us=mean_us * target.flops(stage, spec) / task_flops,
                                     scaled=shape != target)]
    fitted: dict = {}
    all_points = [p for group in points.values() for p in group]
    report["gemm_points"] = all_points
    curve_sms, curve_tflops = base.gemm_sms, base.gemm_tflops
    efficiency, overhead = base.gemm_tile_efficiency, base.per_tile_overhead_us
    if all_points:
        flops = np.array([p["flops"] for p in all_points])
        times = np.array([p["time_us"] for p in all_points])
        rate, overhead = _fit_rate_overhead(flops, times)     # FLOP/us per SM at N SMs
        large_per_sm = float(np.interp(N, base.gemm_sms, base.gemm_tflops)) * 1e6 / N
        efficiency = min(1.0, rate / large_per_sm)
        residuals = (flops / rate + overhead) / times - 1.0
        for p, r in zip(all_points, residuals):
            p["fit_residual_pct"] = 100.0 * float(r)
        fitted.update(tile_tflops_per_sm=rate / 1e6, per_tile_overhead_us=overhead, gemm_tile_efficiency=efficiency)
        report["gemm_classes"] = {
            f"{m}/gemm{s}": dict(tflops_per_sm=float(np.mean([p["flops"] / p["time_us"] for p in g])) / 1e6,
                                 tile_us=float(np.mean([p["time_us"] for p in g])))
            for (m, s), g in sorted(points.items())}
    # fall-off: per-SM rate at N - c relative to N
    ratios = []
    for (path, rank, stage), by_sms in falloff_pairs.items():
        if N in by_sms:
            for sms, median in by_sms.items():
                if sms != N:
                    ratios.append((sms, by_sms[N] / median))
                    report["falloff"].append(dict(file=Path(path).name, rank=rank, stage=stage, gemm_sms=sms,
                                                  ratio=by_sms[N] / median))
    if fit_falloff and ratios:
        sms_values = sorted({s for s, _ in ratios})
        if len(sms_values) == 1 and efficiency < 1.0:
            sms = sms_values[0]
            ratio = float(np.exp(np.mean([math.log(r) for _, r in ratios])))
            peak = float(max(base.gemm_tflops))
            per_sm = peak / N
            ratio = min(ratio, 1.0 / efficiency)   # tile rate may not pass the large-GEMM rate
            if ratio > 1.0 and 1 < sms < N:
                curve_sms, curve_tflops = (1, sms, N), (ratio * per_sm, ratio * per_sm * sms, peak)
                fitted["falloff_ratio"] = ratio
                fitted["falloff_sms"] = sms
    # comm curves: base curve times the interpolated measured/base ratio
    comm_gbps = base.comm_gbps
    local_gbps = base.local_gbps
    for key, xs, ys in (("remote", base.comm_sms, base.comm_gbps), ("local", base.local_sms, base.local_gbps)):
        by_c = defaultdict(list)
        for c, gbps in comm_points[key]:
            by_c[c].append(gbps)
        if not by_c:
            continue
        cs = sorted(by_c)
        ratio = [float(np.median(by_c[c])) / float(np.interp(c, xs, ys)) for c in cs]
        new = tuple(float(y) * float(np.interp(x, cs, ratio)) for x, y in zip(xs, ys))
        fitted[f"{key}_points"] = {int(c): float(np.median(by_c[c])) for c in cs}
        fitted[f"{key}_ratio"] = {int(c): r for c, r in zip(cs, ratio)}
        if key == "remote":
            comm_gbps = new
        else:
            local_gbps = new
    today = date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    names = ", ".join(Path(f["path"]).name for f in files)
    used_means = bool(tile_means)
    source = (f"calibrated {today} by weave_moe.plan.calibrate.fit_profile from in-kernel timelines on 2 x H200 "
              f"[{names}]" + (" + per-task means of the current KernelConfig (BRIEF_TILE_MEANS)" if used_means else "")
              + (f"; {source_note}" if source_note else "") + f"; unfitted fields from '{base.name}'")
    notes = _notes(fitted, report, base, target)
    profile = replace(base, name=name, source=source, comm_gbps=comm_gbps, local_gbps=local_gbps,
                      gemm_sms=curve_sms, gemm_tflops=curve_tflops, gemm_tile_efficiency=efficiency,
                      per_tile_overhead_us=overhead, block_m=target.block_m, block_n0=target.block_n0,
                      block_n1=target.block_n1, notes=notes)
    report["fitted"] = fitted
    return profile, report


def _notes(fitted: dict, report: dict, base: HardwareProfile, target: TileShape) -> str:
    parts = [f"tile shape = current KernelConfig (block_m={target.block_m}, block_n0={target.block_n0}, "
             f"block_n1={target.block_n1}); timeline points of other shapes are scaled by FLOPs (same per-SM FLOP/us); "
             f"block_m=64 timelines are reported, not fitted."]
    if "tile_tflops_per_sm" in fitted:
        parts.append(f"GEMM tiles: t = FLOPs / {fitted['tile_tflops_per_sm']:.3f} TFLOP/s per SM + "
                     f"{fitted['per_tile_overhead_us']:.2f} us, least squares over {len(report['gemm_points'])} "
                     f"(model, stage) points of serial runs; gemm_tile_efficiency = that rate / the large-GEMM curve "
                     f"per SM at {base.num_sms}.")
    if "falloff_ratio" in fitted:
        parts.append(f"gemm curve: per-SM rate {fitted['falloff_ratio']:.3f}x higher with {fitted['falloff_sms']} "
                     f"GEMM SMs than with {base.num_sms} (static:20 vs serial tile medians, same shapes), constant per "
                     f"SM below (not measured); the {base.num_sms}-SM value is the base peak.")
    for key, field in (("remote", "comm_gbps"), ("local", "local_gbps")):
        if f"{key}_ratio" in fitted:
            pts = ", ".join(f"{c}: {fitted[f'{key}_points'][c]:.0f} GB/s ({r:.2f}x)"
                            for c, r in fitted[f"{key}_ratio"].items())
            parts.append(f"{field}: base curve times the measured/base ratio interpolated over comm CTAs "
                         f"(dispatch tasks split remote/local by claim order, equal shares per destination): {pts}.")
    parts.append("launch_us, flag_round_trip_us, role_switch_us: not separable from the timelines, kept from base "
                 f"('{base.name}': guesses). Combine is not fitted. UNVALIDATED: no GPU run has planned with this "
                 "profile.")
    return " ".join(parts)


# ---- report table ----------------------------------------------------------------------------------------------
def format_fit_table(profile: HardwareProfile, base: HardwareProfile) -> list[tuple[str, str, str]]:
    """(quantity, base value, fitted value) rows for a printed table."""
    N = base.num_sms
    rows = [
        ("GEMM tile TFLOP/s per SM at N", f"{float(base.gemm_throughput_tflops(N)) / N:.3f}",
         f"{float(profile.gemm_throughput_tflops(N)) / N:.3f}"),
        ("GEMM tile TFLOP/s per SM at N-20", f"{float(base.gemm_throughput_tflops(N - 20)) / (N - 20):.3f}",
         f"{float(profile.gemm_throughput_tflops(N - 20)) / (N - 20):.3f}"),
        ("gemm_tile_efficiency", f"{base.gemm_tile_efficiency:.3f}", f"{profile.gemm_tile_efficiency:.3f}"),
        ("per_tile_overhead_us", f"{base.per_tile_overhead_us:.2f}", f"{profile.per_tile_overhead_us:.2f}"),
        ("block_m / block_n0 / block_n1", f"{base.block_m}/{base.block_n0}/{base.block_n1}",
         f"{profile.block_m}/{profile.block_n0}/{profile.block_n1}"),
    ]
    for c in (12, 20, 54, 132):
        rows.append((f"NVLink GB/s at {c} CTAs", f"{float(base.comm_bandwidth_gbps(c)):.0f}",
                     f"{float(profile.comm_bandwidth_gbps(c)):.0f}"))
    for c in (12, 20, 54, 132):
        rows.append((f"local GB/s (r+w) at {c} CTAs", f"{float(base.local_bandwidth_gbps(c)):.0f}",
                     f"{float(profile.local_bandwidth_gbps(c)):.0f}"))
    for name in ("launch_us", "flag_round_trip_us", "role_switch_us"):
        rows.append((name, f"{getattr(base, name):.2f}", f"{getattr(profile, name):.2f} (kept)"))
    rows.append(("hbm_read_gbps (0 = not measured)", f"{base.hbm_read_gbps:.0f}", f"{profile.hbm_read_gbps:.0f}"))
    return rows


# ---- HBM read bandwidth ----------------------------------------------------------------------------------------
def measure_hbm_read_gbps(device=None, gib: float = 8.0, iters: int = 20) -> float:
    """HBM read bandwidth of one GPU, GB/s: `torch.sum` over a `gib` GiB bf16 tensor, median of `iters` timed calls.

    A reduction reads every byte once and writes one value, so bytes / time is the read rate. The tensor is capped
    at a quarter of the GPU's memory; it is far larger than L2 (50 MB on an H200), so no call is served from cache.
    Measured 4240 GB/s on one H200 (8 GiB, 2026-12-01; specified 4.8 TB/s).

    Raises:
        RuntimeError: without a CUDA device.
    """
    import statistics

    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("measuring the HBM read bandwidth needs a CUDA GPU (torch.cuda.is_available() is False)")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    num_bytes = int(min(gib * 2**30, total / 4)) // 2 * 2
    data = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device=device)
    for _ in range(2):  # warm-up: the reduction kernel's first launch
        data.sum()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        data.sum()
        end.record()
    torch.cuda.synchronize(device)
    median_ms = statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))
    del data
    torch.cuda.empty_cache()
    return num_bytes / (median_ms * 1e-3) / 1e9


# ---- cost model vs measured benchmark ----------------------------------------------------------------------------
#: The weave policies a default `weave-moe bench` compares (the full schedule and its ablations).
WEAVE_POLICIES = ("serial", "static:20", "per_iteration", "spatial", "weave")


def _bench_workloads(spec: MoESpec, tokens: int, routing: str, world_size: int, rotate: int, seed: int, skew: float):
    """Per input set, every rank's Workload, drawn exactly as weave_moe.bench.harness._make_inputs draws them."""
    import zlib

    import torch

    from weave_moe import routing as routing_lib
    from weave_moe.plan.workload import Workload

    sets = []
    for set_index in range(rotate):
        parts = (spec.name, tokens, routing, set_index)
        set_seed = (seed * 7919 + zlib.crc32("/".join(map(str, parts)).encode())) % (2**31)
        if routing == "uniform":
            ids, _ = routing_lib.uniform(tokens * world_size, spec.num_experts, spec.top_k, seed=set_seed)
        else:
            ids, _ = routing_lib.skewed(tokens * world_size, spec.num_experts, spec.top_k, skew=skew,
                                        layer=set_index, seed=set_seed)
        ids_per_rank = list(torch.as_tensor(ids).view(world_size, tokens, spec.top_k))
        sets.append([Workload.from_routing(spec, ids_per_rank, r) for r in range(world_size)])
    return sets


def cost_model_accuracy(csv_path, profiles: dict[str, HardwareProfile], *, rotate: int = 4, seed: int = 0,
                        skew: float = 3.0, policies=WEAVE_POLICIES, models=None, tokens=None) -> dict:
    """Re-plan every weave row of a bench CSV on the CPU with each profile, as the harness records it (per input set
    the max over ranks of plan().predicted_us, mean over sets), and compare with the measured median.

    Returns {"rows": [...], "mae": {profile: {policy: mean |pred - median| ms}}, "mape": {...}, "recorded_mae":
    {policy: ...} (the CSV's own predicted_ms), "fastest": [...], "choice": [...]}.
    """
    import csv

    from weave_moe.plan.cost_model import plan as make_plan

    with open(csv_path) as handle:
        table = list(csv.DictReader(handle))
    world_size = int(table[0]["world_size"])
    measured: dict[tuple, dict[str, float]] = defaultdict(dict)
    recorded: dict[tuple, dict[str, float]] = defaultdict(dict)
    specs = {}
    for row in table:
        if row["backend"] != "weave" or row["policy"] not in policies or not row["median_ms"]:
            continue
        if models and row["model"] not in models:
            continue
        if tokens and int(row["tokens_per_rank"]) not in tokens:
            continue
        key = (row["model"], int(row["tokens_per_rank"]), row["routing"])
        measured[key][row["policy"]] = float(row["median_ms"])
        if row["predicted_ms"]:
            recorded[key][row["policy"]] = float(row["predicted_ms"])
        specs[row["model"]] = MoESpec(int(row["num_experts"]), int(row["top_k"]), int(row["hidden_size"]),
                                      int(row["intermediate_size"]), name=row["model"])
    rows, choice = [], []
    for key in sorted(measured):
        model, tok, routing = key
        sets = _bench_workloads(specs[model], tok, routing, world_size, rotate, seed, skew)
        for pname, profile in profiles.items():
            weave_c = []
            for policy in policies:
                predicted = []
                for workloads in sets:
                    plans = [make_plan(w, profile, policy) for w in workloads]
                    predicted.append(max(p.predicted_us for p in plans) * 1e-3)
                    if policy == "weave":
                        weave_c.append(max(p.c for p in plans))
                if policy in measured[key]:
                    rows.append(dict(model=model, tokens=tok, routing=routing, profile=pname, policy=policy,
                                     median_ms=measured[key][policy], predicted_ms=float(np.mean(predicted)),
                                     recorded_ms=recorded[key].get(policy)))
            choice.append(dict(model=model, tokens=tok, routing=routing, profile=pname,
                               weave_picks="serial" if all(c >= profile.num_sms for c in weave_c) else
                               ("split" if all(c < profile.num_sms for c in weave_c) else "mixed"),
                               weave_c=sorted(set(weave_c))))
    mae, mape, recorded_mae = {}, {}, {}
    for pname in profiles:
        mae[pname], mape[pname] = {}, {}
        for policy in policies:
            sel = [r for r in rows if r["profile"] == pname and r["policy"] == policy]
            if sel:
                mae[pname][policy] = float(np.mean([abs(r["predicted_ms"] - r["median_ms"]) for r in sel]))
                mape[pname][policy] = float(np.mean([abs(r["predicted_ms"] / r["median_ms"] - 1) for r in sel])) * 100
    first = next(iter(profiles))
    for policy in policies:
        sel = [r for r in rows if r["profile"] == first and r["policy"] == policy and r["recorded_ms"] is not None]
        if sel:
            recorded_mae[policy] = float(np.mean([abs(r["recorded_ms"] - r["median_ms"]) for r in sel]))
    fastest = []
    for key in sorted(measured):
        best = min(measured[key], key=measured[key].get)
        fastest.append(dict(model=key[0], tokens=key[1], routing=key[2], fastest=best,
                            median_ms=measured[key][best], serial_ms=measured[key].get("serial")))
    return dict(rows=rows, mae=mae, mape=mape, recorded_mae=recorded_mae, fastest=fastest, choice=choice)


def shipped_timeline_files() -> list[Path]:
    """The timelines under bench/results/timelines of a source checkout (empty when installed without them)."""
    root = Path(__file__).resolve().parents[3] / "bench" / "results" / "timelines"
    return sorted(root.glob("*.json")) if root.is_dir() else []
