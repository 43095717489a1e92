"""weave_moe.backends"""


def raise_on_bad_ids(bad_per_rank, num_experts: int) -> None:
    """Raise ValueError if any rank's count of expert ids outside [-1, E) is non-zero.

    Backends that exchange per-rank counts anyway (nccl's count all-to-all, weave's gathered counts) carry this count
    with them and call this on every rank after the exchange, so every rank raises in the same call and no peer is
    left waiting in a collective.
    """
    if any(bad_per_rank):
        where = ", ".join(f"rank {r}: {n}" for r, n in enumerate(bad_per_rank) if n)
        raise ValueError(f"topk_ids must be in [-1, {num_experts}) (-1 = no expert); ids out of range on {where}")
