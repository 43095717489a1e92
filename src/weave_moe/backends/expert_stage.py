"""The expert stage shared by the all-to-all baselines (nccl, symm, deepep): rows in, weighted expert sums out.

Given the rows a rank received and the local expert ids of their k slots, `GroupedExperts.run` computes, per row r,

    out[r] = sum_j w[r, j] * W2[e] @ (silu(Wg[e] @ x[r]) * (Wu[e] @ x[r])),   e = ids[r, j] >= 0 (local expert id)

in five steps, all without a host sync and without per-call buffer allocation (buffers are sized once):
  1. group (row, slot) pairs by expert: one stable sort of uint8 keys (-1 -> 255 sorts last), group ends by
     searchsorted (int32, what `torch._grouped_mm` takes as `offs`), and each pair's sorted position (a scatter);
  2. permute: one gather of the bf16 rows in pair order (`gather_rows`);
  3. GEMM0 -> SiLU-mul -> GEMM1: `torch._grouped_mm` twice, `silu_mul` between them (bf16 in, fp32 math, bf16 out);
  4. un-permute + weighted sum: `gather_weighted_sum` reads each row's k pair results by their sorted positions,
     multiplies by the routing weights and sums in fp32, writing bf16 (no fp32 [P, H] temporary, no atomics).
The pair count need not be known on the host: the kernels read it from the last group end on the device and skip
pairs past it, so a caller without a host-side count (EP=1, symm) passes every slot and pays only for the GEMMs'
real groups. A caller that knows it (nccl, deepep after their host sync) passes `num_pairs` to shrink the grids.

On CUDA the three helpers are small Triton kernels (torch has no fused op for them); on the CPU (gloo CI) they are
torch ops with the same semantics, so the CPU tests run the same host code as the GPU.

Shape legend: R = rows, k = slots per row, P = (row, slot) pairs, H = hidden size, I = intermediate size,
E_local = experts on this rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["GroupedExperts", "StageTimer", "gather_rows", "silu_mul", "gather_weighted_sum", "grouped_mm_usable"]

_BLOCK_M = 16  # rows per program of the elementwise kernels
_BLOCK_N = 512  # columns per program (1 KiB of bf16 per row: wide, coalesced loads)
_NO_LIMIT = 2**31 - 1


# ---------------------------------------------------------------------------------------------- Triton kernels (CUDA)
@triton.jit
def _gather_rows_kernel(src_ptr, index_ptr, out_ptr, limit_ptr, num_rows, num_cols, stride_src, stride_out,
                        INDEX_DIVISOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[m] = src[index[m] // INDEX_DIVISOR] for m < min(num_rows, limit); other rows untouched."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    limit = tl.minimum(tl.load(limit_ptr), num_rows)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < limit
    src_rows = tl.load(index_ptr + offs_m, mask=mask_m, other=0) // INDEX_DIVISOR
    mask = mask_m[:, None] & (offs_n < num_cols)[None, :]
    values = tl.load(src_ptr + src_rows.to(tl.int64)[:, None] * stride_src + offs_n[None, :], mask=mask)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :], values, mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, limit_ptr, num_rows, intermediate, stride_gate_up, stride_out,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[m, n] = silu(gate_up[m, n]) * gate_up[m, I + n] (fp32 math, bf16 out) for m < min(num_rows, limit)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    limit = tl.minimum(tl.load(limit_ptr), num_rows)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < limit)[:, None] & (offs_n < intermediate)[None, :]
    gate_ptrs = gate_up_ptr + offs_m.to(tl.int64)[:, None] * stride_gate_up + offs_n[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + intermediate, mask=mask, other=0.0).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :], h.to(tl.bfloat16), mask=mask)


@triton.jit
def _gather_weighted_sum_kernel(src_ptr, index_ptr, weight_ptr, out_ptr, limit_ptr, row_limit_ptr, num_rows, num_cols,
                                stride_src, stride_index_row, stride_index_slot, stride_weight_row,
                                stride_weight_slot, stride_out, NUM_SLOTS: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[m] = sum_j weight[m, j] * src[index[m, j]] over slots with 0 <= index < limit (fp32 sum, bf16 out).

    Rows m >= min(num_rows, row_limit) are not written."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    limit = tl.load(limit_ptr)
    row_limit = tl.minimum(tl.load(row_limit_ptr), num_rows)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < row_limit
    mask_n = offs_n < num_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in tl.static_range(NUM_SLOTS):
        index = tl.load(index_ptr + offs_m * stride_index_row + slot * stride_index_slot, mask=mask_m, other=-1)
        valid = mask_m & (index >= 0) & (index < limit)
        values = tl.load(src_ptr + index.to(tl.int64)[:, None] * stride_src + offs_n[None, :],
                         mask=valid[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            weight = tl.load(weight_ptr + offs_m * stride_weight_row + slot * stride_weight_slot, mask=valid,
                             other=0.0)
            values = values * weight[:, None]
        acc += values
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :], acc.to(tl.bfloat16),
             mask=mask_m[:, None] & mask_n[None, :])


def _grid(num_rows: int, num_cols: int) -> tuple[int, int]:
    return triton.cdiv(num_rows, _BLOCK_M), triton.cdiv(num_cols, _BLOCK_N)


# ---------------------------------------------------------------------------------------------- ops (CUDA | CPU)
def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor, limit: torch.Tensor,
                index_divisor: int = 1, use_triton: bool | None = None) -> torch.Tensor:
    """out[m] = src[index[m] // index_divisor] for m < limit (the permute of the expert stage).

    Args:
        src: [N, C] rows (last dim contiguous; any row stride).
        index: [M] int32/int64 source positions (before the division).
        out: [M, C] same dtype as src (last dim contiguous).
        limit: [1] int32 on the device: rows at and past it are left untouched on CUDA (the CPU path gathers all M,
            so every index must be valid there).
        index_divisor: e.g. k, to turn a (row, slot) pair position into its row.
        use_triton: None = on CUDA only (tests force it under TRITON_INTERPRET=1).
    """
    num_rows, num_cols = out.shape
    if num_rows == 0 or num_cols == 0:
        return out
    if src.is_cuda if use_triton is None else use_triton:
        _gather_rows_kernel[_grid(num_rows, num_cols)](
            src, index, out, limit, num_rows, num_cols, src.stride(0), out.stride(0),
            INDEX_DIVISOR=index_divisor, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N)
        return out
    rows = index if index_divisor == 1 else torch.div(index, index_divisor, rounding_mode="floor")
    return torch.index_select(src, 0, rows, out=out)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor, limit: torch.Tensor,
             use_triton: bool | None = None) -> torch.Tensor:
    """out = silu(gate_up[:, :I]) * gate_up[:, I:] with fp32 math, bf16 out, for rows < limit (all rows on CPU).

    Args:
        gate_up: [M, 2I] bf16 (GEMM0's output: gate columns then up columns).
        out: [M, I] bf16.
        limit: [1] int32 on the device.
        use_triton: None = on CUDA only.
    """
    num_rows, intermediate = out.shape
    if num_rows == 0:
        return out
    if gate_up.is_cuda if use_triton is None else use_triton:
        _silu_mul_kernel[_grid(num_rows, intermediate)](
            gate_up, out, limit, num_rows, intermediate, gate_up.stride(0), out.stride(0),
            BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, num_warps=8)
        return out
    gate = F.silu(gate_up[:, :intermediate].float(), inplace=True)
    return torch.mul(gate, gate_up[:, intermediate:], out=out)


def gather_weighted_sum(src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor,
                        limit: torch.Tensor, row_limit: torch.Tensor | None = None,
                        use_triton: bool | None = None) -> torch.Tensor:
    """out[m] = sum_j weights[m, j] * src[index[m, j]] over slots with 0 <= index[m, j] < limit.

    The un-permute of the expert stage (and the nccl combine's sum over ranks): each output row gathers its few
    source rows, so no fp32 [P, H] temporary and no atomics; fp32 accumulation in slot order, one bf16 rounding.
    A row with no valid slot becomes zero.

    Args:
        src: [N, H] bf16 (last dim contiguous, any row stride).
        index: [M, J] int32/int64, any strides; -1 (or anything outside [0, limit)) = no contribution.
        weights: [M, J] fp32 (any strides), or None for weight 1.
        out: [M, H] bf16 (last dim contiguous, any row stride).
        limit: [1] int32 on the device (the pair count), see above.
        row_limit: [1] int on the device: rows at and past it are not written (None = all M rows).
        use_triton: None = on CUDA only.
    """
    num_rows, num_slots = index.shape
    num_cols = out.shape[1]
    if num_rows == 0 or num_cols == 0:
        return out
    if src.is_cuda if use_triton is None else use_triton:
        weights_arg = weights if weights is not None else index  # never read when HAS_WEIGHTS is False
        row_limit = row_limit if row_limit is not None else limit.new_full((1,), _NO_LIMIT)
        _gather_weighted_sum_kernel[_grid(num_rows, num_cols)](
            src, index, weights_arg, out, limit, row_limit, num_rows, num_cols,
            src.stride(0), index.stride(0), index.stride(1), weights_arg.stride(0), weights_arg.stride(1),
            out.stride(0), NUM_SLOTS=num_slots, HAS_WEIGHTS=weights is not None,
            BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, num_warps=8)  # 8 warps: the fp32 accumulator is 32 values a thread
        return out
    full_out = out
    if row_limit is not None:  # the CPU path may read it on the host (CPU tests of GPU-only backends use it)
        num_rows = min(num_rows, int(row_limit))
        index, out = index[:num_rows], out[:num_rows]
        weights = weights[:num_rows] if weights is not None else None
    if src.shape[0] == 0 or num_rows == 0:
        out.zero_()
        return full_out
    valid = (index >= 0) & (index < limit)
    picked = src.index_select(0, index.clamp(0, src.shape[0] - 1).reshape(-1)).view(num_rows, num_slots, num_cols)
    picked = picked.float() if weights is None else picked * weights[..., None]  # bf16 * fp32 -> fp32
    picked = torch.where(valid[..., None], picked, 0.0)  # where, not a multiply: unwritten rows may hold NaN
    out.copy_(picked.sum(1))
    return full_out


def grouped_mm_usable(device: torch.device, hidden: int, intermediate: int) -> bool:
    """torch._grouped_mm needs 16-byte aligned strides; on CUDA sm90+, and on the CPU where this torch has it."""
    if not hasattr(torch, "_grouped_mm") or hidden % 8 or intermediate % 8:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (9, 0)
    if device.type != "cpu":
        return False
    try:  # CPU support arrived later than CUDA's: probe it once
        probe = torch._grouped_mm(torch.zeros(2, 8, dtype=torch.bfloat16),
                                  torch.zeros(1, 8, 8, dtype=torch.bfloat16).transpose(1, 2),
                                  offs=torch.tensor([2], dtype=torch.int32))
        return probe.shape == (2, 8)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


# ---------------------------------------------------------------------------------------------- timing
class StageTimer:
    """CUDA events between the stages of one call: `mark(stage)` ends `stage`; `finish(timings)` fills in ms.

    `timings` gets one entry per marked stage plus "total" (first to last mark). Off CUDA it records nothing.
    """

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled and device.type == "cuda"
        self._marks: list[tuple[str, torch.cuda.Event]] = []
        if self.enabled:
            self.mark("")

    def mark(self, stage: str) -> None:
        if self.enabled:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((stage, event))

    def finish(self, timings: dict | None) -> None:
        if not self.enabled or timings is None:
            return
        self._marks[-1][1].synchronize()
        for (_, start), (stage, end) in zip(self._marks, self._marks[1:]):
            timings[stage] = timings.get(stage, 0.0) + start.elapsed_time(end)
        timings["total"] = self._marks[0][1].elapsed_time(self._marks[-1][1])


# ---------------------------------------------------------------------------------------------- the stage
class GroupedExperts:
    """This rank's experts applied to received rows (see the module docstring); buffers sized once.

    Args:
        num_local_experts: E_local.
        hidden_size, intermediate_size: H, I.
        max_slots: the most (row, slot) pairs one call may pass (R * k): sizes the sort buffers.
        max_pairs: the most of them with a local expert when the caller passes `num_pairs`, else max_slots: sizes
            the gathered rows and h.
        device: where the rows and experts live.
    """

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, max_slots: int,
                 max_pairs: int, device: torch.device) -> None:
        self.num_local_experts = num_local_experts
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.device = device
        self.use_grouped_mm = grouped_mm_usable(device, hidden_size, intermediate_size)
        # uint8 keys: the int32 -> uint8 cast alone maps -1 to 255 (one elementwise op, one radix-sort pass on CUDA).
        self._key_dtype = torch.uint8 if num_local_experts < 255 else torch.int32
        self._expert_ids = torch.arange(num_local_experts, dtype=self._key_dtype, device=device)
        self._no_expert_key = torch.tensor(num_local_experts, dtype=self._key_dtype, device=device)  # int32 keys
        self._keys = torch.empty(max_slots, dtype=self._key_dtype, device=device)
        self._sorted_keys = torch.empty(max_slots, dtype=self._key_dtype, device=device)
        self._order = torch.empty(max_slots, dtype=torch.int64, device=device)
        self._position = torch.empty(max_slots, dtype=torch.int32, device=device)  # sorted position of each slot
        self._slot_index = torch.arange(max_slots, dtype=torch.int32, device=device)
        self._group_ends = torch.empty(num_local_experts, dtype=torch.int32, device=device)
        self._gathered = torch.empty(max_pairs, hidden_size, dtype=torch.bfloat16, device=device)
        self._h = torch.empty(max_pairs, intermediate_size, dtype=torch.bfloat16, device=device)
        self.w13_t = self.w2_t = None

    def buffers(self) -> list[torch.Tensor]:
        """The reusable buffers (for poisoning in tests)."""
        return [self._keys, self._sorted_keys, self._order, self._position, self._group_ends, self._gathered, self._h]

    def load(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """w13 [E_local, 2I, H], w2 [E_local, H, I] bf16."""
        # grouped_mm computes A [M, K] @ B[e] [K, N]: the transposed views need no copy (column-major B is allowed).
        self.w13_t, self.w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
        if not self.use_grouped_mm:  # the loop fallback multiplies in fp32: copies made once
            self.w13_t, self.w2_t = self.w13_t.float(), self.w2_t.float()

    def forward_local(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, timer: StageTimer,
                      timings: dict | None) -> torch.Tensor:
        """The whole layer without an exchange (EP = 1): this stage on x's own rows -> a new [T, H] bf16."""
        out = torch.empty_like(x)
        self.run(x, ids, weights, out, timer=timer)
        timer.finish(timings)
        return out

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor,
            num_pairs: int | None = None, row_limit: torch.Tensor | None = None,
            timer: StageTimer | None = None) -> torch.Tensor:
        """out[r] = sum_j weights[r, j] * expert_{ids[r, j]}(x[r]) (see the module docstring).

        Args:
            x: [R, H] bf16 rows (last dim contiguous, any row stride).
            ids: [R, k] int32 local expert ids in [0, E_local), -1 = not on this rank / no expert.
            weights: [R, k] fp32 routing weights, or None for weight 1.
            out: [R, H] bf16 (may alias x: x is read in full before out is written).
            num_pairs: the number of slots with ids >= 0 if the host knows it (shrinks the grids), else None.
            row_limit: [1] int on the device: rows at and past it are not written.
            timer: stages "permute" (sort + gather), "gemms" (GEMM0, SiLU-mul, GEMM1), "unpermute" (weighted sum).

        Returns:
            out.
        """
        num_rows, top_k = ids.shape
        num_slots = num_rows * top_k
        if num_slots == 0:
            return out
        keys = self._keys[:num_slots]
        keys.view(num_rows, top_k).copy_(ids)  # int32/int64 -> key dtype (ids may be strided); uint8 maps -1 to 255
        if self._key_dtype != torch.uint8:  # int32 keys: -1 -> E_local, after every expert
            torch.where(keys >= 0, keys, self._no_expert_key, out=keys)
        sorted_keys, order = torch.sort(keys, stable=True,
                                        out=(self._sorted_keys[:num_slots], self._order[:num_slots]))
        group_ends = torch.searchsorted(sorted_keys, self._expert_ids, right=True, out_int32=True,
                                        out=self._group_ends)
        num_valid = group_ends[-1:]  # [1] int32 on the device: the pair count
        position = self._position[:num_slots].scatter_(0, order, self._slot_index[:num_slots])
        used = num_slots if num_pairs is None else num_pairs
        if used == 0:
            gather_weighted_sum(x, position.view(num_rows, top_k), weights, out, num_valid, row_limit)
            return out
        gathered = gather_rows(x, order[:used], self._gathered[:used], num_valid, index_divisor=top_k)
        if timer:
            timer.mark("permute")
        if self.use_grouped_mm:
            gate_up = torch._grouped_mm(gathered, self.w13_t, offs=group_ends)  # [P, 2I] bf16, fp32 accumulate
            h = silu_mul(gate_up, self._h[:used], num_valid)
            y = torch._grouped_mm(h, self.w2_t, offs=group_ends)  # [P, H] bf16
        else:
            ends = group_ends.tolist()  # the fallback's extra host sync (pre-sm90 GPUs, odd H or I)
            gate_up = _grouped_mm_fallback(gathered, self.w13_t, ends)
            h = silu_mul(gate_up, self._h[:used], num_valid)
            y = _grouped_mm_fallback(h, self.w2_t, ends)
        if timer:
            timer.mark("gemms")
        gather_weighted_sum(y, position.view(num_rows, top_k), weights, out, num_valid, row_limit)
        if timer:
            timer.mark("unpermute")
        return out


def _grouped_mm_fallback(a: torch.Tensor, b: torch.Tensor, group_ends: list[int]) -> torch.Tensor:
    """`torch._grouped_mm` semantics where it is unusable: a [M, K] bf16 grouped by expert (group e ends at
    group_ends[e]), b [E_local, K, N] fp32 -> [M, N] bf16 (fp32 math, one rounding; rows past the last group
    are zero)."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.bfloat16, device=a.device)
    start = 0
    for expert, end in enumerate(group_ends):
        if end > start:
            out[start:end] = a[start:end].float() @ b[expert]
        start = end
    return out
