"""Failures across ranks end in a named error on every rank, in the same call, never in a hang or a wrong answer.

On gloo (CPU) at EP = 2 and 4, with the nccl backend (the backend with a per-call exchange that runs on the CPU; the
weave backend's cases are in the GPU validation suite, `python -m weave_moe.validate --failures`). Each EP size
spawns its ranks once and runs every case in them, in order (spawning costs seconds); the tests then read their
case's outcome per rank. The last case leaves the layer (and the process group) broken on purpose.

Cases: a local check fails on one rank (x dtype, T > max_tokens_per_rank, experts not loaded, an exception inside
the backend before its exchange) -> that rank's own error, PeerError on the others, then a correct call; ids out of
range (int64 ids >= 2**32 included) -> ValueError everywhere; two same-shaped layers called in a different order ->
CallOrderError everywhere, then correct calls in the same order; ranks that build different layers -> an error
naming the field everywhere; a construction argument or a backend constructor failing on one rank -> its error
there, PeerError elsewhere; a rank that never calls -> the others raise CollectiveTimeoutError (within timeout_s),
then LayerBrokenError; a rank whose process ended -> the others raise CollectiveError; inputs that require grad -> a
forward without autograd whose backward raises; the reference backend (no per-call collective) -> only the failing
rank raises.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from weave_moe.layer import ExpertParallelMoE
from weave_moe.models import MoESpec
from weave_moe.reference import DEFAULT_TOLERANCE, moe_error, reference_moe
from weave_moe.testing import make_experts, run_distributed

SPEC = MoESpec(8, 2, 32, 16)
MAX_TOKENS = 16
NEVER_CALLS_TIMEOUT_S = 3.0  # the layer's timeout_s in the "a rank never calls" case


def _outcome(call) -> str:
    """'ok' or 'ExceptionName: message' of call()."""
    try:
        call()
        return "ok"
    except Exception as error:  # noqa: BLE001 - the tests read the name and the message
        return f"{type(error).__name__}: {error}"


def _inputs(rank: int, call: int, num_tokens: int = 6):
    generator = torch.Generator().manual_seed(100 * rank + call)
    x = torch.randn(num_tokens, SPEC.hidden_size, generator=generator).to(torch.bfloat16)
    ids = torch.rand(num_tokens, SPEC.num_experts, generator=generator).argsort(1)[:, : SPEC.top_k].to(torch.int32)
    weights = torch.rand(num_tokens, SPEC.top_k, generator=generator)
    return x, ids, weights


def _layer(rank: int, world_size: int, seed: int, load: bool = True, **kwargs) -> ExpertParallelMoE:
    layer = ExpertParallelMoE(SPEC, backend="nccl", max_tokens_per_rank=MAX_TOKENS, device="cpu", **kwargs)
    if load:
        local = SPEC.num_experts // world_size
        layer.load_experts(*make_experts(SPEC, local, first_expert=rank * local, seed=seed))
    return layer


def _error_of_good_call(layer: ExpertParallelMoE, rank: int, seed: int, call: int) -> float:
    """Relative error of a valid call against the reference (the layer's experts were made with `seed`)."""
    x, ids, weights = _inputs(rank, call)
    out = layer(x, ids, weights)
    return moe_error(out, reference_moe(x, ids, weights, *make_experts(SPEC, seed=seed)))[0]


def _failure_cases(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    last = world_size - 1
    results: dict = {}

    # --- local checks that fail on one rank, then a correct call -------------------------------------------------
    layer = _layer(rank, world_size, seed=1)
    x, ids, weights = _inputs(rank, 0)
    bad_inputs = {
        "x-fp16": (x.half(), ids, weights),
        "too-many-tokens": _inputs(rank, 0, num_tokens=MAX_TOKENS + 1),
        "ids-int16": (x, ids.to(torch.int16), weights),
    }
    for name, bad in bad_inputs.items():
        results[name] = _outcome(lambda: layer(*(bad if rank == last else (x, ids, weights))))
        results[name + "/next"] = _error_of_good_call(layer, rank, seed=1, call=1)
    wrong_out = torch.empty(x.shape[0] + 1, SPEC.hidden_size, dtype=torch.bfloat16)
    results["out-shape"] = _outcome(lambda: layer(x, ids, weights, out=wrong_out if rank == last else None))
    results["out-shape/next"] = _error_of_good_call(layer, rank, seed=1, call=1)

    # an exception inside the backend before its exchange (here: a broken internal table on one rank)
    ranks_table = layer.backend._ranks
    if rank == 0:
        layer.backend._ranks = torch.zeros(world_size, 1, SPEC.top_k + 3, dtype=torch.int32)  # [EP, T, k] won't fit
    results["backend-raises"] = _outcome(lambda: layer(x, ids, weights))
    layer.backend._ranks = ranks_table
    results["backend-raises/next"] = _error_of_good_call(layer, rank, seed=1, call=2)

    # ids out of range, in their own dtype: 2**32 + 3 must not wrap to expert 3
    wide = ids.long()
    if rank == last:
        wide[2, 1] = 2**32 + 3
    results["ids-2**32+3"] = _outcome(lambda: layer(x, wide, weights))
    results["ids-2**32+3/next"] = _error_of_good_call(layer, rank, seed=1, call=3)

    # experts never loaded on one rank
    unloaded = _layer(rank, world_size, seed=2, load=rank != 0)
    results["not-loaded"] = _outcome(lambda: unloaded(x, ids, weights))
    if rank == 0:
        local = SPEC.num_experts // world_size
        unloaded.load_experts(*make_experts(SPEC, local, first_expert=0, seed=2))
    results["not-loaded/next"] = _error_of_good_call(unloaded, rank, seed=2, call=4)

    # --- two same-shaped layers called in a different order --------------------------------------------------------
    first, second = _layer(rank, world_size, seed=3), _layer(rank, world_size, seed=4)
    order = (first, second) if rank == 0 else (second, first)
    results["order"] = [_outcome(lambda: layer_(x, ids, weights)) for layer_ in order]
    results["order/next"] = [_error_of_good_call(first, rank, seed=3, call=5),
                             _error_of_good_call(second, rank, seed=4, call=6)]

    # --- construction: ranks that disagree ---------------------------------------------------------------------------
    def build(**kwargs):
        return lambda: ExpertParallelMoE(**{"spec": SPEC, "backend": "nccl", "max_tokens_per_rank": MAX_TOKENS,
                                            "device": "cpu", **kwargs})

    results["build-max-tokens"] = _outcome(build(max_tokens_per_rank=MAX_TOKENS + (rank == last)))
    results["build-spec"] = _outcome(build(spec=MoESpec(8, 2, 32, 16 + 8 * (rank == last))))
    results["build-backend"] = _outcome(build(backend="reference" if rank == last else "nccl"))
    # the weave kernels' protocol differs with the KernelConfig (e.g. pair_peers: the paired call at EP > 1 against
    # the call with task tables): checked before the backend is built (on the CPU here, where it would refuse)
    from weave_moe.backends.weave import KernelConfig

    results["build-kernel-config"] = _outcome(build(backend="weave", config=KernelConfig(pair_peers=rank == last)))
    results["build-invalid"] = _outcome(build(max_tokens_per_rank=0 if rank == last else MAX_TOKENS))
    results["build-bad-option"] = _outcome(build(**({"bogus_option": 1} if rank == last else {})))
    results["build-ok/next"] = _error_of_good_call(layer, rank, seed=1, call=7)

    # --- inputs that require grad ----------------------------------------------------------------------------------
    grad_x = x.clone().requires_grad_()
    out = layer(grad_x, ids, weights)
    results["grad-forward"] = (out.requires_grad, moe_error(out.detach(), reference_moe(
        x, ids, weights, *make_experts(SPEC, seed=1)))[0])
    results["grad-backward"] = _outcome(lambda: out.float().sum().backward())

    # --- the reference backend: a call has no collective, so a rank's bad input is its own affair ---------------------
    reference = ExpertParallelMoE(SPEC, backend="reference", max_tokens_per_rank=MAX_TOKENS, device="cpu")
    local = SPEC.num_experts // world_size
    reference.load_experts(*make_experts(SPEC, local, first_expert=rank * local, seed=1))
    results["reference-first"] = _error_of_good_call(reference, rank, seed=1, call=8)  # the checked first call
    results["reference-x-fp16"] = _outcome(lambda: reference(x.half() if rank == last else x, ids, weights))
    results["reference-x-fp16/next"] = _error_of_good_call(reference, rank, seed=1, call=8)

    # --- the last rank never calls: the others time out, then the layer is broken. Then it exits: the others' next
    # --- call, on a layer of another group (the default one holds the timed-out collective), meets a dead peer ----
    store = dist.distributed_c10d._get_default_store()
    spare = dist.new_group(backend="gloo")
    dying = ExpertParallelMoE(SPEC, group=spare, backend="nccl", max_tokens_per_rank=MAX_TOKENS, device="cpu")
    dying.load_experts(*make_experts(SPEC, local, first_expert=rank * local, seed=1))
    doomed = _layer(rank, world_size, seed=1)
    # One good call each (the first call of a layer has a check of its own), then the small timeout: set after the
    # construction and the first call, which a small timeout could trip on a loaded machine.
    results["never-calls/first"] = _error_of_good_call(doomed, rank, seed=1, call=9)
    results["peer-died/first"] = _error_of_good_call(dying, rank, seed=1, call=10)
    doomed.coordinator.timeout_s = dying.coordinator.timeout_s = NEVER_CALLS_TIMEOUT_S
    if rank == last:
        # Stay in the group (no collective, no exit) until every other rank has its verdict, then exit (the runner
        # destroys the process group and the process ends: its connections close).
        store.wait([f"never-calls/{r}" for r in range(last)], datetime.timedelta(seconds=60))
        results["never-calls"] = "did not call"
    else:
        start = time.monotonic()
        results["never-calls"] = _outcome(lambda: doomed(x, ids, weights))
        results["never-calls/seconds"] = time.monotonic() - start
        results["never-calls/next"] = _outcome(lambda: doomed(x, ids, weights))
        store.set(f"never-calls/{rank}", "done")
        start = time.monotonic()
        results["peer-died"] = _outcome(lambda: dying(x, ids, weights))
        results["peer-died/seconds"] = time.monotonic() - start
    return results


_RESULTS: dict[int, list[dict]] = {}


def _results(world_size: int) -> list[dict]:
    if world_size not in _RESULTS:
        _RESULTS[world_size] = run_distributed(_failure_cases, world_size, timeout_s=240)
    return _RESULTS[world_size]


EP_SIZES = [2, 4]


@pytest.mark.parametrize("world_size", EP_SIZES)
@pytest.mark.parametrize("case, own_error", [("x-fp16", "TypeError: x must be bfloat16, got torch.float16"),
                                              ("too-many-tokens", "ValueError: T=17 tokens exceeds max_tokens_per_rank"),
                                              ("ids-int16", "TypeError: topk_ids must be int32 or int64"),
                                              ("out-shape", "ValueError: out must have shape [T, hidden_size]"),
                                              ("not-loaded", "RuntimeError: forward called before load_experts")])
def test_local_failure_on_one_rank_raises_on_every_rank_then_the_layer_goes_on(world_size, case, own_error):
    results = _results(world_size)
    failing = 0 if case == "not-loaded" else world_size - 1
    for rank, result in enumerate(results):
        outcome = result[case]
        if rank == failing:
            assert outcome.startswith(own_error), (rank, outcome)
        else:
            assert outcome.startswith("PeerError") and f"rank {failing}: {own_error}" in outcome, (rank, outcome)
        assert result[case + "/next"] <= DEFAULT_TOLERANCE, (rank, result[case + "/next"])


@pytest.mark.parametrize("world_size", EP_SIZES)
def test_exception_in_the_backend_before_its_exchange_raises_on_every_rank(world_size):
    for rank, result in enumerate(_results(world_size)):
        outcome = result["backend-raises"]
        if rank == 0:
            assert outcome.startswith("RuntimeError"), outcome
        else:
            assert outcome.startswith("PeerError") and "rank 0: RuntimeError" in outcome, (rank, outcome)
        assert result["backend-raises/next"] <= DEFAULT_TOLERANCE


@pytest.mark.parametrize("world_size", EP_SIZES)
def test_int64_ids_beyond_int32_raise_on_every_rank(world_size):
    for rank, result in enumerate(_results(world_size)):
        outcome = result["ids-2**32+3"]
        assert outcome.startswith("ValueError: topk_ids must be in [-1, 8)"), (rank, outcome)
        assert f"on rank {world_size - 1}: 1" in outcome, (rank, outcome)
        assert result["ids-2**32+3/next"] <= DEFAULT_TOLERANCE


@pytest.mark.parametrize("world_size", EP_SIZES)
def test_layers_called_in_a_different_order_raise_on_every_rank(world_size):
    for rank, result in enumerate(_results(world_size)):
        for outcome in result["order"]:
            assert outcome.startswith("CallOrderError") and "same order" in outcome, (rank, outcome)
        assert max(result["order/next"]) <= DEFAULT_TOLERANCE, (rank, result["order/next"])


@pytest.mark.parametrize("world_size", EP_SIZES)
@pytest.mark.parametrize("case, field", [("build-max-tokens", "max_tokens_per_rank differs"),
                                          ("build-spec", "spec differs"), ("build-backend", "backend differs"),
                                          ("build-kernel-config", "kernel_config differs")])
def test_ranks_that_build_different_layers_raise_naming_the_field(world_size, case, field):
    results = _results(world_size)
    for rank, result in enumerate(results):
        outcome = result[case]
        assert outcome.startswith("LayerMismatchError") and field in outcome, (rank, outcome)
        assert f"rank {world_size - 1}:" in outcome, outcome
    assert all(result["build-ok/next"] <= DEFAULT_TOLERANCE for result in results)


@pytest.mark.parametrize("world_size", EP_SIZES)
def test_invalid_construction_argument_on_one_rank_raises_on_every_rank(world_size):
    for rank, result in enumerate(_results(world_size)):
        outcome = result["build-invalid"]
        if rank == world_size - 1:
            assert outcome.startswith("ValueError: max_tokens_per_rank must be a positive int"), outcome
        else:
            assert outcome.startswith("PeerError") and "max_tokens_per_rank must be a positive int" in outcome


@pytest.mark.parametrize("world_size", EP_SIZES)
def test_backend_constructor_failing_on_one_rank_raises_on_every_rank(world_size):
    for rank, result in enumerate(_results(world_size)):
        outcome = result["build-bad-option"]
        if rank == world_size - 1:
            assert outcome.startswith("TypeError: nccl backend: unknown options ['bogus_option']"), outcome
        else:
            assert outcome.startswith("PeerError") and "unknown options ['bogus_option']" in outcome, outcome


@pytest.mark.parametrize("world_size", EP_SIZES)
def test_a_rank_that_never_calls_makes_the_others_raise_within_timeout(world_size):
    for rank, result in enumerate(_results(world_size)[:-1]):
        assert result["never-calls"].startswith("CollectiveTimeoutError") and "timeout_s=3 s" in result["never-calls"]
        # Bounded by timeout_s, far from gloo's own 30 minutes; the slack covers a loaded CI machine.
        assert result["never-calls/seconds"] < NEVER_CALLS_TIMEOUT_S + 30
        assert result["never-calls/next"].startswith("LayerBrokenError"), result["never-calls/next"]
        assert "the count exchange" in result["never-calls"]  # the per-call exchange's wait, not the first call's


@pytest.mark.parametrize("world_size", EP_SIZES)
def test_a_peer_that_died_makes_the_others_raise_within_timeout(world_size):
    for rank, result in enumerate(_results(world_size)[:-1]):
        # Its closed connections end the wait at once (CollectiveError); if it is still exiting, the timeout does.
        assert result["peer-died"].startswith(("CollectiveError", "CollectiveTimeoutError")), result["peer-died"]
        assert result["peer-died/seconds"] < NEVER_CALLS_TIMEOUT_S + 30


@pytest.mark.parametrize("world_size", EP_SIZES)
def test_reference_backend_has_nothing_to_coordinate(world_size):
    for rank, result in enumerate(_results(world_size)):
        expected = "TypeError: x must be bfloat16" if rank == world_size - 1 else "ok"
        assert result["reference-x-fp16"].startswith(expected), result["reference-x-fp16"]
        assert result["reference-x-fp16/next"] == 0.0  # the reference backend IS reference_moe


@pytest.mark.parametrize("world_size", EP_SIZES)
def test_inputs_that_require_grad_run_without_autograd(world_size):
    for result in _results(world_size):
        requires_grad, error = result["grad-forward"]
        assert requires_grad and error <= DEFAULT_TOLERANCE
        assert result["grad-backward"].startswith("RuntimeError: ExpertParallelMoE is inference-only")


# ------------------------------------------------------------------------------------------------- EP = 1, in process
@pytest.mark.parametrize("backend", ["nccl", "reference"])
def test_int64_ids_are_checked_before_narrowing(backend):
    layer = ExpertParallelMoE(SPEC, backend=backend, max_tokens_per_rank=MAX_TOKENS, device="cpu")
    layer.load_experts(*make_experts(SPEC))
    x, ids, weights = _inputs(0, 0)
    wide = ids.long()
    wide[1, 0] = 2**32 + 3
    with pytest.raises(ValueError, match=r"topk_ids must be in \[-1, 8\).*4294967299"):
        layer(x, wide, weights)
    wide[1, 0] = -(2**32) - 1
    with pytest.raises(ValueError, match=r"topk_ids must be in \[-1, 8\)"):
        layer(x, wide, weights)


def test_unchecked_int64_ids_beyond_int32_are_never_a_valid_expert():
    """check_expert_ids=False gives undefined output for bad ids, but an id >= 2**32 is not narrowed onto a real
    expert: it is dropped like any other id >= E (the nccl backend at EP = 1)."""
    layer = ExpertParallelMoE(SPEC, backend="nccl", max_tokens_per_rank=MAX_TOKENS, device="cpu",
                              check_expert_ids=False)
    w13, w2 = make_experts(SPEC)
    layer.load_experts(w13, w2)
    x, ids, weights = _inputs(0, 0)
    wide = ids.long()
    wide[:, 1] = 2**32 + 3
    dropped = ids.clone()
    dropped[:, 1] = -1
    torch.testing.assert_close(layer(x, wide, weights), layer(x, dropped, weights), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["nccl", "reference"])
def test_requires_grad_forward_works_and_backward_raises(backend):
    layer = ExpertParallelMoE(SPEC, backend=backend, max_tokens_per_rank=MAX_TOKENS, device="cpu")
    w13, w2 = make_experts(SPEC)
    layer.load_experts(w13, w2)
    x, ids, weights = _inputs(0, 0)
    out = layer(x.clone().requires_grad_(), ids, weights.clone().requires_grad_())
    assert out.requires_grad
    assert moe_error(out.detach(), reference_moe(x, ids, weights, w13, w2))[0] <= DEFAULT_TOLERANCE
    with pytest.raises(RuntimeError, match="inference-only"):
        out.float().sum().backward()
    with torch.inference_mode():
        assert not layer(x, ids, weights).requires_grad


@pytest.mark.parametrize("backend", ["nccl", "reference"])
def test_parameter_experts_record_no_autograd_history(backend):
    """Experts loaded from nn.Parameters (requires_grad) and inputs that need no grad, with grad mode on (a model's
    default): the call takes the layer's path without a no_grad() guard, so the weights must have been detached at
    load; the output carries no autograd history and is correct."""
    layer = ExpertParallelMoE(SPEC, backend=backend, max_tokens_per_rank=MAX_TOKENS, device="cpu")
    w13, w2 = make_experts(SPEC)
    layer.load_experts(torch.nn.Parameter(w13), torch.nn.Parameter(w2))
    x, ids, weights = _inputs(0, 0)
    assert torch.is_grad_enabled()
    out = layer(x, ids, weights)
    assert not out.requires_grad and out.grad_fn is None
    assert moe_error(out, reference_moe(x, ids, weights, w13, w2))[0] <= DEFAULT_TOLERANCE


@pytest.mark.parametrize("backend", ["nccl", "reference"])
def test_out_receives_the_result_and_bad_out_is_refused(backend):
    """forward(..., out=buf): the result lands in buf (poisoned first, so an unwritten row fails) and buf is
    returned, call after call; an out that cannot hold it is refused with its reason."""
    layer = ExpertParallelMoE(SPEC, backend=backend, max_tokens_per_rank=MAX_TOKENS, device="cpu")
    w13, w2 = make_experts(SPEC)
    layer.load_experts(w13, w2)
    buf = torch.empty(6, SPEC.hidden_size, dtype=torch.bfloat16)
    for call in range(3):
        x, ids, weights = _inputs(0, call)
        buf.fill_(float("nan"))
        assert layer(x, ids, weights, out=buf) is buf
        assert moe_error(buf, reference_moe(x, ids, weights, w13, w2))[0] <= DEFAULT_TOLERANCE
    x, ids, weights = _inputs(0, 0)
    for bad, message in [(torch.empty(5, SPEC.hidden_size, dtype=torch.bfloat16), "out must have shape"),
                         (torch.empty(6, SPEC.hidden_size), "out must be bfloat16"),
                         (torch.empty(SPEC.hidden_size, 6, dtype=torch.bfloat16).t(), "out must be contiguous"),
                         (x, "out must not share memory with x"),
                         ("not a tensor", "out must be a torch.Tensor")]:
        with pytest.raises((TypeError, ValueError), match=message):
            layer(x, ids, weights, out=bad)
    grad_x = x.clone().requires_grad_()
    result = layer(grad_x, ids, weights, out=buf)   # the autograd guard returns an alias of buf
    assert result.requires_grad and result.data_ptr() == buf.data_ptr()


def test_input_checks_are_not_skipped_by_the_accepted_signature():
    """The layer skips the layout checks for inputs shaped like the last accepted ones (`_check_inputs`): every bad
    input after a good call still raises its own error, the ids' values are checked on every call, and the good
    call after each refusal runs."""
    layer = ExpertParallelMoE(SPEC, backend="reference", max_tokens_per_rank=MAX_TOKENS, device="cpu")
    w13, w2 = make_experts(SPEC)
    layer.load_experts(w13, w2)
    x, ids, weights = _inputs(0, 0)
    bad_ids = ids.clone()
    bad_ids[0, 0] = SPEC.num_experts
    big = _inputs(0, 0, num_tokens=MAX_TOKENS + 1)
    for bad, error, message in [((x.half(), ids, weights), TypeError, "x must be bfloat16"),
                                ((x, ids[:, :1], weights), ValueError, "topk_ids must have shape"),
                                ((x, ids, weights.double()), TypeError, "topk_weights must be float32"),
                                (big, ValueError, "exceeds max_tokens_per_rank"),
                                ((x, bad_ids, weights), ValueError, r"topk_ids must be in \[-1, "),
                                (("x", ids, weights), TypeError, "x must be a torch.Tensor"),
                                ((torch.nn.Parameter(x, requires_grad=False), ids, weights), None, None)]:
        layer(x, ids, weights)   # accepted: its signature is the cached one
        if error is None:
            assert moe_error(layer(*bad), reference_moe(x, ids, weights, w13, w2))[0] <= DEFAULT_TOLERANCE
            continue
        with pytest.raises(error, match=message):
            layer(*bad)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        ExpertParallelMoE(SPEC, backend="nccl", device="cpu", timeout_s=0)


def test_weave_counts_vector_carries_every_rank_header():
    """The weave backend's routing message ends with the call header, and the counts vector brings every rank's
    header to the host with the counts (its one host copy): pack -> gather -> build -> parse, on the CPU."""
    from weave_moe.backends.coordination import HEADER_WORDS
    from weave_moe.backends.weave.exchange import CountsFormat, RoutingMessage

    world_size, max_tokens, status = 2, 4, torch.tensor([0, 0, 0, 0], dtype=torch.int32)
    message = RoutingMessage(max_tokens, SPEC.top_k)
    counts_format = CountsFormat(world_size, SPEC.num_experts, status.numel())
    gathered = torch.empty(world_size, message.words, dtype=torch.int32)
    headers = [[0x5EED, 2, 7, 0], [0x5EED, 2, 7, 1]]  # rank 1 reports an error code
    for rank, num_tokens in enumerate((3, 0)):
        _, ids, weights = _inputs(rank, 0, num_tokens)
        if rank == 0:
            ids[0, 0] = SPEC.num_experts  # one bad id on rank 0
        message.pack(gathered[rank], ids, weights, message.pad(), torch.arange(max_tokens + 1, dtype=torch.int32),
                     torch.tensor(headers[rank], dtype=torch.int32))
    flat = counts_format.build(gathered, message, status).tolist()
    counts, bad_ids, got_headers, got_status = counts_format.parse(flat)
    assert len(got_headers[0]) == HEADER_WORDS and got_headers == headers
    assert bad_ids == [1, 0] and got_status == [0, 0, 0, 0] and counts.num_tokens == [3, 0]


def _validate_failures_on_gloo(rank: int, world_size: int) -> list[dict]:
    import torch.distributed as dist

    from weave_moe.validate import _failures

    return _failures(rank, world_size, dist.group.WORLD if world_size > 1 else None, torch.device("cpu"), "nccl")


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_gpu_suite_failure_cases_pass_with_the_nccl_backend_on_gloo(world_size):
    """`python -m weave_moe.validate --failures` runs these cases for weave and nccl on GPUs; here its code runs on
    the CPU with the nccl backend, so the suite cannot rot between GPU runs."""
    rows = [row for per_rank in run_distributed(_validate_failures_on_gloo, world_size, timeout_s=240)
            for row in per_rank]
    assert rows and all(row["passed"] for row in rows), [row for row in rows if not row["passed"]]
    expected_cases = 4 if world_size == 1 else 8
    assert len(rows) == expected_cases * world_size
