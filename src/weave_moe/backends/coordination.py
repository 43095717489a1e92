"""Cross-rank coordination shared by the backends: agreement at construction, a header on every call's first
exchange, bounded waits, and the errors every rank raises together.

An expert-parallel call is a sequence of collectives that every rank must enter in the same order. Three things make
that fragile, and this module handles each once for every backend:

1. Construction (`agree_on_layer`): ranks exchange one fixed-size fingerprint of what the layer is (spec, dtype,
   max_tokens_per_rank, backend, policy) with the layer's creation index on its process group and a local error
   flag. Only on a mismatch or an error, a second exchange carries the descriptions or the error messages, so the
   error names the differing field (or the failing rank's message) on every rank.
   After the backends are built, and before a layer's first call, one more small all-gather of an error code
   (`agree_no_errors`) makes a backend constructor that failed, or experts not loaded, raise on every rank: the
   backends whose calls carry no header (symm, deepep) could not tell the peers, whose tokens need this rank's
   experts.
2. Calls (`CallCoordinator`): every call's FIRST exchange carries a header of `HEADER_WORDS` int32-sized words
   [identity, creation index, call sequence number, error code] from every rank. A rank whose local checks failed
   (or that raised before its exchange) still enters that exchange, with tokens T = 0 and a non-zero code; after it,
   `CallCoordinator.finish` runs on every rank with every rank's header and raises on all of them in the same call:
   the failing rank its own exception, the others `PeerError` naming the rank and its message (a second exchange,
   only on this error path, carries the messages); two different layers met in one exchange (ranks called layers in
   a different order) raise `CallOrderError` everywhere. Nothing else of the call has been sent, so the layer goes on
   with the next call.
3. Waits (`CallCoordinator.wait`, `poll`): every wait for a peer ends within the layer's `timeout_s`:
   - CPU tensors (gloo): collectives run with async_op=True and `work.wait(timeout=...)`.
   - CUDA tensors (NCCL): the host never blocks inside NCCL (collectives are queued on the device); it blocks only
     where it reads a result, and there it polls `work.is_completed()` (or a CUDA event's `query()`) against a
     deadline instead of blocking. NCCL's own watchdog (10 minutes by default) is not relied on. A collective queued
     after the last host read of a call (the nccl backend's dispatch and combine) is bounded at the next call's
     first read or at `synchronize()`: one CUDA stream runs them in order.
   A wait that runs past its deadline cannot be resumed (the collective is still pending in the process group, and
   the next one would pair with it), so the coordinator marks the layer broken: its later calls raise
   `LayerBrokenError` at once. The process group itself should then be destroyed (or the process restarted).

The reference backend has no per-call collective (it gathers all experts once, in `load_experts`), so a call there
has nothing to coordinate: a failing rank raises alone and no peer waits for it. The symm and deepep backends'
exchanges (NVSHMEM, DeepEP) carry no header: a rank whose input is rejected still makes the call with T = 0, so its
peers finish it correctly and only that rank raises; their calls are not checked for order.
"""

from __future__ import annotations

import hashlib
import json
import time
import weakref
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "CallCoordinator", "agree_on_layer", "agree_no_errors", "describe_layer", "layer_fingerprint", "exchange_text", "DEFAULT_TIMEOUT_S",
    "HEADER_WORDS", "HEADER_CALL_WORD", "HEADER_CODE_WORD", "code_name", "CODE_OK", "CODE_REJECTED", "CODE_FAILED",
    "CoordinationError", "PeerError", "CallOrderError",
    "LayerMismatchError", "CollectiveError", "CollectiveTimeoutError", "LayerBrokenError",
]

#: Default bound, in seconds, of every wait of a layer for its peers. Long enough for the legitimate skew between ranks
#: on a first call (NCCL communicator setup, the weave backend's task-table compile: ~22 s on a cold machine), far
#: below NCCL's 10-minute watchdog and gloo's 30-minute default.
DEFAULT_TIMEOUT_S = 60.0

