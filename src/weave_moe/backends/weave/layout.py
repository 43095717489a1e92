"""Routing -> the megakernel's task tables, computed with torch on the layer's device, with no host sync.

Every rank gathers every rank's top-k ids (a tiny all-gather), so every rank can compute the same global layout and
needs to send only activations over NVLink: a source knows where its rows land in each destination's receive buffer,
and a destination knows which rows it will receive, in which chunk, for which local expert.

Shape legend: EP ranks, T_max = max_tokens_per_rank, k = top_k, E_local = experts per rank, H hidden, I intermediate.

Buffers this layout indexes (owned by the weave backend):
- recv_x [EP * T_max, H] bf16 on each rank: source s writes its rows for this rank at [s * T_max + slot]. A token goes
  ONCE to each rank that hosts any of its experts (dedup); `slot` is the token's position in the source's list for
  that destination (tokens in increasing index order).
- h [pairs, I] and y [pairs, H]: one row per (token, local expert) pair, sorted by (chunk, expert, source, token), so
  each (chunk, expert) is one contiguous segment cut into BLOCK_M-row tiles.
- comb [EP * T_max, H] bf16 on each source rank: destination d writes the weighted sum over its local experts of
  token t at [d * T_max + t]; the source sums the rows of the destinations its token went to.

Chunks: destination r splits the rows it receives from source s into K_r chunks by the source's token index,
chunk(t) = t * K_r // T_s. Sources send in (destination, token) order, so chunk 0 arrives first everywhere.

Task tables have static shapes (upper bounds from EP, T_max, k, E), and the true number of tasks of each kind lives in
`meta` on the device, so nothing here waits for the GPU and the whole build can be one CUDA-graph replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weave_moe.backends.weave.exchange import hit_matrix, static_bincount
from weave_moe.plan.workload import MAX_CHUNKS

__all__ = ["Layout", "build_layout", "META_FIELDS"]

#: Order of the int32 `meta` vector that the kernel reads at start.
META_FIELDS = ("num_dispatch_tasks", "num_gemm_tasks", "num_combine_tasks", "num_reduce_tasks", "num_mtiles")

# Column order of the task tables (int32).
DISPATCH_COLUMNS = ("dest", "chunk", "start", "count")
GEMM_COLUMNS = ("kind", "chunk", "expert", "row_start", "num_rows", "n_start", "mtile", "pad")
COMBINE_COLUMNS = ("source", "chunk", "start", "count")


@dataclass
class Layout:
    """Task tables of one rank for one call. All tensors live on the layer's device; int32 unless noted."""

    meta: torch.Tensor                 # [len(META_FIELDS)] true task counts
    # dispatch (this rank as source)
    dispatch_tasks: torch.Tensor       # [max_dispatch_tasks, 4] DISPATCH_COLUMNS; count 0 = padding
    send_token: torch.Tensor           # [rows sent] local token index
    send_slot: torch.Tensor            # [rows sent] slot in the destination's region for this rank
    # expert GEMMs (this rank as destination)
    gather_rows: torch.Tensor          # [pairs] recv_x row of each sorted pair
    gemm_tasks: torch.Tensor           # [max_gemm_tasks, 8] GEMM_COLUMNS, in DAG order
    arrival_expected: torch.Tensor     # [EP, MAX_CHUNKS] rows expected from each source per chunk
    gemm1_expected: torch.Tensor       # [MAX_CHUNKS] GEMM1 tiles per chunk
    num_mtiles_bound: int              # rows of the per-M-tile GEMM0 completion counters needed
    # combine (this rank as destination, writing back to sources)
    combine_tasks: torch.Tensor        # [max_combine_tasks, 4] COMBINE_COLUMNS
    combine_token: torch.Tensor        # [received rows] token index on its source rank
    combine_pos: torch.Tensor          # [received rows, k] sorted pair position per top-k slot, -1 = not here
    combine_weight: torch.Tensor       # [received rows, k] fp32 top-k weight (0 where pos is -1)
    # final reduce (this rank as source)
    token_dest_mask: torch.Tensor      # [T_max] bit d set = token went to rank d
    combine_expected: torch.Tensor     # [EP] rows each destination writes back to this rank
    max_pairs: int                     # rows of h / y the tables may address
    expert_offsets: torch.Tensor       # [E_local + 1] prefix sum of chunk 0's rows per local expert (all rows if K = 1)


