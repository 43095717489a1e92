"""Per-SM timelines of a simulated layer, their summary figures, and the Figure-8-style picture."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Timeline", "plot_timeline", "measured_result", "MeasuredResult", "KINDS", "DISPATCH", "GEMM0", "GEMM1",
           "COMBINE", "STOLEN"]

#: Task kinds, by code. "idle" is not a task: it is what the picture shows where no task runs.
KINDS = ("dispatch", "gemm0", "gemm1", "combine", "stolen")
DISPATCH, GEMM0, GEMM1, COMBINE, STOLEN = range(len(KINDS))
_COMM_KINDS = (DISPATCH, COMBINE)
_GEMM_KINDS = (GEMM0, GEMM1, STOLEN)

#: Colours of the picture, per kind, then idle last.
COLORS = {"dispatch": "#1f77b4", "gemm0": "#2ca02c", "gemm1": "#98df8a", "combine": "#ff7f0e", "stolen": "#d62728",
          "idle": "#f2f2f2"}


@dataclass(frozen=True)
class Timeline:
    """Every task of a simulated layer. Arrays [num_tasks]: sm int32, kind int8 (index into KINDS), start / end
    float64 in us from kernel start (launch included), chunk int16 (K = the final reduce), group int32 (GEMM tiles:
    index of their (chunk, expert, M block); GEMM1 tiles of a group wait for all its GEMM0 tiles; -1 otherwise).
    stage int8 (0 = GEMM0 tile, 1 = GEMM1 tile, stolen or not; -1 otherwise)."""

    num_sms: int
    sm: np.ndarray
    kind: np.ndarray
    start: np.ndarray
    end: np.ndarray
    chunk: np.ndarray
    group: np.ndarray
    stage: np.ndarray

    @classmethod
    def from_events(cls, events: list[tuple], num_sms: int) -> "Timeline":
        if events:
            sm, kind, start, end, chunk, group, stage = zip(*events)
        else:
            sm = kind = start = end = chunk = group = stage = ()
        return cls(num_sms, np.asarray(sm, dtype=np.int32), np.asarray(kind, dtype=np.int8),
                   np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64),
                   np.asarray(chunk, dtype=np.int16), np.asarray(group, dtype=np.int32),
                   np.asarray(stage, dtype=np.int8))

    def __len__(self) -> int:
        return int(self.sm.shape[0])

    def count(self, kind: str) -> int:
        return int((self.kind == KINDS.index(kind)).sum())

    def busy_us(self) -> float:
        """SM-time spent in tasks (tasks of one SM never overlap)."""
        return float((self.end - self.start).sum())

    def overlap_us(self) -> float:
        """Time during which a comm task (dispatch, combine) and a GEMM task (on another SM) both run."""
        comm = _union(self, _COMM_KINDS)
        gemm = _union(self, _GEMM_KINDS)
        return _intersection(comm, gemm)


def _union(timeline: Timeline, kinds) -> list[tuple[float, float]]:
    mask = np.isin(timeline.kind, kinds) & (timeline.end > timeline.start)
    if not mask.any():
        return []
    order = np.argsort(timeline.start[mask], kind="stable")
    starts, ends = timeline.start[mask][order], timeline.end[mask][order]
    reach = np.maximum.accumulate(ends)
    breaks = np.nonzero(starts[1:] > reach[:-1])[0] + 1     # a new interval starts after a gap
    first = np.concatenate(([0], breaks))
    last = np.concatenate((breaks - 1, [len(starts) - 1]))
    return list(zip(starts[first].tolist(), reach[last].tolist()))


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if high > low:
            total += high - low
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def plot_timeline(result, path, *, title: str | None = None, width_px: int = 1600) -> None:
    """Write a PNG: one row per SM (SM 0 at the top), a colour per task kind, idle in light grey (paper Figure 8).

    Tasks are rasterised into `width_px` time bins per SM (a later task wins a shared bin), which keeps pictures of
    100k tiles fast and exact to one bin.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    timeline: Timeline = result.timeline
    latency = max(result.latency_us, 1e-9)
    image = np.full((timeline.num_sms, width_px), len(KINDS), dtype=np.int8)  # idle
    scale = width_px / latency
    first = np.clip((timeline.start * scale).astype(np.int64), 0, width_px - 1)
    last = np.clip(np.maximum(np.rint(timeline.end * scale).astype(np.int64), first + 1), 1, width_px)
    for sm, kind, lo, hi in zip(timeline.sm.tolist(), timeline.kind.tolist(), first.tolist(), last.tolist()):
        image[sm, lo:hi] = kind
    names = list(KINDS) + ["idle"]
    cmap = ListedColormap([COLORS[name] for name in names])
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=120)
    ax.imshow(image, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=len(names) - 1,
              extent=(0, latency, timeline.num_sms - 0.5, -0.5))
    plan = result.plan
    ax.axhline(plan.c - 0.5 if plan.c < timeline.num_sms else -0.5, color="black", linewidth=0.8)
    ax.set_xlabel("time (us)")
    ax.set_ylabel("SM (CTA index; comm role above the line)")
    ax.set_title(title or f"{plan.policy}: c={plan.c}, K={plan.K}, n_steal={plan.n_steal}, "
                          f"{result.latency_us:.0f} us, SM active {100 * result.sm_active:.0f}%, "
                          f"overlap {100 * result.overlap:.0f}%")
    ax.legend(handles=[Patch(color=COLORS[name], label=name) for name in names], loc="upper center",
              bbox_to_anchor=(0.5, -0.12), ncol=len(names), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- measured timelines (the megakernel's %globaltimer events) ----------------------------------------------------

#: kernel event name -> simulator kind (the final reduce is drawn as combine, stolen GEMM tiles as stolen)
_KERNEL_KINDS = {"dispatch": DISPATCH, "gemm0": GEMM0, "gemm1": GEMM1, "combine": COMBINE, "reduce": COMBINE,
                 "stolen_gemm0": STOLEN, "stolen_gemm1": STOLEN}


@dataclass(frozen=True)
class MeasuredResult:
    """A timeline recorded inside the megakernel, shaped like a SimResult so `plot_timeline` draws it beside a
    simulated one. `sm_active` counts time inside tasks, flag waits inside a task included (the kernel stamps a task
    when it is claimed and when it is done), so it is an upper bound of the paper's SM Active."""

    latency_us: float
    sm_active: float
    overlap: float
    timeline: Timeline
    plan: object


def measured_result(events, num_sms: int, plan) -> MeasuredResult:
    """Build a MeasuredResult from `WeaveBackend.last_timeline()` rows: (cta, kind name, start_ns, end_ns)."""
    rows = [(cta, _KERNEL_KINDS[kind], t0 / 1e3, t1 / 1e3, -1, -1, -1) for cta, kind, t0, t1 in events]
    timeline = Timeline.from_events(rows, num_sms)
    latency = float(timeline.end.max()) if len(timeline) else 0.0
    busy = timeline.busy_us()
    return MeasuredResult(latency, busy / (num_sms * latency) if latency else 0.0,
                          timeline.overlap_us() / latency if latency else 0.0, timeline, plan)
