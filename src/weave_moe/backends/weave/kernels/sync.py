"""Flags, bounded spin-waits and release signals: every cross-CTA and cross-GPU wait of the megakernel lives here.

Protocol (checked on the H200 pair, docs/platform.md, "Cross-GPU code with Triton 3.6 and torch 2.11"):
- A writer makes its data visible with `tl.debug_barrier()` (all threads of the CTA finished their stores) followed by
  ONE release atomic on the flag (`signal_add`). Scalar atomics are executed once per program.
- A reader spins with acquire atomics (`wait_at_least`) before it touches the data. `scope="sys"` for flags that a
  peer GPU writes, `"gpu"` for flags written by CTAs of the same kernel.
- Every spin has a deadline in nanoseconds of `%globaltimer`. On timeout the waiter records an error code in the
  status word and returns False; every later wait sees the status word set and returns at once, so a dead peer ends
  the kernel quickly and the host raises `WeaveTimeoutError` instead of hanging the GPU.
- Every value that steers a spin loop is the same in every thread of the CTA. Scalar atomics are (one thread does
  the atomic, shared memory broadcasts the result behind `bar.sync`); a plain or volatile scalar load is NOT (each
  thread loads for itself), nor is a `%globaltimer` read. If the warps of one CTA disagree on leaving the loop, the
  ones that stay wait in the next poll's `bar.sync` for warps that never come: the kernel hangs. That happened on the
  H200 pair when a peer stalled (the status word flipped between two warps' loads), so the status word is read with an
  atomic and the clock through a CTA-wide max (`uniform_time_ns`).

- A flag that carries a sequence number instead of a count (the routing exchange) is set with ONE release exchange
  (`signal_store`) by the program that completes the data; programs that share the data count themselves on a local
  counter first (`arrive`: barrier, then an acq_rel add whose old value tells the last one).

Status word layout (int32 [4]): [0] first error code (0 = none), [1] flag index that timed out, [2] value seen,
[3] value expected.

Rejections (codes >= REJECT_FIRST, only in the device-resident call, `KernelConfig.resident`): the call's routing was
refused before its kernel, on every rank alike (kernels/counts.py, `exchange.CountsFormat.verdict`); the word is then
[code, rank at fault, detail, this layer's call number]. A kernel that finds the status word set when it starts does
no work and fills its output with NaN. Unlike a timeout, a rejection leaves the layer usable: the host raises the
named error (`REJECT_NAMES`) at the next call or `synchronize()` and clears the word.

A rejection belongs to ONE call. The device-resident call keeps a second word beside the live one (status [4:8],
`REPORTED`): before each call's work, the call's first kernel (the routing message's pack) moves a rejection out of
the live word into the reported word (unless that is still full: first error wins) and clears the live word
(`carry_rejection`); the host clears both words when it raises, which it does only once the calls before have
ended. So a rejection never makes the NEXT call do nothing on one rank while its peers run that call (seen at EP = 2 on one GPU: the failing rank, which
raises its own error in the call and never synchronizes, had its next call's exchange return at once on the stale
word while the peer waited for its rows); the host raises the reported rejection at a later call or at
`synchronize()`. Timeouts (codes < REJECT_FIRST) stay in the live word: the layer is broken.

Under the Triton interpreter (TRITON_INTERPRET=1: CPU tests) there is no inline PTX, so no `%globaltimer` and no
`nanosleep`: `INTERPRETER` switches `wait_at_least` to a deadline counted in polls (100 ns per poll, the backoff's
nominal sleep) and `backoff` to nothing, so that timeouts can be tested on the CPU. The compiled kernel is unchanged.
"""

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

#: True when kernels run under the Triton interpreter (decided at import, as triton.jit decides it)
INTERPRETER = tl.constexpr(bool(triton.knobs.runtime.interpret))