def _segment_blocks(counts: torch.Tensor, block: int, max_tasks: int):
    """Cut contiguous segments (sizes `counts` [S]) into blocks of at most `block` rows, statically shaped.

    Returns (segment, start, length, total) with [max_tasks] entries; entries past `total` (a device scalar) have
    length 0. Segments are laid out back to back in index order.
    """
    counts = counts.long()
    num_blocks = (counts + block - 1) // block
    block_end = torch.cumsum(num_blocks, 0)
    block_begin = block_end - num_blocks
    segment_begin = torch.cumsum(counts, 0) - counts
    total = block_end[-1]
    j = torch.arange(max_tasks, device=counts.device)
    segment = torch.searchsorted(block_end, j, right=True).clamp_(max=counts.numel() - 1)
    within = j - block_begin[segment]
    start = segment_begin[segment] + within * block
    length = (counts[segment] - within * block).clamp(0, block)
    length = torch.where(j < total, length, torch.zeros_like(length))
    return segment, start, length, total


def build_layout(
    all_ids: torch.Tensor,
    all_weights: torch.Tensor,
    tokens: torch.Tensor,
    chunks: torch.Tensor,
    rank: int,
    num_experts: int,
    *,
    hidden_size: int,
    intermediate_size: int,
    block_m: int,
    block_n0: int,
    block_n1: int,
    dispatch_rows: int,
    combine_rows: int,
    reduce_rows: int,
    hit: torch.Tensor | None = None,
) -> Layout:
    """The task tables of `rank`, with shapes that depend only on (EP, T_max, k, E) and the block sizes.

    Static shapes and device-only inputs mean the whole function can be captured once in a CUDA graph and replayed
    every call (the weave backend does): ~150 small torch ops cost milliseconds of host time when launched one by
    one, and one replay costs microseconds. Lists are cut to static upper bounds with `nonzero_static`; padding
    entries carry keys that sort after every real entry and count into a trash bin that is dropped.

    Args:
        all_ids: [EP, T_max, k] int32 gathered top-k ids (-1 = none, and padding past each rank's tokens).
        all_weights: [EP, T_max, k] fp32 gathered top-k weights.
        tokens: [EP] int tokens on each rank (device).
        chunks: [EP] int chunk count K_d of each rank's plan, in [1, MAX_CHUNKS] (device); every rank needs every
            destination's K to send in that destination's chunk order.
        rank: this rank.
        num_experts: E (global).
        hit: `hit_matrix(all_ids, E_local)` if the caller already has it.
    """
    device = all_ids.device
    world_size, max_tokens, top_k = all_ids.shape
    num_local_experts = num_experts // world_size
    ids = all_ids.long()
    if hit is None:
        hit = hit_matrix(all_ids, num_local_experts)                            # [EP, T_max, EP]
    # scan along the contiguous last dimension (an outer-dimension scan is ~100x slower on CUDA)
    slot = (torch.cumsum(hit.permute(0, 2, 1).to(torch.int32), dim=2) - 1).permute(0, 2, 1)  # [EP, T_max, EP]
    tokens_dev = tokens.long().clamp(min=1)
    chunks_dev = chunks.long()
    my_chunks = chunks_dev[rank]
    int32 = dict(dtype=torch.int32)
    ep_tokens = world_size * max_tokens

    # ---- dispatch: this rank's rows in (destination, token) order = (destination, chunk, token) order
    max_send = ep_tokens
    flat = torch.nonzero_static(hit[rank].T.reshape(-1), size=max_send, fill_value=ep_tokens).flatten()
    valid = flat < ep_tokens
    dest = (flat // max_tokens).clamp(max=world_size - 1)
    token = flat % max_tokens
    send_slot = slot[rank, token, dest]
    send_chunk = token * chunks_dev[dest] // tokens_dev[rank]
    trash = world_size * MAX_CHUNKS
    key_counts = static_bincount(torch.where(valid, dest * MAX_CHUNKS + send_chunk, trash), trash + 1)[:trash]
    max_dispatch = max_send // dispatch_rows + world_size * MAX_CHUNKS + 1
    seg, start, length, num_dispatch = _segment_blocks(key_counts, dispatch_rows, max_dispatch)
    dispatch_tasks = torch.stack([seg // MAX_CHUNKS, seg % MAX_CHUNKS, start, length], 1).to(**int32)

    # ---- expert pairs received by this rank, sorted by (chunk, expert, source, token); padding sorts last
    max_pairs = ep_tokens * min(top_k, num_local_experts)
    pair_space = ep_tokens * top_k
    mine = (ids >= rank * num_local_experts) & (ids < (rank + 1) * num_local_experts)
    pair_flat = torch.nonzero_static(mine.reshape(-1), size=max_pairs, fill_value=pair_space).flatten()
    pair_valid = pair_flat < pair_space
    pair_source = (pair_flat // (max_tokens * top_k)).clamp(max=world_size - 1)
    pair_token = (pair_flat // top_k) % max_tokens
    pair_expert = (ids.reshape(-1)[pair_flat.clamp(max=pair_space - 1)] - rank * num_local_experts).clamp(0, num_local_experts - 1)
    pair_chunk = pair_token * my_chunks // tokens_dev[pair_source]
    recv_row = pair_source * max_tokens + slot[pair_source, pair_token, rank]
    sort_key = ((pair_chunk * num_local_experts + pair_expert) * world_size + pair_source) * max_tokens + pair_token
    sort_key = torch.where(pair_valid, sort_key, MAX_CHUNKS * num_local_experts * ep_tokens)
    order = _argsort(sort_key, MAX_CHUNKS * num_local_experts * ep_tokens)
    gather_rows = recv_row[order].to(**int32)
    pair_pos = torch.empty_like(order)
    pair_pos[order] = torch.arange(max_pairs, device=device)

    # M tiles: one segment per (chunk, expert)
    trash = MAX_CHUNKS * num_local_experts
    segment_key = torch.where(pair_valid, pair_chunk * num_local_experts + pair_expert, trash)
    segment_rows = static_bincount(segment_key, trash + 1)[:trash]
    # rows of chunk 0 per local expert, as a prefix sum: with one chunk (K = 1) every expert's rows are contiguous
    expert_offsets = torch.cat([segment_rows.new_zeros(1), torch.cumsum(segment_rows[:num_local_experts], 0)])
    max_mtiles = max_pairs // block_m + MAX_CHUNKS * num_local_experts + 1
    seg, m_start, m_rows, num_mtiles = _segment_blocks(segment_rows, block_m, max_mtiles)
    m_chunk, m_expert = seg // num_local_experts, seg % num_local_experts
    n0 = -(-intermediate_size // block_n0)
    n1 = -(-hidden_size // block_n1)
    mtile = torch.arange(max_mtiles, device=device)
    valid = mtile < num_mtiles
    # DAG order: GEMM0(c) gets rank 2c, GEMM1(c) 2c+3, so GEMM1 of chunk c is queued after GEMM0 of chunk c+1 and
    # rarely waits; padding (invalid M tiles) sorts last.
    big = 4 * MAX_CHUNKS + 8
    rank0 = torch.where(valid, 2 * m_chunk, big)
    rank1 = torch.where(valid, 2 * m_chunk + 3, big)
    num_n = max(n0, n1)
    gemm0, key0 = _tile_rows(0, m_chunk, m_expert, m_start, m_rows, mtile, n0, block_n0, rank0, num_n)
    gemm1, key1 = _tile_rows(1, m_chunk, m_expert, m_start, m_rows, mtile, n1, block_n1, rank1, num_n)
    gemm_order = _argsort(torch.cat([key0, key1]), (big + 1) * max_mtiles * num_n)
    gemm_tasks = torch.cat([gemm0, gemm1], 0)[gemm_order].to(**int32)
    num_gemm = num_mtiles * (n0 + n1)
    gemm1_expected = static_bincount(torch.where(valid, m_chunk, MAX_CHUNKS), MAX_CHUNKS + 1)[:MAX_CHUNKS]
    gemm1_expected = (gemm1_expected * n1).to(**int32)

    # rows each source sends to this rank, per chunk of this rank
    hit_me = hit[:, :, rank]                                            # [EP, T_max]
    token_idx = torch.arange(max_tokens, device=device)
    chunk_of = token_idx[None, :] * my_chunks // tokens_dev[:, None]      # [EP, T_max]
    arrival_expected = torch.zeros(world_size, MAX_CHUNKS, dtype=torch.long, device=device)
    arrival_expected.scatter_add_(1, chunk_of.clamp(max=MAX_CHUNKS - 1), hit_me.long())
    arrival_expected = arrival_expected.to(**int32)

    # ---- combine: received tokens in (chunk, source, token) order; padding sorts last
    flat = torch.nonzero_static(hit_me.reshape(-1), size=ep_tokens, fill_value=ep_tokens).flatten()
    recv_valid = flat < ep_tokens
    recv_source = (flat // max_tokens).clamp(max=world_size - 1)
    recv_token = flat % max_tokens
    recv_chunk = recv_token * my_chunks // tokens_dev[recv_source]
    recv_key = torch.where(recv_valid, (recv_chunk * world_size + recv_source) * max_tokens + recv_token,
                           MAX_CHUNKS * ep_tokens)
    order = _argsort(recv_key, MAX_CHUNKS * ep_tokens)
    recv_source, recv_token, recv_chunk = recv_source[order], recv_token[order], recv_chunk[order]
    recv_valid = recv_valid[order]
    pos_full = torch.full((pair_space + 1,), -1, dtype=torch.long, device=device)
    pos_full[pair_flat] = torch.where(pair_valid, pair_pos, -1)       # padding lands in the trash slot at the end
    pos_full = pos_full[:pair_space].view(ep_tokens, top_k)
    combine_pos = pos_full[recv_source * max_tokens + recv_token]
    combine_weight = torch.where(combine_pos >= 0, all_weights[recv_source, recv_token].float(), 0.0)
    trash = MAX_CHUNKS * world_size
    combine_key = torch.where(recv_valid, recv_chunk * world_size + recv_source, trash)
    combine_counts = static_bincount(combine_key, trash + 1)[:trash]
    max_combine = ep_tokens // combine_rows + MAX_CHUNKS * world_size + 1
    seg, c_start, c_rows, num_combine = _segment_blocks(combine_counts, combine_rows, max_combine)
    combine_tasks = torch.stack([seg % world_size, seg // world_size, c_start, c_rows], 1).to(**int32)

    # ---- final reduce on this rank (as source)
    bits = (hit[rank].long() << torch.arange(world_size, device=device)).sum(1)
    combine_expected = hit[rank].sum(0, dtype=torch.int32)
    num_reduce = (tokens[rank].long() + reduce_rows - 1) // reduce_rows

    meta = torch.stack([num_dispatch, num_gemm, num_combine, num_reduce, num_mtiles]).to(**int32)
    return Layout(
        meta=meta,
        dispatch_tasks=dispatch_tasks,
        send_token=token.to(**int32),
        send_slot=send_slot.to(**int32),
        gather_rows=gather_rows,
        gemm_tasks=gemm_tasks,
        arrival_expected=arrival_expected,
        gemm1_expected=gemm1_expected,
        num_mtiles_bound=max_mtiles,
        combine_tasks=combine_tasks,
        combine_token=recv_token.to(**int32),
        combine_pos=combine_pos.to(**int32),
        combine_weight=combine_weight.contiguous(),
        token_dest_mask=bits.to(**int32),
        combine_expected=combine_expected,
        max_pairs=max_pairs,
        expert_offsets=expert_offsets.to(**int32),
    )


def _argsort(key: torch.Tensor, bound: int) -> torch.Tensor:
    """argsort of non-negative keys <= `bound`, in 32 bits when they fit. CUDA sorts by radix, one pass per key byte:
    int64 keys cost 8 passes where these bounds (tens of millions) need 4; the three sorts of a layout were ~40% of its
    GPU time in the H200 profile (bench/results/ab/profile-compile_layout_1.txt). Stable, so padding entries (equal
    keys) keep their order on every device and in compiled and eager tables alike."""
    if bound < 2**31:
        key = key.to(torch.int32)
    return torch.argsort(key, stable=True)


def _tile_rows(kind, m_chunk, m_expert, m_start, m_rows, mtile, num_n, block_n, dag_rank, num_n_max):
    """GEMM tasks of one kind: [max_mtiles * num_n, 8] rows of GEMM_COLUMNS and their DAG sort keys."""
    n = torch.arange(num_n, device=m_chunk.device)

    def rep(v):
        return v[:, None].expand(-1, num_n).reshape(-1)

    n_index = n[None, :].expand(m_chunk.numel(), -1).reshape(-1)
    rows = torch.stack([
        torch.full_like(rep(m_chunk), kind), rep(m_chunk), rep(m_expert), rep(m_start), rep(m_rows),
        n_index * block_n, rep(mtile), torch.zeros_like(n_index),
    ], 1)
    key = (rep(dag_rank) * mtile.numel() + rep(mtile)) * num_n_max + n_index
    return rows, key