#: Words of the per-call header: [identity, creation index, call sequence number, error code], each in [0, 2**31).
HEADER_WORDS = 4
#: Positions in the header: the words before HEADER_CODE_WORD name the call (layer identity, index, call number).
HEADER_CALL_WORD = 2
HEADER_CODE_WORD = 3
CODE_OK = 0
CODE_REJECTED = 1  # a local check rejected this rank's input (TypeError / ValueError)
CODE_FAILED = 2  # this rank raised anything else before its exchange
_CODE_NAMES = {CODE_REJECTED: "rejected its input", CODE_FAILED: "raised before its exchange"}
_WORD_MASK = 0x7FFF_FFFF  # header words travel as int32 in the weave backend's exchange
MESSAGE_BYTES = 1024  # error messages and layer descriptions travel truncated to this many UTF-8 bytes


class CoordinationError(RuntimeError):
    """Base of the errors that involve more than this rank."""


class PeerError(CoordinationError):
    """Another rank failed this call (a local check or an exception before its exchange); this rank's input was fine.

    Attributes:
        failures: {rank: that rank's error message} of every failing rank.
    """

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


class CallOrderError(CoordinationError):
    """Ranks met in one exchange while calling different layers (or different calls of one layer)."""


class LayerMismatchError(CoordinationError, ValueError):
    """At construction, ranks disagree on the layer (spec, dtype, max_tokens_per_rank, backend, policy or order)."""


class CollectiveError(CoordinationError):
    """A collective failed (e.g. a peer process died); the layer is broken."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A wait for the peers ran past the layer's timeout_s; the layer is broken."""


class LayerBrokenError(CoordinationError):
    """The layer was marked broken by an earlier timeout or failed collective and cannot be used again."""


def describe_layer(spec, max_tokens_per_rank, backend: str, policy: str, dtype: str = "bfloat16",
                   kernel_config: str | None = None) -> dict[str, str]:
    """What every rank must agree on, field name -> printable value (a spec that is not a MoESpec still prints).
    `kernel_config`: the weave backend's KernelConfig (`as_text`: its fields off their defaults), whose kernels'
    protocol every rank must share (None: a backend without one)."""
    if all(hasattr(spec, f) for f in ("num_experts", "top_k", "hidden_size", "intermediate_size")):
        spec_text = (f"E={spec.num_experts} k={spec.top_k} H={spec.hidden_size} I={spec.intermediate_size}")
    else:
        spec_text = repr(spec)[:200]
    description = {"spec": spec_text, "dtype": dtype, "max_tokens_per_rank": repr(max_tokens_per_rank),
                   "backend": repr(backend), "policy": repr(policy)}
    if kernel_config is not None:
        description["kernel_config"] = repr(kernel_config or "defaults")
    return description


