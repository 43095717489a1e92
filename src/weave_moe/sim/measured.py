"""Events of a timeline recorded inside the megakernel, parsed from its raw event buffer.

Buffer layout (written by `_record` in weave_moe.backends.weave.kernels.megakernel): int64 [num CTAs, MAX_EVENTS, 4],
one row per task a CTA ran, in the order it ran them:

    [kind, start_ns, end_ns, ready_ns]     kind = index into the kernel's EVENT_NAMES; times are %globaltimer ns
    start: the CTA claimed the task; ready: its dependency wait ended (= start for tasks without one); end: done

Rows never written are zero (end_ns = 0). Staged launches (the serial policy) write stage s from row s * MAX_EVENTS / 4
on, so a run of consecutive written rows is one launch on that CTA. Between two consecutive rows of one run the CTA
was running but outside any task (the loop: claiming the next task, switching phase): that gap becomes a "spin"
event. Before a CTA's first row, after its last and between launches it was not running (idle). Rows recorded
before the ready stamp existed (4th field 0) are read with ready = start.

Imports nothing from the backend: the event names come with the call, so `weave_moe.sim` keeps its import rule.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Event", "events_from_buffer", "SPIN"]

#: name of the state outside tasks in the returned events
SPIN = "spin"


class Event(NamedTuple):
    """One measured event; times in ns from the first event of the call (ready_ns last so that readers of the older
    four-field rows (cta, kind, start_ns, end_ns) index the same fields)."""

    cta: int
    kind: str
    start_ns: int
    end_ns: int
    ready_ns: int


def events_from_buffer(buffer, event_names) -> list[Event]:
    """Parse the megakernel's timeline buffer into events, with "spin" events for time outside tasks.

    Args:
        buffer: int64 [num CTAs, MAX_EVENTS, 4] (numpy array or anything `np.asarray` takes, e.g. a CPU tensor), the
            layout in the module docstring.
        event_names: the kernel's EVENT_NAMES (kind code -> name).

    Returns:
        Events sorted by (cta, start), times relative to the earliest recorded start; [] when nothing was recorded.
    """
    rows = np.asarray(buffer, dtype=np.int64)
    if rows.ndim != 3 or rows.shape[-1] != 4:
        raise ValueError(f"timeline buffer: expected int64 [num CTAs, MAX_EVENTS, 4], got shape {list(rows.shape)}")
    written = rows[:, :, 2] > 0
    if not written.any():
        return []
    origin = int(rows[:, :, 1][written].min())
    events: list[Event] = []
    for cta in range(rows.shape[0]):
        previous_index, previous_end = -2, 0
        for index in np.nonzero(written[cta])[0].tolist():
            kind, start, end, ready = rows[cta, index].tolist()
            # each thread of the CTA stores its own clock read: keep ready inside [start, end]
            ready = min(max(ready, start), end) if ready else start
            if index == previous_index + 1 and start > previous_end:     # same launch: the CTA ran between tasks
                events.append(Event(cta, SPIN, previous_end - origin, start - origin, start - origin))
            events.append(Event(cta, event_names[kind], start - origin, end - origin, ready - origin))
            previous_index, previous_end = index, end
    return events