ERROR_NONE = tl.constexpr(0)
ERROR_ARRIVAL_TIMEOUT = tl.constexpr(1)      # dispatch rows from a peer never arrived
ERROR_GEMM0_TIMEOUT = tl.constexpr(2)        # a GEMM1 tile waited for its GEMM0 tiles
ERROR_GEMM1_TIMEOUT = tl.constexpr(3)        # a combine block waited for its chunk's GEMM1 tiles
ERROR_COMBINE_TIMEOUT = tl.constexpr(4)      # the final reduce waited for a peer's combine rows
ERROR_EXCHANGE_TIMEOUT = tl.constexpr(5)     # the routing exchange waited for a peer's routing message
ERROR_STREAM_K_TIMEOUT = tl.constexpr(6)     # a stream-K GEMM tile waited for another CTA's partial sum

REJECT_FIRST = 16
REJECT_BAD_IDS = 16        # detail: number of expert ids outside [-1, E) the rank sent
REJECT_PEER_FAILED = 17    # detail: the rank's coordination error code (its local checks failed)
REJECT_CALL_ORDER = 18     # detail: the call number in that rank's header (it called another layer or call)

#: int32 words of one status word; the resident call's status tensor holds two: [0:4] live, [4:8] reported rejection
STATUS_WORDS = 4
REPORTED = tl.constexpr(STATUS_WORDS)   # offset of the reported rejection (docstring)
_REJECT_FIRST = tl.constexpr(REJECT_FIRST)

#: rejection code -> what it means (the host's exception names it)
REJECT_NAMES = {
    REJECT_BAD_IDS: "expert ids outside [-1, E)",
    REJECT_PEER_FAILED: "a rank failed its local checks",
    REJECT_CALL_ORDER: "ranks called different layers or calls",
}

#: error code -> (what happened, how the flag tag in status[1] reads)
ERROR_NAMES = {
    1: ("dispatch rows from a peer did not arrive", "source*16+chunk"),
    2: ("a GEMM1 tile waited too long for its GEMM0 tiles", "M tile"),
    3: ("a combine block waited too long for its chunk's GEMM1 tiles", "chunk"),
    4: ("combine rows from a peer did not arrive", "destination rank"),
    5: ("the routing message of a peer did not arrive", "source rank"),
    6: ("a stream-K GEMM tile waited too long for another CTA's partial sum", "CTA"),
}


#: Programmatic dependent launch (PDL): every kernel of a call is launched with `**LAUNCH` and begins with
#: `pdl_enter()`, so its CTAs are scheduled while its predecessor runs and wait for it (all of it, memory included)
#: before their first instruction; measured on an H200 (scripts/launch_probe.py, bench/results/h200-fe38ff1): a
#: dependent small kernel in a CUDA graph 0.88 -> 0.60 us (1 CTA), 0.99 -> 0.79 us (132 CTAs). WEAVE_MOE_PDL=0 turns
#: it off for the process (read once, at import: the launch option is part of each kernel's compile).
PDL = os.environ.get("WEAVE_MOE_PDL", "1").strip().lower() not in ("0", "false", "no", "off")
LAUNCH = {"launch_pdl": PDL}


def launch_options(pdl: bool = True) -> dict:
    """`LAUNCH`, or with `pdl` False an ordinary launch (the kernel's `pdl_wait` / `pdl_release` are then no-ops)."""
    return {"launch_pdl": PDL and pdl}


def optional_pdl(pdl: bool) -> dict:
    """For a kernel whose PDL constexpr makes it begin with `pdl_enter`: with `pdl` that constant and `LAUNCH`, else
    nothing (its default compile, a plain launch, keeps its key)."""
    return dict(PDL=True, **LAUNCH) if pdl else {}


@triton.jit
def pdl_enter():
    """First statement of every kernel launched with `LAUNCH`: wait until the previous kernel of the stream has
    finished and its memory is visible (`griddepcontrol.wait`; without PDL a no-op), then let the next kernel's CTAs
    be scheduled (they wait likewise). Nothing under the interpreter, which runs one launch at a time."""
    pdl_wait()
    pdl_release()