def layer_fingerprint(description: dict[str, str]) -> int:
    """A 63-bit hash of a `describe_layer` dict (stable across processes, unlike `hash`)."""
    digest = hashlib.blake2b(json.dumps(description, sort_keys=True).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


#: Layers built so far on each process group (EP > 1): the creation index that tells same-shaped layers apart.
_LAYER_COUNTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _next_layer_index(group) -> int:
    index = _LAYER_COUNTERS.get(group, 0)
    _LAYER_COUNTERS[group] = index + 1
    return index


def code_name(code: int) -> str:
    """What a header's error code means (for messages)."""
    return _CODE_NAMES.get(code, f"error code {code}")


def _error_code(error: BaseException) -> int:
    return CODE_REJECTED if isinstance(error, (TypeError, ValueError)) else CODE_FAILED


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _poll(is_done: Callable[[], bool], deadline: float) -> bool:
    """Poll `is_done` until it is True (-> True) or `deadline` (time.monotonic) passes (-> False).

    Spins for the first millisecond (the common case: a peer a few microseconds behind), then sleeps with a backoff
    up to 0.1 ms. The counts' wait of a weave call often outlasts the first millisecond (it queues behind the previous
    layer's kernel), and a wake-up after the event fired is latency added to the call: 0.1 ms bounds that, at ~10^4
    wake-ups per second of a long wait."""
    start = time.monotonic()
    delay = 0.0
    while not is_done():
        now = time.monotonic()
        if now >= deadline:
            return False
        if now - start > 1e-3:
            delay = min(max(2 * delay, 2e-5), 1e-4)
            time.sleep(min(delay, deadline - now))
    return True


def _wait_work(work, device: torch.device, deadline: float) -> bool:
    """Wait for a collective's `work` until `deadline`; False if it did not complete in time. Raises what the
    collective raised (e.g. a peer's connection closed)."""
    if device.type == "cpu":
        remaining = deadline - time.monotonic()
        if remaining <= 0 and not work.is_completed():
            return False
        try:
            work.wait(timeout=timedelta(seconds=max(remaining, 1e-3)))
        except RuntimeError as error:
            if "timed out" in str(error) and not work.is_completed():
                return False  # gloo's "Operation timed out!" (by its own clock, a hair before `deadline`)
            raise
        return True
    if not _poll(work.is_completed, deadline):
        return False
    work.wait()  # raises the collective's error, if any; orders the current stream after it
    return True


def _bounded(work, device: torch.device, timeout_s: float, what: str, on_timeout: Callable[[str], None]) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        done = _wait_work(work, device, deadline)
    except Exception as error:  # noqa: BLE001 - any failure of the collective itself
        reason = f"{what} failed: {type(error).__name__}: {error}"
        on_timeout(reason)
        raise CollectiveError(f"{reason}. A peer rank probably died; this layer can no longer be used") from error
    if not done:
        reason = f"{what} did not complete within timeout_s={timeout_s:g} s"
        on_timeout(reason)
        raise CollectiveTimeoutError(
            f"{reason}: a peer rank died, stalled or never called this layer. The collective cannot be resumed: the "
            f"layer is now broken; destroy the process group (or restart the processes) before going on")


def exchange_text(group, world_size: int, device: torch.device, text: str, timeout_s: float, what: str,
                  on_timeout: Callable[[str], None] = lambda reason: None) -> list[str]:
    """All-gather one short string per rank (UTF-8, truncated to MESSAGE_BYTES) with a bounded wait."""
    data = text.encode()[:MESSAGE_BYTES]
    mine = torch.zeros(MESSAGE_BYTES + 2, dtype=torch.uint8)
    mine[:2] = torch.tensor([len(data) % 256, len(data) // 256], dtype=torch.uint8)
    mine[2 : 2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[2:2]
    mine = mine.to(device)
    gathered = torch.empty(world_size * (MESSAGE_BYTES + 2), dtype=torch.uint8, device=device)
    work = dist.all_gather_into_tensor(gathered, mine, group=group, async_op=True)
    _bounded(work, device, timeout_s, what, on_timeout)
    texts = []
    for row in gathered.view(world_size, -1).cpu().tolist():
        length = row[0] + 256 * row[1]
        texts.append(bytes(row[2 : 2 + length]).decode(errors="replace"))
    return texts


def agree_on_layer(group, rank: int, world_size: int, device: torch.device, description: dict[str, str],
                   local_error: BaseException | None, timeout_s: float) -> int:
    """The construction check: every rank of `group` learns whether all agree on `description` and all succeeded.

    One all-gather of [fingerprint, creation index, error code] (int64, 3 words per rank); a second one (text) only
    when something differs. Every rank raises, or none does.

    Args:
        group, rank, world_size: the layer's process group (world_size > 1).
        device: where the exchange's tensors live (the layer's device: CPU for gloo, CUDA for NCCL).
        description: `describe_layer(...)` of this rank's layer.
        local_error: the exception this rank's own argument checks raised, or None.
        timeout_s: bound of each wait.

    Returns:
        The layer's creation index on `group` (the same on every rank).

    Raises:
        local_error on the rank that had it; PeerError on the others.
        LayerMismatchError naming the differing fields (and each rank's value), on every rank.
        CollectiveTimeoutError if a peer does not build its layer within timeout_s.
    """
    index = _next_layer_index(group)
    fingerprint = layer_fingerprint(description)
    code = CODE_OK if local_error is None else _error_code(local_error)
    mine = torch.tensor([fingerprint, index, code], dtype=torch.int64).to(device)
    gathered = torch.empty(world_size * 3, dtype=torch.int64, device=device)
    work = dist.all_gather_into_tensor(gathered, mine, group=group, async_op=True)
    _bounded(work, device, timeout_s, f"rank {rank}: the construction check of layer #{index}", lambda reason: None)
    rows = gathered.view(world_size, 3).cpu().tolist()
    _raise_if_any_failed(group, rank, world_size, device, [row[2] for row in rows], local_error, timeout_s,
                         "building the MoE layer", f"layer #{index}'s construction", lambda reason: None)
    if any(row[:2] != rows[0][:2] for row in rows):
        texts = exchange_text(group, world_size, device, json.dumps({**description, "creation index": index}),
                              timeout_s, f"rank {rank}: the description exchange of layer #{index}")
        described = [json.loads(text) for text in texts]
        differences = []
        for field in described[rank]:
            values = [d.get(field) for d in described]
            if len(set(values)) > 1:
                differences.append(f"{field} differs (" + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                                   + ")")
        hint = (" (every rank must build the layers of a process group in the same order)"
                if differences and all(d.startswith("creation index") for d in differences) else "")
        raise LayerMismatchError(f"ranks disagree on the MoE layer being built: {'; '.join(differences)}{hint}")
    return index


def agree_no_errors(group, rank: int, world_size: int, device: torch.device, local_error: BaseException | None,
                    timeout_s: float, what: str, on_timeout: Callable[[str], None] = lambda reason: None) -> None:
    """One all-gather of an error code (and, only if one is set, of the messages): `local_error` raises on its rank
    and PeerError on the others, or nothing raises anywhere.

    The layer uses it after building its backend (a constructor that raised on one rank, e.g. out of memory or a bad
    option, instead of leaving the others to time out in the first call) and on a layer's first call (experts not
    loaded on one rank: backends whose calls carry no header, symm and deepep, could not tell the peers, whose tokens
    need this rank's experts). `what` names the step in the messages.
    """
    code = CODE_OK if local_error is None else _error_code(local_error)
    mine = torch.full((1,), code, dtype=torch.int64, device=device)
    gathered = torch.empty(world_size, dtype=torch.int64, device=device)
    work = dist.all_gather_into_tensor(gathered, mine, group=group, async_op=True)
    _bounded(work, device, timeout_s, f"rank {rank}: the check of {what}", on_timeout)
    _raise_if_any_failed(group, rank, world_size, device, gathered.cpu().tolist(), local_error, timeout_s, what,
                         what, on_timeout)


def _raise_if_any_failed(group, rank, world_size, device, codes: list[int], local_error, timeout_s, what: str,
                         step: str, on_timeout: Callable[[str], None]) -> None:
    """Every rank sees the same `codes`: if one is set, exchange the messages and raise on every rank."""
    if all(code == CODE_OK for code in codes):
        return
    texts = exchange_text(group, world_size, device, "" if local_error is None else _error_text(local_error),
                          timeout_s, f"rank {rank}: the error exchange of {step}", on_timeout)
    if local_error is not None:
        raise local_error
    failures = {r: texts[r] for r, code in enumerate(codes) if code != CODE_OK}
    raise PeerError(f"rank {rank}: {what} failed on another rank: "
                    + "; ".join(f"rank {r}: {m}" for r, m in failures.items()), failures)


class CallCoordinator:
    """One layer's per-call protocol on one rank: the header of its calls, the verdict after the first exchange,
    bounded waits, and the broken state. See the module docstring.

    Backends use it like this in `forward` (EP > 1):

        self.coordinator.check_usable()
        header = self.coordinator.header()          # HEADER_WORDS ints; put them into the first exchange
        ...first exchange, its wait through self.coordinator.wait(work, what, host=...)...
        self.coordinator.finish(headers)            # every rank's header, as received: raises on every rank
        ...the rest of the call...

    The layer calls `fail(error)` before it hands the backend T = 0 inputs for a call that this rank cannot make.

    Args:
        group, rank, world_size: the layer's process group.
        device: the device of the exchanged tensors (decides how waits are bounded: CPU = gloo, CUDA = NCCL).
        timeout_s: bound of every wait for the peers.
        fingerprint: `layer_fingerprint` of the layer's description.
        index: the layer's creation index on its group (`agree_on_layer`); 0 for a backend built alone.
    """

    def __init__(self, group, rank: int, world_size: int, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S,
                 fingerprint: int = 0, index: int = 0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.group, self.rank, self.world_size = group, rank, world_size
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.index = index
        digest = hashlib.blake2b(f"{fingerprint}/{index}".encode(), digest_size=4).digest()
        self.identity = int.from_bytes(digest, "little") & _WORD_MASK
        self.seq = 0  # calls of this layer that reached their first exchange, on this rank
        self.broken: str | None = None
        self._failure: BaseException | None = None

    # ---- state --------------------------------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise LayerBrokenError if an earlier wait timed out or a collective failed."""
        if self.broken is not None:
            raise LayerBrokenError(f"rank {self.rank}: this MoE layer is broken ({self.broken}); build a new process "
                                   f"group and layer")

    def mark_broken(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason

    def fail(self, error: BaseException) -> None:
        """This rank cannot make the current call: its first exchange carries an error code, `finish` raises `error`
        here and PeerError on the peers."""
        if self._failure is None:
            self._failure = error

    def take_failure(self) -> BaseException | None:
        """Clear and return the failure set by `fail` that no exchange consumed (backends without a per-call
        collective leave it for the layer to raise)."""
        failure, self._failure = self._failure, None
        return failure

    # ---- the header ---------------------------------------------------------------------------------------------
    def header(self) -> list[int]:
        """[identity, creation index, sequence number, error code] of this rank's current call (each < 2**31)."""
        code = CODE_OK if self._failure is None else _error_code(self._failure)
        return [self.identity, self.index & _WORD_MASK, self.seq & _WORD_MASK, code]

    def finish(self, headers: Sequence[Sequence[int]]) -> None:
        """The verdict of the call's first exchange, the same on every rank. `headers[r]` is rank r's header.

        Advances the sequence number (every rank's call took part in the exchange), then raises, on every rank
        alike: this rank's own failure (on that rank) / PeerError if a rank set an error code, CallOrderError if two
        ranks' [identity, index, sequence] differ. Returns normally only if the call may go on everywhere.
        """
        failure, self._failure = self._failure, None
        mine = self.header()[:3]
        self.seq += 1
        headers = [list(h) for h in headers]
        failed = [r for r, h in enumerate(headers) if h[3] != CODE_OK]
        if failed:
            # Every rank saw the same codes, so every rank takes part in this second exchange.
            texts = exchange_text(self.group, self.world_size, self.device,
                                  "" if failure is None else _error_text(failure), self.timeout_s,
                                  f"rank {self.rank}: the error exchange of layer #{self.index}, call {mine[2]}",
                                  self.mark_broken)
            if failure is not None:
                raise failure
            failures = {r: texts[r] or _CODE_NAMES.get(headers[r][3], f"code {headers[r][3]}") for r in failed}
            raise PeerError(f"rank {self.rank}: the MoE call was abandoned because another rank failed it: "
                            + "; ".join(f"rank {r}: {m}" for r, m in failures.items())
                            + ". This rank's input was not used; the layer goes on with the next call", failures)
        if failure is not None:  # a backend called finish without putting the code into its exchange
            raise failure
        mismatched = [r for r, h in enumerate(headers) if h[:3] != mine]
        if mismatched:
            seen = ", ".join(f"rank {r}: layer #{h[1]} (id {h[0]:#x}) call {h[2]}" for r, h in enumerate(headers))
            raise CallOrderError(
                f"rank {self.rank}: ranks met in one exchange with different layers or calls ({seen}); every rank "
                f"must call the MoE layers of a process group in the same order. No output was computed")

    # ---- bounded waits ------------------------------------------------------------------------------------------
    def wait(self, work, what: str, *, host: bool = True) -> None:
        """Wait for a collective started with async_op=True.

        host=True: return only once it completed, within timeout_s (polling on CUDA, `work.wait(timeout)` on CPU).
        host=False: on CUDA only order the current stream after it (no host wait: it is bounded at the next host=True
        wait or poll); on CPU the same as host=True (gloo collectives are host operations).
        Raises CollectiveTimeoutError / CollectiveError (and marks the layer broken).
        """
        if not host and self.device.type != "cpu":
            work.wait()
            return
        _bounded(work, self.device, self.timeout_s, f"rank {self.rank}: {what} (layer #{self.index}, call {self.seq})",
                 self.mark_broken)

    def poll(self, is_done: Callable[[], bool], what: str, timeout_s: float | None = None) -> None:
        """Wait until `is_done()` (e.g. a CUDA event's query) within timeout_s (default: the layer's), else mark the
        layer broken and raise CollectiveTimeoutError."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        if not _poll(is_done, time.monotonic() + limit):
            reason = f"rank {self.rank}: {what} (layer #{self.index}, call {self.seq}) did not complete within {limit:g} s"
            self.mark_broken(reason)
            raise CollectiveTimeoutError(
                f"{reason}: a peer rank died, stalled or never called this layer. The layer is now broken; destroy "
                f"the process group (or restart the processes) before going on")
