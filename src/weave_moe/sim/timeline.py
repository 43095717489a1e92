"""Per-SM timelines (simulated or measured), the one definition of their utilisation figures, and their picture.

Every task event has three times: `start` (the CTA claimed the task), `ready` (its dependency wait ended: the chunk
had arrived, the GEMM0 tiles of its M tile were done, ...) and `end`. [start, ready) is waiting, [ready, end) is work.
Events of kind "spin" are time a CTA spends outside any task while it is running (claiming the next task, switching
phase); they hold no work. See docs/utilisation.md for the figures computed from this.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Timeline", "Utilisation", "utilisation", "plot_timeline", "role_line", "measured_result", "MeasuredResult",
           "KINDS", "DISPATCH", "GEMM0", "GEMM1", "COMBINE", "STOLEN", "SPIN", "COMM_KINDS", "GEMM_KINDS"]

#: Event kinds, by code. "idle" is not an event: it is what the picture shows where a CTA runs nothing.
KINDS = ("dispatch", "gemm0", "gemm1", "combine", "stolen", "spin")
DISPATCH, GEMM0, GEMM1, COMBINE, STOLEN, SPIN = range(len(KINDS))
#: Communication work (the final reduce is drawn and counted as combine) and GEMM work (stolen tiles included).
COMM_KINDS = (DISPATCH, COMBINE)
GEMM_KINDS = (GEMM0, GEMM1, STOLEN)

#: Colours of the picture, per kind, then idle. Waiting is drawn in a light shade of the task's colour (`_shade`).
COLORS = {"dispatch": "#1f77b4", "gemm0": "#2ca02c", "gemm1": "#9467bd", "combine": "#ff7f0e", "stolen": "#d62728",
          "spin": "#4d4d4d", "idle": "#f7f7f7"}
_LABELS = {"spin": "spin outside tasks (claim, phase switch)"}


@dataclass(frozen=True)
class Timeline:
    """Every event of one layer on one rank. Arrays [num_events]: sm int32, kind int8 (index into KINDS), start /
    ready / end float64 in us (start <= ready <= end; simulated: from kernel start, launch included; measured: from
    the first event), chunk int16 (K = the final reduce; -1 unknown), group int32 (GEMM tiles: index of their (chunk,
    expert, M block); GEMM1 tiles of a group wait for all its GEMM0 tiles; -1 otherwise), stage int8 (0 = GEMM0 tile,
    1 = GEMM1 tile, stolen or not; -1 otherwise)."""

    num_sms: int
    sm: np.ndarray
    kind: np.ndarray
    start: np.ndarray
    ready: np.ndarray
    end: np.ndarray
    chunk: np.ndarray
    group: np.ndarray
    stage: np.ndarray

    @classmethod
    def from_events(cls, events: list[tuple], num_sms: int) -> "Timeline":
        """Events are tuples (sm, kind, start, ready, end, chunk, group, stage)."""
        if events:
            sm, kind, start, ready, end, chunk, group, stage = zip(*events)
        else:
            sm = kind = start = ready = end = chunk = group = stage = ()
        timeline = cls(num_sms, np.asarray(sm, dtype=np.int32), np.asarray(kind, dtype=np.int8),
                       np.asarray(start, dtype=np.float64), np.asarray(ready, dtype=np.float64),
                       np.asarray(end, dtype=np.float64), np.asarray(chunk, dtype=np.int16),
                       np.asarray(group, dtype=np.int32), np.asarray(stage, dtype=np.int8))
        if not ((timeline.start <= timeline.ready) & (timeline.ready <= timeline.end)).all():
            raise ValueError("every event needs start <= ready <= end")
        return timeline

    def __len__(self) -> int:
        return int(self.sm.shape[0])

    def count(self, kind: str) -> int:
        return int((self.kind == KINDS.index(kind)).sum())

    def work_us(self, kinds=None) -> float:
        """SM-time spent working in tasks of `kinds` (default: all), [ready, end) of each event; never spin."""
        mask = self._mask(kinds) & (self.kind != SPIN)
        return float((self.end[mask] - self.ready[mask]).sum())

    def wait_us(self, kinds=None) -> float:
        """SM-time spent in tasks of `kinds` (default: every task kind) waiting for their dependency, [start,
        ready)."""
        mask = self._mask(kinds) & (self.kind != SPIN)
        return float((self.ready[mask] - self.start[mask]).sum())

    def _mask(self, kinds) -> np.ndarray:
        return np.ones(len(self), dtype=bool) if kinds is None else np.isin(self.kind, kinds)


@dataclass(frozen=True)
class Utilisation:
    """Work-based utilisation of one timeline (docs/utilisation.md). Fractions in [0, 1]; SM-time fractions are of
    num_sms x span_us and sum with `idle` to 1.

    Attributes:
        span_us: first event start to last event end.
        sm_active: work SM-time / (num_sms x span): SMs progressing a task (the paper's SM Active).
        overlap: time during which communication work (dispatch, combine) and GEMM work both progress on some SM,
            / span (the paper's overlap ratio).
        gemm_active, comm_active: the part of sm_active in GEMM / communication tasks.
        waiting: SM-time of tasks waiting for their dependency (claimed, flag not yet set).
        spin: SM-time outside tasks while the CTA runs (claiming, phase switches).
        idle: the rest: CTA not started, finished, or between launches.
    """

    span_us: float
    sm_active: float
    overlap: float
    gemm_active: float
    comm_active: float
    waiting: float
    spin: float
    idle: float

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def utilisation(timeline: Timeline) -> Utilisation:
    """THE utilisation figures of a timeline, simulated or measured (docs/utilisation.md)."""
    if len(timeline) == 0:
        return Utilisation(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    span = float(timeline.end.max() - timeline.start.min())
    if span <= 0:
        return Utilisation(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    capacity = timeline.num_sms * span
    work = timeline.work_us() / capacity
    waiting = timeline.wait_us() / capacity
    spin = float((timeline.end - timeline.start)[timeline.kind == SPIN].sum()) / capacity
    overlap = _intersection(_work_union(timeline, COMM_KINDS), _work_union(timeline, GEMM_KINDS)) / span
    return Utilisation(span, work, overlap, timeline.work_us(GEMM_KINDS) / capacity,
                       timeline.work_us(COMM_KINDS) / capacity, waiting, spin, max(0.0, 1.0 - work - waiting - spin))


def _work_union(timeline: Timeline, kinds) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals during which some SM works in a task of `kinds`."""
    mask = np.isin(timeline.kind, kinds) & (timeline.end > timeline.ready)
    if not mask.any():
        return []
    order = np.argsort(timeline.ready[mask], kind="stable")
    starts, ends = timeline.ready[mask][order], timeline.end[mask][order]
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


def _shade(color: str, amount: float = 0.3) -> str:
    """`color` mixed with white (amount = share of the colour): the waiting shade of a task kind."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(255 - amount * (255 - c)):02x}" for c in rgb)


def plot_timeline(result, path, *, title: str | None = None, width_px: int = 1600) -> list[str]:
    """Write a PNG: one row per SM (SM 0 at the top), a colour per task kind for work, a light shade of it for the
    task's dependency wait, dark grey for spin outside tasks, near-white for idle (paper Figure 8).

    `result` is a SimResult or MeasuredResult (`timeline`, `latency_us`, `utilisation`, `plan` with c, K, n_steal,
    policy). Events are rasterised into `width_px` time bins per SM, waits first, then spin, then work, so work wins
    a bin it shares with waiting; that keeps pictures of 100k tiles fast and exact to one bin. The legend lists only
    what is drawn; the line between comm and compute CTAs is drawn where there is a split (c < N).

    Returns:
        the legend's labels.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    timeline: Timeline = result.timeline
    n = len(KINDS)
    extent = max(float(result.latency_us), float(timeline.end.max(initial=0.0)), 1e-9)
    idle = 2 * n
    image = np.full((timeline.num_sms, width_px), idle, dtype=np.int8)   # codes: work 0..n-1, wait n..2n-1, idle 2n
    scale = width_px / extent

    def bins(lo, hi):
        first = np.clip((lo * scale).astype(np.int64), 0, width_px - 1)
        return first, np.clip(np.maximum(np.rint(hi * scale).astype(np.int64), first + 1), 1, width_px)

    is_spin = timeline.kind == SPIN
    waits = (timeline.ready > timeline.start) & ~is_spin
    works = (timeline.end > timeline.ready) & ~is_spin
    layers = [(waits, timeline.start, timeline.ready, n), (is_spin, timeline.start, timeline.end, 0),
              (works, timeline.ready, timeline.end, 0)]
    for mask, lo, hi, offset in layers:
        first, last = bins(lo[mask], hi[mask])
        codes = timeline.kind[mask].astype(np.int64) + offset
        for sm, code, a, b in zip(timeline.sm[mask].tolist(), codes.tolist(), first.tolist(), last.tolist()):
            image[sm, a:b] = code
    drawn = set(np.unique(image).tolist())
    colors = [COLORS[k] for k in KINDS] + [_shade(COLORS[k]) if k != "spin" else COLORS[k] for k in KINDS]
    colors.append(COLORS["idle"])
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=120)
    ax.imshow(image, aspect="auto", interpolation="nearest", cmap=ListedColormap(colors), vmin=0, vmax=idle,
              extent=(0, extent, timeline.num_sms - 0.5, -0.5))
    plan = result.plan
    line, ylabel = role_line(plan.c, timeline.num_sms)
    if line is not None:
        ax.axhline(line, color="black", linewidth=1.2)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("time (us)")
    u = result.utilisation
    figures = (f"{result.latency_us:.0f} us, SM active {100 * u.sm_active:.0f}% (work; waiting "
               f"{100 * u.waiting:.0f}%), overlap {100 * u.overlap:.0f}% (comm and GEMM work)")
    ax.set_title(f"{title}\n{figures}" if title else f"{plan.policy}: c={plan.c}, K={plan.K}, n_steal={plan.n_steal}, "
                                                      f"{figures}", fontsize=10)
    handles = [Patch(color=COLORS[k], label=_LABELS.get(k, k)) for i, k in enumerate(KINDS) if i in drawn]
    handles += [Patch(color=_shade(COLORS[k]), label=f"{k} waiting") for i, k in enumerate(KINDS)
                if n + i in drawn and k != "spin"]
    if idle in drawn:
        handles.append(Patch(facecolor=COLORS["idle"], edgecolor="#bbbbbb", label="idle"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=max(1, min(len(handles), 6)),
              frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return [handle.get_label() for handle in handles]


def role_line(c: int, num_sms: int) -> tuple[float | None, str]:
    """(y of the line between comm and compute CTAs or None, the y-axis label that describes it)."""
    if c < num_sms:
        return c - 0.5, f"SM (CTA index); the {c} comm CTAs above the line"
    return None, "SM (CTA index); serial: every CTA runs every phase"


# ---- measured timelines (the megakernel's %globaltimer events, weave_moe.sim.measured) ---------------------------

#: kernel event name -> kind (the final reduce is drawn and counted as combine, stolen GEMM tiles as stolen)
_KERNEL_KINDS = {"dispatch": DISPATCH, "gemm0": GEMM0, "gemm1": GEMM1, "combine": COMBINE, "reduce": COMBINE,
                 "stolen_gemm0": STOLEN, "stolen_gemm1": STOLEN, "spin": SPIN}


class UtilisationFigures:
    """`sm_active` and `overlap` of a result that carries a `utilisation` (simulated and measured alike)."""

    @property
    def sm_active(self) -> float:
        """Work SM-time / (N x span of the timeline), in [0, 1]: waiting on a flag is not active."""
        return self.utilisation.sm_active

    @property
    def overlap(self) -> float:
        """Fraction of the span during which communication work and GEMM work both progress."""
        return self.utilisation.overlap


@dataclass(frozen=True)
class MeasuredResult(UtilisationFigures):
    """A timeline recorded inside the megakernel, shaped like a SimResult so `plot_timeline` draws it beside a
    simulated one. latency_us = the span of the recorded events."""

    latency_us: float
    timeline: Timeline
    plan: object
    utilisation: Utilisation


def measured_result(events, num_sms: int, plan) -> MeasuredResult:
    """Build a MeasuredResult from `WeaveBackend.last_timeline()` rows (`weave_moe.sim.measured.Event`, or lists of
    the same fields as stored in JSON): (cta, kind name, start_ns, end_ns, ready_ns). Rows of four fields (recorded
    before the kernel stamped the dependency wait) are read with ready = start: their waits count as work."""
    rows = []
    for event in events:
        cta, kind, t0, t1 = event[:4]
        ready = event[4] if len(event) > 4 else (t1 if kind == "spin" else t0)
        rows.append((cta, _KERNEL_KINDS[kind], t0 / 1e3, ready / 1e3, t1 / 1e3, -1, -1, -1))
    timeline = Timeline.from_events(rows, num_sms)
    usage = utilisation(timeline)
    return MeasuredResult(usage.span_us, timeline, plan, usage)
