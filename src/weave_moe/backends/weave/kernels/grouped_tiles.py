"""Tile tables of the grouped GEMMs (kernels/grouped_gemm.py): each expert's rows cut into M tiles, on the device;
and the row gather that lays the received rows out in expert order for them.

Shape legend: E_local = local experts, P = rows, BM = rows per tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weave_moe.backends.weave.kernels import sync

__all__ = ["TileTable", "build_tile_table", "build_tile_table_torch", "empty_tile_tables", "fill_tile_tables",
           "tile_table_from_counts",
           "gather_rows", "scatter_rows", "grouped_prologue"]


@dataclass(frozen=True)
class TileTable:
    """M tiles of one grouped GEMM, built on the device, in two sections of `max_tiles` entries each.

    Section 0 holds tiles of block_m rows; with `split_tail`, an expert whose last tile would hold at most block_m / 2
    rows gets that tail as a tile of section 1 instead, run with block_m / 2 rows (less padding). Without it, section
    1 is empty.

    Attributes:
        table: int32 [3, 2 * max_tiles]: per tile (expert, first row, end row of its expert); section s starts at
            column s * max_tiles; entries past a section's count are unused.
        num_tiles: int32 [2]: tiles in sections 0 and 1 (read by the kernels on the device).
        block_m: rows per tile of section 0.
        split_tail: whether section 1 is used.
    """

    table: torch.Tensor
    num_tiles: torch.Tensor
    block_m: int
    split_tail: bool = False

    @property
    def max_tiles(self) -> int:
        return self.table.shape[1] // 2


def _table_size(expert_offsets: torch.Tensor, block_m: int, max_rows: int) -> tuple[int, int]:
    if expert_offsets.dim() != 1 or expert_offsets.numel() < 2 or expert_offsets.dtype != torch.int32:
        raise ValueError("expert_offsets: expected int32 [E_local + 1] with E_local >= 1, given "
                         f"{expert_offsets.dtype} {tuple(expert_offsets.shape)}")
    num_experts = expert_offsets.numel() - 1
    return num_experts, triton.cdiv(max_rows, block_m) + num_experts


def build_tile_table(expert_offsets: torch.Tensor, block_m: int, max_rows: int, split_tail: bool = False) -> TileTable:
    """Cut each expert's rows into tiles (see TileTable), on the device, in one launch and without a host sync.

    Args:
        expert_offsets: int32 [E_local + 1], prefix sum of rows per expert, starting at 0, ending <= max_rows.
        block_m: rows per tile (section 0).
        max_rows: an upper bound of expert_offsets[-1] known on the host (sizes the table).
        split_tail: give tails of at most block_m / 2 rows their own half-height tiles (section 1).
    """
    tiles = _empty_table(expert_offsets, block_m, max_rows, split_tail)
    num_experts = expert_offsets.numel() - 1
    _tile_table_kernel[(triton.cdiv(tiles.max_tiles, _BLOCK_T),)](
        expert_offsets, tiles.table, tiles.num_tiles, num_experts, tiles.max_tiles, BLOCK_M=block_m,
        SPLIT_TAIL=split_tail, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_T=_BLOCK_T, **sync.LAUNCH)
    return tiles


#: tile-table entries per program
_BLOCK_T = 64


def _empty_table(expert_offsets: torch.Tensor, block_m: int, max_rows: int, split_tail: bool) -> TileTable:
    """A TileTable's buffers for these offsets, not yet filled (its size checked by `_table_size`)."""
    _, max_tiles = _table_size(expert_offsets, block_m, max_rows)
    return TileTable(torch.empty(3, 2 * max_tiles, dtype=torch.int32, device=expert_offsets.device),
                     torch.empty(2, dtype=torch.int32, device=expert_offsets.device), block_m, split_tail)


