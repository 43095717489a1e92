"""Helpers shared by the tests, the demo and the bench harness: multi-process runs and random experts.

`run_distributed(fn, world_size, ...)` spawns one process per rank, initialises a process group (gloo on CPU, NCCL on
GPUs) on a free local port, calls `fn(rank, world_size, *args)` in each and returns the per-rank results. A rank that
raises fails the whole run with every rank's traceback; a run that outlives `timeout_s` (a hang in a collective) is
killed and raises TimeoutError, so a deadlock fails a test instead of stalling CI.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch

__all__ = ["run_distributed", "free_port", "make_experts", "DistributedError"]


class DistributedError(RuntimeError):
    """One or more ranks of a `run_distributed` call raised; the message holds their tracebacks."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _to_bytes(value: Any) -> bytes:
    # torch.save instead of pickling through the queue: tensors then travel as plain bytes, with no shared-memory file
    # descriptors that die with the child process.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _worker(rank, world_size, port, backend, shared_device, fn, args, env, results) -> None:
    # a rank that dies of a signal (SIGSEGV in a native library) prints its Python stacks first: otherwise the parent
    # only sees "ranks died without reporting"
    faulthandler.enable(all_threads=True)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist

    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if shared_device:  # CPU buffers then share through files whose handles pickle (CUDA IPC handles always do)
            torch.multiprocessing.set_sharing_strategy("file_system")
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", rank) if backend == "nccl" else None)
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", _to_bytes(value)))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt in a child
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group must not hide the real error
                pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    shared_device: bool = False,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks and return their results, rank order.

    Args:
        fn: a module-level function (it is pickled by name for `spawn`). Its return value must be torch.save-able.
        world_size: number of ranks (processes).
        backend: "gloo" (CPU) or "nccl" (rank r uses cuda:r).
        timeout_s: wall-clock limit for the whole run; past it every rank is killed and TimeoutError is raised.
        env: extra environment variables for the ranks.
        shared_device: every rank on ONE device (the caller's `fn` picks it: cuda:0, or the CPU): a gloo group, and
            the weave workspace's "ipc" transport (WEAVE_MOE_TRANSPORT=ipc), through which the ranks open each
            other's buffers (PyTorch's symmetric memory refuses ranks that share a device).

    Raises:
        DistributedError: a rank raised (message: every failing rank's traceback) or died without reporting.
        TimeoutError: the ranks did not finish within `timeout_s` (typically a collective that hangs).
    """
    import torch.multiprocessing as mp

    if shared_device:
        if backend != "gloo":
            raise ValueError(f"shared_device=True runs over a gloo group, got backend={backend!r}")
        env = {**(env or {}), "WEAVE_MOE_TRANSPORT": "ipc"}
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, backend, shared_device, fn, args,
                                              dict(env or {}), results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s"
                                   + _format_errors(outcomes))
            try:
                rank, status, payload = results.get(timeout=min(remaining, 0.5))
                outcomes[rank] = (status, payload)
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if r not in outcomes and p.exitcode is not None]
                if dead:
                    # Give a dying rank's last message a moment to arrive before declaring it lost.
                    try:
                        rank, status, payload = results.get(timeout=2.0)
                        outcomes[rank] = (status, payload)
                        continue
                    except queue.Empty:
                        pass
                    codes = {r: processes[r].exitcode for r in dead}
                    raise DistributedError(f"ranks died without reporting (exit codes {codes})"
                                           + _format_errors(outcomes))
                if any(status == "error" for status, _ in outcomes.values()):
                    # A failed rank usually leaves its peers blocked in a collective: do not wait for the timeout.
                    time.sleep(1.0)
                    _drain(results, outcomes)
                    break
    finally:
        for process in processes:
            process.join(timeout=5.0 if len(outcomes) == world_size else 0.1)
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    if any(status == "error" for status, _ in outcomes.values()):
        raise DistributedError("a rank raised" + _format_errors(outcomes))
    return [torch.load(io.BytesIO(outcomes[rank][1]), weights_only=False) for rank in range(world_size)]


def _drain(results, outcomes) -> None:
    while True:
        try:
            rank, status, payload = results.get_nowait()
        except queue.Empty:
            return
        outcomes[rank] = (status, payload)


def _format_errors(outcomes: dict[int, tuple[str, Any]]) -> str:
    return "".join(f"\n--- rank {rank} ---\n{payload}" for rank, (status, payload) in sorted(outcomes.items())
                   if status == "error")


def make_experts(
    spec_or_dims,
    num_experts: int | None = None,
    *,
    first_expert: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random expert weights scaled so that a layer's output is O(1) for x ~ N(0, 1).

    Expert `e` is drawn from its own generator seeded with (seed, e), so the slice a rank makes for its experts
    (`first_expert=r*E_local, num_experts=E_local`) equals the same rows of the full set made in one call: tests
    build the global weights for the reference and the local ones for the backend independently. Values depend on the
    device's generator (CPU and CUDA draw different numbers for the same seed).

    Args:
        spec_or_dims: a MoESpec, or (hidden_size, intermediate_size).
        num_experts: experts to make (E_local or E); defaults to spec.num_experts.
        first_expert: global id of the first expert made.
        seed: base seed.
        device, dtype: of the returned weights.

    Returns:
        w13 [num_experts, 2*I, H] with std 1/sqrt(H) (so gate and up are ~N(0, 1)),
        w2 [num_experts, H, I] with std 1/sqrt(I).
    """
    if isinstance(spec_or_dims, (tuple, list)):
        hidden_size, intermediate_size = spec_or_dims
        default_experts = None
    else:
        hidden_size, intermediate_size = spec_or_dims.hidden_size, spec_or_dims.intermediate_size
        default_experts = spec_or_dims.num_experts
    num_experts = num_experts if num_experts is not None else default_experts
    if num_experts is None:
        raise ValueError("make_experts: give num_experts when passing (hidden_size, intermediate_size)")
    device = torch.device(device)
    w13 = torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device)
    w2 = torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device)
    generator = torch.Generator(device=device)
    for local, expert in enumerate(range(first_expert, first_expert + num_experts)):
        generator.manual_seed(seed * 1_000_003 + expert)
        w13[local] = torch.randn(w13.shape[1:], generator=generator, device=device) / hidden_size**0.5
        w2[local] = torch.randn(w2.shape[1:], generator=generator, device=device) / intermediate_size**0.5
    return w13, w2