@triton.jit
def pdl_wait():
    """The first half of `pdl_enter`: wait for the previous kernel of the stream (all of it, memory included). A
    kernel that begins with this alone must call `pdl_release` once its CTAs' main work is issued."""
    if not INTERPRETER:
        gdc_wait()


@triton.jit
def pdl_release():
    """The second half of `pdl_enter`: let the next kernel's CTAs be scheduled (once every CTA of this launch has
    released or exited). Its waiting CTAs share the SMs with this kernel's: the bandwidth-bound grouped GEMMs release
    after their tile loops (measured, grouped_gemm's module docstring)."""
    if not INTERPRETER:
        gdc_launch_dependents()


@triton.jit
def pdl_ahead():
    """First statement of a kernel that loads, before its `pdl_enter`, what launches BEFORE its predecessor wrote
    (never what the predecessor itself writes), so that those loads overlap the predecessor's work instead of
    following it. Sound only where the predecessor waits before it releases (`pdl_enter`, not `pdl_start(True)`):
    this kernel's CTAs are scheduled once every CTA of the predecessor has released, so once each has passed its own
    wait, which returned only when the launch before it had ended with its memory visible (the scan's reads beside
    the counts kernel rest on the same rule, `pdl_start`). Every path through the kernel then calls `pdl_enter` once.
    No code: it marks the kernel for tests/test_pdl.py."""
    pass


@triton.jit
def pdl_start(INDEPENDENT: tl.constexpr):
    """`pdl_enter`, or with INDEPENDENT only its release: for a kernel that reads nothing the previous kernel of the
    stream writes (what it reads was complete before that one started), which then runs beside it. Such a kernel
    must end with `pdl_finish(INDEPENDENT)`."""
    if not INDEPENDENT:
        pdl_wait()
    pdl_release()


@triton.jit
def pdl_finish(INDEPENDENT: tl.constexpr):
    """Last statement of a kernel that began with `pdl_start`: with INDEPENDENT, wait for the previous kernel here,
    so that this kernel's end still implies that one's (the next kernel, which waits for this one, may read what
    either wrote)."""
    if INDEPENDENT:
        pdl_wait()


@triton.jit
def global_time_ns():
    """%globaltimer (ns). Coarse (about 1 µs ticks on Hopper) but enough for deadlines and timelines."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def uniform_time_ns():
    """%globaltimer as ONE value for the whole CTA: every thread reads the clock, a CTA-wide max (shared memory and a
    barrier, as Triton lowers a reduction over a tensor spread across all warps) makes the result identical in every
    thread, so a deadline test cannot split the CTA's warps."""
    lanes = tl.arange(0, 1024)
    clocks = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [lanes], dtype=tl.int64, is_pure=False,
                                       pack=1)
    return tl.max(clocks, axis=0)


@triton.jit
def status_set(status_ptr):
    """1 if some wait of this kernel already failed, else 0; an atomic read, so the same in every thread."""
    return (tl.atomic_add(status_ptr, 0, sem="relaxed", scope="gpu") != 0).to(tl.int32)


@triton.jit
def load_live(status_ptr, mask):
    """The live status word (int32 [REPORTED]) where `mask` (a scalar: the program that will `carry_rejection`),
    zeros elsewhere: loaded apart from `carry_rejection` so that a kernel can issue it first, beside its other
    independent loads, instead of after them."""
    return tl.load(status_ptr + tl.arange(0, REPORTED), mask=mask, other=0)


@triton.jit
def carry_rejection(status_ptr, live):
    """Start of a device-resident call (module docstring): move a rejection of an earlier call from the live word
    (`live`, as `load_live` read it in the same kernel) into the reported word (unless that still holds one: first
    error wins) and clear the live word. One program runs this; the call's other kernels come after it in stream
    order."""
    words = tl.arange(0, REPORTED)
    live_code = tl.sum(tl.where(words == 0, live, 0), axis=0)
    if live_code >= _REJECT_FIRST:
        reported_code = tl.load(status_ptr + REPORTED)
        if reported_code == 0:
            tl.store(status_ptr + REPORTED + words, live)
        tl.store(status_ptr + words, tl.zeros([REPORTED], dtype=tl.int32))