def build_tile_table_torch(expert_offsets: torch.Tensor, block_m: int, max_rows: int,
                           split_tail: bool = False) -> TileTable:
    """`build_tile_table` in plain torch ops (the test reference; ~20 launches instead of one)."""
    num_experts, max_tiles = _table_size(expert_offsets, block_m, max_rows)
    offsets = expert_offsets.to(torch.int64)
    rows = offsets[1:] - offsets[:-1]
    remainder = rows % block_m
    small = (remainder > 0) & (remainder <= block_m // 2) if split_tail else torch.zeros_like(rows, dtype=torch.bool)
    big = (rows + block_m - 1) // block_m - small.long()
    tile = torch.arange(max_tiles, device=expert_offsets.device)
    sections, counts = [], []
    for per_expert, height in ((big, block_m), (small.long(), block_m // 2)):
        psum = torch.cumsum(per_expert, 0)
        expert = torch.searchsorted(psum, tile, right=True).clamp_(max=num_experts - 1)
        index = tile - (psum[expert] - per_expert[expert])
        if height == block_m:
            m_start = offsets[expert] + index * block_m
        else:  # the tail after the expert's full tiles
            m_start = offsets[expert] + rows[expert] // block_m * block_m
        sections.append(torch.stack([expert, m_start, offsets[expert + 1]]))
        counts.append(psum[-1:])
    return TileTable(torch.cat(sections, 1).to(torch.int32), torch.cat(counts).to(torch.int32), block_m, split_tail)


@triton.jit(do_not_specialize=["num_experts", "max_tiles"])
def _tile_table_kernel(offsets_ptr, table_ptr, num_tiles_ptr, num_experts, max_tiles,
                       BLOCK_M: tl.constexpr, SPLIT_TAIL: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    sync.pdl_enter()
    _tile_table_block(tl.program_id(0), offsets_ptr, 1, table_ptr, num_tiles_ptr, num_experts, max_tiles, BLOCK_M,
                      SPLIT_TAIL, BLOCK_E, BLOCK_T, FROM_OFFSETS)


@triton.jit
def _tile_table_block(pid, offsets_ptr, scale, table_ptr, num_tiles_ptr, num_experts, max_tiles,
                      BLOCK_M: tl.constexpr, SPLIT_TAIL: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
                      SOURCE: tl.constexpr):
    """Entries [pid * BLOCK_T, +BLOCK_T) of both sections; every program recomputes the tile prefix sums over the
    experts (E_local <= BLOCK_E numbers), so there is no cross-program dependency. Entries past a section's count
    repeat its last expert and are never read. `scale` 0 reads every offset as 0 (no tiles), 1 as given. SOURCE:
    what `offsets_ptr` holds (`_expert_bounds`)."""
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    start, end = _expert_bounds(offsets_ptr, experts, valid, scale, SOURCE)
    rows = end - start
    remainder = rows % BLOCK_M
    if SPLIT_TAIL:
        small = tl.where(valid & (remainder > 0) & (remainder <= BLOCK_M // 2), 1, 0)
    else:
        small = tl.zeros((BLOCK_E,), dtype=tl.int32)
    big = tl.where(valid, (rows + BLOCK_M - 1) // BLOCK_M, 0) - small
    if pid == 0:
        tl.store(num_tiles_ptr, tl.sum(big, 0))
        tl.store(num_tiles_ptr + 1, tl.sum(small, 0))
    tile = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    width = 2 * max_tiles
    # section 0: the expert holding a tile is the number of experts whose tiles all come before it (searchsorted,
    # right); tile i of an expert starts i * BLOCK_M rows in
    psum = tl.cumsum(big, 0)
    first = psum - big
    expert = tl.minimum(tl.sum(((psum[None, :] <= tile[:, None]) & valid[None, :]).to(tl.int32), 1), num_experts - 1)
    pick = experts[None, :] == expert[:, None]
    m_start = tl.sum(tl.where(pick, start[None, :] + (tile[:, None] - first[None, :]) * BLOCK_M, 0), 1)
    m_end = tl.sum(tl.where(pick, end[None, :], 0), 1)
    ok = tile < max_tiles
    tl.store(table_ptr + tile, expert, mask=ok)
    tl.store(table_ptr + width + tile, m_start, mask=ok)
    tl.store(table_ptr + 2 * width + tile, m_end, mask=ok)
    # section 1: at most one tail tile per expert, after its full tiles
    psum = tl.cumsum(small, 0)
    first = psum - small
    expert = tl.minimum(tl.sum(((psum[None, :] <= tile[:, None]) & valid[None, :]).to(tl.int32), 1), num_experts - 1)
    pick = experts[None, :] == expert[:, None]
    m_start = tl.sum(tl.where(pick, start[None, :] + rows[None, :] // BLOCK_M * BLOCK_M, 0), 1)
    m_end = tl.sum(tl.where(pick, end[None, :], 0), 1)
    tl.store(table_ptr + max_tiles + tile, expert, mask=ok)
    tl.store(table_ptr + width + max_tiles + tile, m_start, mask=ok)
    tl.store(table_ptr + 2 * width + max_tiles + tile, m_end, mask=ok)


@triton.jit
def tile_table_from_counts(counts_ptr, table_ptr, num_tiles_ptr, num_experts, max_tiles, BLOCK_M: tl.constexpr,
                           SPLIT_TAIL: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """A whole tile table from the rows per expert `counts_ptr` [num_experts], by ONE program (a kernel that has
    the counts in hand: kernels/counts.py's last program): `_tile_table_block`'s entries, BLOCK_T at a time, over
    the blocks that hold a tile only (entries past a section's count are never read), so its time follows the call's
    rows, not the table's size (sized for T_max)."""
    experts = tl.arange(0, BLOCK_E)
    rows = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    used = tl.sum((rows + BLOCK_M - 1) // BLOCK_M, 0)   # >= either section's tiles
    # block 0 always: it writes both sections' counts
    for block in range(0, tl.maximum(tl.cdiv(tl.minimum(used, max_tiles), BLOCK_T), 1)):
        _tile_table_block(block, counts_ptr, 1, table_ptr, num_tiles_ptr, num_experts, max_tiles, BLOCK_M,
                          SPLIT_TAIL, BLOCK_E, BLOCK_T, FROM_COUNTS)


@triton.jit
def _gather_rows_kernel(src_ptr, index_ptr, dst_ptr, count_ptr, H, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                        COUNT_AHEAD: tl.constexpr):
    """dst[r] = src[index[r]] for r < count (a device scalar); a persistent grid strides over the rows, each step's
    indices loaded during the step before. The indices were written two or more launches back (the task tables,
    before the dispatch launch that fills src), so a program loads its first ones before it waits for its
    predecessor (sync.pdl_ahead); so is the count with COUNT_AHEAD (the tile-table launch that writes it ran on
    another stream and was joined before this launch), otherwise it is loaded after the wait."""
    sync.pdl_ahead()
    offs_r = tl.arange(0, ROWS)
    offs_h = tl.arange(0, BLOCK_H)
    first_row = tl.program_id(0) * ROWS
    step = tl.num_programs(0) * ROWS
    count = 0
    src_rows = tl.zeros([ROWS], dtype=tl.int32)
    if COUNT_AHEAD:
        count = tl.load(count_ptr)
        src_rows = tl.load(index_ptr + first_row + offs_r, mask=first_row + offs_r < count, other=0)
    sync.pdl_enter()
    if not COUNT_AHEAD:
        count = tl.load(count_ptr)
        src_rows = tl.load(index_ptr + first_row + offs_r, mask=first_row + offs_r < count, other=0)
    for first in range(first_row, count, step):
        rows = first + offs_r
        row_ok = rows < count
        src = src_rows.to(tl.int64)
        next_rows = first + step + offs_r
        src_rows = tl.load(index_ptr + next_rows, mask=next_rows < count, other=0)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + offs_h
            mask = row_ok[:, None] & (cols < H)[None, :]
            values = tl.load(src_ptr + src[:, None] * H + cols[None, :], mask=mask)
            tl.store(dst_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], values, mask=mask)


def gather_rows(src: torch.Tensor, index: torch.Tensor, dst: torch.Tensor, count: torch.Tensor,
                num_programs: int, count_ready: bool = False) -> torch.Tensor:
    """dst[r] = src[index[r]] for r < count, with no host sync: the grouped GEMMs read their A rows contiguous.

    Args:
        src: [S, H] bf16 (the receive buffer). index: [>= count] int32 rows of src, written two or more launches
            before this one on its stream (or on a stream joined before it). dst: [>= count, H], same dtype.
        count: int32 device scalar (e.g. `expert_offsets[-1:]`): rows to gather. num_programs: persistent grid size.
        count_ready: `count` was written on another stream, joined before this launch (the weave backend's forked
            tile-table launch), so the kernel may load it before it waits for the launch before it on this stream;
            False: that launch may be the one that writes it.
    """
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(f"gather_rows: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} "
                         "must be [*, H] of one dtype")
    _gather_rows_kernel[(num_programs,)](src, index, dst, count, src.shape[1], ROWS=16, BLOCK_H=512,
                                         COUNT_AHEAD=count_ready, num_warps=8, **sync.LAUNCH)
    return dst


@triton.jit(do_not_specialize=["gather_ptr", "pos_ptr", "tasks_ptr", "num_tasks_ptr", "count_ptr"])
def _scatter_rows_kernel(src_ptr, gather_ptr, pos_ptr, dst_ptr, tasks_ptr, num_tasks_ptr, count_ptr, H,
                         K: tl.constexpr, KP: tl.constexpr, TASK_WORDS: tl.constexpr, START: tl.constexpr,
                         COUNT: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """`gather_rows`' copy turned around: for every received row r of the combine tasks and top-k slot j with
    p = pos[r, j] >= 0, dst[p] = src[gather[p]], read once per received row (every valid p of a row has the same
    gather[p]) and written once per pair; nothing when count (the gather launch's row count) is 0. A persistent
    grid strides over the items (task, group of BLOCK_H-column blocks) (a task: TASK_WORDS int32, the row range at
    words START and COUNT), ROWS rows a step: a task's columns are cut into programs // tasks groups (at most one
    block each), so a call of few tasks (128 tokens: 8 tasks of 16 rows) spreads over tasks x H / BLOCK_H programs,
    and one of more than half a task per program keeps whole tasks (its rows' `pos` and `gather` loaded once per
    step, not once per group). The table pointers are not specialised on their alignment (scalars and indices only
    are loaded through them), so the layer's warm-up on other buffers compiles the variant its calls run."""
    sync.pdl_enter()
    jj = tl.arange(0, KP)
    offs_r = tl.arange(0, ROWS)
    offs_h = tl.arange(0, BLOCK_H)
    num_tasks = 0
    if tl.load(count_ptr) > 0:   # the task count only then (a warm-up's count 0 comes with no tables)
        num_tasks = tl.load(num_tasks_ptr)
    blocks = tl.cdiv(H, BLOCK_H)
    groups = tl.minimum(blocks, tl.maximum(tl.num_programs(0) // tl.maximum(num_tasks, 1), 1))
    per_group = tl.cdiv(blocks, groups)
    for item in range(tl.program_id(0), num_tasks * groups, tl.num_programs(0)):
        task = item // groups
        first_block = (item % groups) * per_group
        end_block = tl.minimum(first_block + per_group, blocks)
        first = tl.load(tasks_ptr + task * TASK_WORDS + START)
        end = first + tl.load(tasks_ptr + task * TASK_WORDS + COUNT)
        for r0 in range(first, end, ROWS):
            rows = r0 + offs_r
            row_ok = rows < end
            pos = tl.load(pos_ptr + rows.to(tl.int64)[:, None] * K + jj[None, :],
                          mask=row_ok[:, None] & (jj < K)[None, :], other=-1)
            any_pos = tl.max(pos, axis=1)   # some valid pair of the row, or -1
            src = tl.load(gather_ptr + tl.maximum(any_pos, 0), mask=any_pos >= 0, other=0).to(tl.int64)
            for block in range(first_block, end_block):
                cols = block * BLOCK_H + offs_h
                col_ok = cols < H
                values = tl.load(src_ptr + src[:, None] * H + cols[None, :],
                                 mask=(any_pos >= 0)[:, None] & col_ok[None, :])
                for j in tl.static_range(K):
                    p = tl.sum(tl.where(jj[None, :] == j, pos, 0), axis=1)
                    tl.store(dst_ptr + tl.maximum(p, 0).to(tl.int64)[:, None] * H + cols[None, :], values,
                             mask=(p >= 0)[:, None] & col_ok[None, :])


def scatter_rows(src: torch.Tensor, gather: torch.Tensor, pos: torch.Tensor, dst: torch.Tensor,
                 tasks: torch.Tensor, num_tasks: torch.Tensor, count: torch.Tensor, num_programs: int,
                 start_column: int, count_column: int, block_h: int = 512) -> torch.Tensor:
    """What `gather_rows(src, gather, dst, count)` writes, by received row instead of by pair: each received row of
    src is read once, not once per pair (KernelConfig.scatter_rows). The rows come from a layout's combine tables,
    which list every received row with its pairs' positions.

    Args:
        src: [S, H] bf16 (the receive buffer). gather: [>= pairs] int32, the src row of each pair (in expert order).
        pos: [received rows, k] int32, each received row's pair positions (-1: not here). dst: [>= pairs, H].
        tasks: [tasks, words] int32 row blocks of `pos` (the combine tasks); `start_column` / `count_column`: where
            a task's first row and row count are. num_tasks: int32 device scalar (tasks to walk).
        count: int32 device scalar, the pairs `gather_rows` would copy: 0 copies nothing (another plan's call).
        num_programs: persistent grid size.
        block_h: columns per work item (a power of two).
    """
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(f"scatter_rows: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} "
                         "must be [*, H] of one dtype")
    if pos.dim() != 2 or tasks.dim() != 2 or not pos.is_contiguous() or not tasks.is_contiguous():
        raise ValueError(f"scatter_rows: pos {tuple(pos.shape)} and tasks {tuple(tasks.shape)} must be contiguous "
                         "2-D tables")
    top_k = pos.shape[1]
    _scatter_rows_kernel[(num_programs,)](src, gather, pos, dst, tasks, num_tasks, count, src.shape[1], K=top_k,
                                          KP=triton.next_power_of_2(top_k), TASK_WORDS=tasks.shape[1],
                                          START=start_column, COUNT=count_column, ROWS=16, BLOCK_H=block_h, num_warps=8,
                                          **sync.LAUNCH)
    return dst


#: what the prologue's `offsets_ptr` holds (`fill_tile_tables(form=)`): the prefix sum of rows per expert
#: [E_local + 1], or the rows per expert [E_local] (the counts vector's pairs)
FROM_OFFSETS, FROM_COUNTS = tl.constexpr(0), tl.constexpr(1)


@triton.jit
def _expert_bounds(offsets_ptr, experts, valid, scale, SOURCE: tl.constexpr):
    """(start, end) rows of each expert of `experts`: read off the prefix sum, or summed from the rows per expert;
    0 past `valid` and everywhere when `scale` is 0."""
    if SOURCE == FROM_COUNTS:
        rows = tl.load(offsets_ptr + experts, mask=valid, other=0) * scale
        end = tl.cumsum(rows, 0)
        return end - rows, end
    start = tl.load(offsets_ptr + experts, mask=valid, other=0) * scale
    end = tl.load(offsets_ptr + experts + 1, mask=valid, other=0) * scale
    return start, end


@triton.jit(do_not_specialize=["num_sms", "num_experts", "max_tiles0", "max_tiles1"])
def _prologue_kernel(offsets_ptr, plan_ptr, num_sms, rows_ptr, table0_ptr, num_tiles0_ptr, table1_ptr,
                     num_tiles1_ptr, num_experts, max_tiles0, max_tiles1,
                     TABLE0_PROGRAMS: tl.constexpr, BLOCK_M0: tl.constexpr, SPLIT_TAIL0: tl.constexpr,
                     BLOCK_M1: tl.constexpr, SPLIT_TAIL1: tl.constexpr, DEVICE_SERIAL: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, SOURCE: tl.constexpr):
    """`grouped_prologue`'s first launch: programs [0, TABLE0_PROGRAMS) build the first tile table, the rest the
    second; program 0 also writes the rows to gather. SOURCE: what `offsets_ptr` holds (`fill_tile_tables`)."""
    sync.pdl_enter()
    pid = tl.program_id(0)
    scale = 1
    if DEVICE_SERIAL:  # rows only under a serial plan (plan_ptr: this rank's c)
        scale = (tl.load(plan_ptr) >= num_sms).to(tl.int32)
    if pid == 0:
        if SOURCE == FROM_OFFSETS:   # the prefix sum's last entry
            tl.store(rows_ptr, tl.load(offsets_ptr + num_experts) * scale)
        else:
            experts = tl.arange(0, BLOCK_E)
            _, end = _expert_bounds(offsets_ptr, experts, experts < num_experts, scale, SOURCE)
            tl.store(rows_ptr, tl.max(end, 0))
    if pid < TABLE0_PROGRAMS:
        _tile_table_block(pid, offsets_ptr, scale, table0_ptr, num_tiles0_ptr, num_experts, max_tiles0, BLOCK_M0,
                          SPLIT_TAIL0, BLOCK_E, BLOCK_T, SOURCE)
    else:
        _tile_table_block(pid - TABLE0_PROGRAMS, offsets_ptr, scale, table1_ptr, num_tiles1_ptr, num_experts,
                          max_tiles1, BLOCK_M1, SPLIT_TAIL1, BLOCK_E, BLOCK_T, SOURCE)


def _check_tiles_keys(tiles) -> None:
    if not 1 <= len(tiles) <= 2 or len(set(tiles)) != len(tiles):
        raise ValueError(f"grouped_prologue: one or two distinct (block_m, split_tail) pairs, given {tiles}")


def empty_tile_tables(expert_offsets: torch.Tensor, tiles: tuple[tuple[int, bool], ...],
                      max_rows: int) -> dict[tuple[int, bool], TileTable]:
    """The buffers of `fill_tile_tables`, not yet filled: {(block_m, split_tail): TileTable} for the one or two
    distinct pairs in `tiles` (allocated on the current stream: a caller that fills them on another one allocates
    them here first, on the stream that reads them)."""
    _check_tiles_keys(tiles)
    return {(block_m, tail): _empty_table(expert_offsets, block_m, max_rows, tail) for block_m, tail in tiles}


def fill_tile_tables(built: dict[tuple[int, bool], TileTable], expert_offsets: torch.Tensor, rows: torch.Tensor,
                     plan: torch.Tensor | None = None, num_sms: int = 0, form: str = "offsets") -> None:
    """`grouped_prologue`'s first launch: every table of `built` (`empty_tile_tables`) and `rows[0]` = the rows to
    gather (expert_offsets[-1], or 0 under `plan` when it is not serial). It writes nothing a split plan's kernel
    reads, so it may run before or beside that kernel. `form`: what `expert_offsets` holds: "offsets", the prefix sum
    of rows per expert [E_local + 1]; "counts", each expert's rows [E_local] (e.g. the counts vector's pairs of this
    rank's experts)."""
    first, second = list(built.values()) + list(built.values())[:2 - len(built)]
    programs = [triton.cdiv(table.max_tiles, _BLOCK_T) for table in built.values()]
    source = {"offsets": FROM_OFFSETS, "counts": FROM_COUNTS}.get(form)
    if source is None:
        raise ValueError(f"form must be offsets or counts, got {form!r}")
    num_experts = expert_offsets.numel() - (0 if form == "counts" else 1)
    _prologue_kernel[(sum(programs),)](
        expert_offsets, expert_offsets if plan is None else plan,
        num_sms, rows, first.table, first.num_tiles, second.table, second.num_tiles, num_experts, first.max_tiles,
        second.max_tiles, TABLE0_PROGRAMS=programs[0], BLOCK_M0=first.block_m, SPLIT_TAIL0=first.split_tail,
        BLOCK_M1=second.block_m, SPLIT_TAIL1=second.split_tail, DEVICE_SERIAL=plan is not None,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_T=_BLOCK_T, SOURCE=source, **sync.LAUNCH)


def grouped_prologue(expert_offsets: torch.Tensor, tiles: tuple[tuple[int, bool], ...], max_rows: int,
                     src: torch.Tensor, index: torch.Tensor, dst: torch.Tensor, num_programs: int,
                     plan: torch.Tensor | None = None, num_sms: int = 0) -> dict[tuple[int, bool], TileTable]:
    """Everything the grouped GEMMs need before they run, in two launches and without a host sync: the tile table of
    each (block_m, split_tail) in `tiles` (one or two; `build_tile_table`) in the first (`fill_tile_tables`); the
    rows in expert order (`gather_rows(src, index, dst, expert_offsets[-1:], num_programs)`) in the second. The
    gather is its own launch: fused into the first it compiled to 178 registers per thread instead of 64 (sm_90), a
    quarter of the CTAs per SM for a copy bound by loads in flight, and serial calls at 8192 tokens measured 4-8%
    slower on an H200 (bench/results/h200-3114d5b). With `plan` (int32 device scalar: this rank's c), the offsets
    count only under a serial plan (c >= num_sms): otherwise no tile and no row, as if every expert were empty. The
    first launch needs only the offsets, so a caller may run it on another stream, beside other work (the weave
    backend's `fork_prologue`), and the gather after both.

    Returns {(block_m, split_tail): TileTable}.
    """
    built = empty_tile_tables(expert_offsets, tiles, max_rows)
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(f"grouped_prologue: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} "
                         f"{dst.dtype} must be [*, H] of one dtype")
    rows = torch.empty(1, dtype=torch.int32, device=expert_offsets.device)
    fill_tile_tables(built, expert_offsets, rows, plan, num_sms)
    gather_rows(src, index, dst, rows, num_programs)
    return built