@triton.jit
def backoff():
    """Sleep ~100 ns between polls, so spinning CTAs do not flood L2 with acquire loads of one line while the GEMM
    CTAs need it (measured on H200: without backoff, GEMM0 tiles ran up to 2.6x slower while 20 CTAs spun).
    Nothing under the interpreter."""
    if not INTERPRETER:
        tl.inline_asm_elementwise("nanosleep.u32 100; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def signal_add(flag_ptr, value, SYS_SCOPE: tl.constexpr):
    """Release `value` onto a counter after this CTA's stores (all threads) are done."""
    tl.debug_barrier()
    if SYS_SCOPE:
        tl.atomic_add(flag_ptr, value, sem="release", scope="sys")
    else:
        tl.atomic_add(flag_ptr, value, sem="release", scope="gpu")


@triton.jit
def arrive(counter_ptr, SYS_SCOPE: tl.constexpr):
    """Count this CTA on `counter_ptr` after its stores (all threads) are done; returns the count before it (the same
    in every thread), so the CTA that sees `participants - 1` knows every other one arrived and released its stores,
    which it acquires (acq_rel: release of this CTA's stores, acquire of the earlier arrivals' stores)."""
    tl.debug_barrier()
    if SYS_SCOPE:
        old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    else:
        old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return old


@triton.jit
def signal_store(flag_ptr, value, SYS_SCOPE: tl.constexpr):
    """Release `value` into a flag after this CTA's stores (all threads) are done: one atomic exchange (a store with
    release order; the flag has one writer, so the old value is not needed)."""
    tl.debug_barrier()
    if SYS_SCOPE:
        tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")
    else:
        tl.atomic_xchg(flag_ptr, value, sem="release", scope="gpu")


@triton.jit
def _poll(flag_ptr, SYS_SCOPE: tl.constexpr):
    if SYS_SCOPE:
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    else:
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    return seen


@triton.jit
def _wait_started():
    """The clock a wait's deadline counts from (0 under the interpreter, which counts polls instead)."""
    start = tl.full([], 0, tl.int64)
    if not INTERPRETER:
        start = uniform_time_ns()
    return start


@triton.jit
def _past_deadline(start, polls, timeout_ns):
    """Whether a wait that began at `start` and has polled `polls` times is past its deadline."""
    if INTERPRETER:
        elapsed = polls * 100  # no clock under the interpreter: 100 ns per poll
    else:
        elapsed = uniform_time_ns() - start
    return elapsed > timeout_ns


@triton.jit
def _report_timeout(status_ptr, error_code, flag_tag, seen, expected):
    """First error wins: record the code, which flag and what was seen for the host's message."""
    if tl.atomic_cas(status_ptr, 0, error_code, sem="relaxed", scope="gpu") == 0:
        tl.store(status_ptr + 1, flag_tag)
        tl.store(status_ptr + 2, seen)
        tl.store(status_ptr + 3, expected)


@triton.jit
def _poll_all(flag_ptrs, need, SYS_SCOPE: tl.constexpr):
    if SYS_SCOPE:
        seen = tl.atomic_add(flag_ptrs, 0, mask=need, sem="acquire", scope="sys")
    else:
        seen = tl.atomic_add(flag_ptrs, 0, mask=need, sem="acquire", scope="gpu")
    return tl.where(need, seen, 0)


@triton.jit
def wait_all_at_least(flag_ptr, expected_ptr, n, status_ptr, error_code, tag_base, timeout_ns,
                      BLOCK: tl.constexpr, SYS_SCOPE: tl.constexpr, GROUP: tl.constexpr = 0):
    """Spin until flag_ptr[i] >= expected_ptr[i] for every i < n (<= BLOCK), acquire.

    `wait_at_least` for n flags at once: each poll is ONE round of n independent atomics (lanes of the CTA) instead
    of n polls one after another, so the wait costs about one flag's latency when the flags are set already (a
    dispatch launch's final wait over every chunk's arrival counter was eight dependent sys-scope polls). The first
    poll reads all n flags, issued beside the load of the expected values rather than after it (a poll predicated
    on them would wait for that load: one round trip more when the flags are set already); later polls read only
    the flags expecting more than 0. Whether to stay in the loop is a CTA-wide sum, the same in every thread. On a
    timeout the status word names flag `tag_base + i` of the first unmet i, or with GROUP (flags in groups of
    GROUP <= 16, e.g. a source's chunks) `tag_base + (i // GROUP) * 16 + i % GROUP`, the tag `wait_at_least`'s
    callers give such a flag. Returns 1 on success, 0 on timeout or when another wait already failed.
    """
    offs = tl.arange(0, BLOCK)
    expected = tl.load(expected_ptr + offs, mask=offs < n, other=0)
    return wait_all_values(flag_ptr, expected, n, status_ptr, error_code, tag_base, timeout_ns, BLOCK, SYS_SCOPE,
                           GROUP)


@triton.jit
def wait_all_values(flag_ptr, expected, n, status_ptr, error_code, tag_base, timeout_ns,
                    BLOCK: tl.constexpr, SYS_SCOPE: tl.constexpr, GROUP: tl.constexpr = 0):
    """`wait_all_at_least` with the expected values in registers (`expected`: [BLOCK] int32, lanes >= n ignored)
    instead of in memory: until flag_ptr[i] >= expected[i] for every i < n. Its first poll needs nothing of
    `expected`, so it goes out beside whatever computes them."""
    offs = tl.arange(0, BLOCK)
    seen = _poll_all(flag_ptr + offs, offs < n, SYS_SCOPE)
    need = (offs < n) & (expected > 0)
    unmet = tl.sum((need & (seen < expected)).to(tl.int32), axis=0)
    if unmet != 0:
        start = _wait_started()
        failed = status_set(status_ptr)
        polls = 0
        while (unmet != 0) & (failed == 0):
            backoff()
            seen = _poll_all(flag_ptr + offs, need, SYS_SCOPE)
            unmet = tl.sum((need & (seen < expected)).to(tl.int32), axis=0)
            polls += 1
            if (unmet != 0) & ((polls & 15) == 0):   # as in wait_at_least
                failed = status_set(status_ptr)
                if _past_deadline(start, polls, timeout_ns):
                    first = tl.min(tl.where(need & (seen < expected), offs, BLOCK), axis=0)
                    tag = tag_base + first
                    if GROUP > 0:
                        tag = tag_base + (first // GROUP) * 16 + first % GROUP
                    _report_timeout(status_ptr, error_code, tag,
                                    tl.sum(tl.where(offs == first, seen, 0), axis=0),
                                    tl.sum(tl.where(offs == first, expected, 0), axis=0))
                    failed = 1
    return (unmet == 0).to(tl.int32)


@triton.jit
def wait_at_least(flag_ptr, expected, status_ptr, error_code, flag_tag, timeout_ns, SYS_SCOPE: tl.constexpr):
    """Spin until *flag_ptr >= expected (acquire).

    Returns 1 on success, 0 on timeout or when another wait already failed. `flag_tag` is an int the caller chooses
    to name the flag in the error report (e.g. source rank * 16 + chunk).
    """
    seen = _poll(flag_ptr, SYS_SCOPE)
    ok = (seen >= expected).to(tl.int32)
    if ok == 0:
        start = _wait_started()
        failed = status_set(status_ptr)
        polls = 0
        while (ok == 0) & (failed == 0):
            backoff()
            seen = _poll(flag_ptr, SYS_SCOPE)
            ok = (seen >= expected).to(tl.int32)
            polls += 1
            # The status word and the clock every 16th poll: both cost an atomic / a CTA-wide barrier, and up to all
            # CTAs may spin here at once.
            if (ok == 0) & ((polls & 15) == 0):
                failed = status_set(status_ptr)
                if _past_deadline(start, polls, timeout_ns):
                    _report_timeout(status_ptr, error_code, flag_tag, seen, expected)
                    failed = 1
    return ok
