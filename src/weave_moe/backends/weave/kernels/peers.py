"""Addresses the kernels compute: a region of a rank's symmetric buffer, and a resident call's x and out.

Peers are reached as base address (the int64 table `peer_base_ptr`, from the workspace's rendezvous) plus a byte
offset that is the same on every rank (workspace.py). A resident call's x and out are read from `io`, where its pack
stored their addresses (backend.py, `_aligned_io`).
"""

import triton
import triton.language as tl

__all__ = ["ROW_ALIGNMENT", "peer_ptr", "call_io_ptr"]

# Byte alignment of x and out (a resident call's, read from `io_ptr`) and of the start of every region of the
# symmetric buffers: the row copies read and write them with 16-byte vector accesses. The backend passes only such x
# and out; the workspace checks the buffers' bases, and aligns its regions' offsets.
ROW_ALIGNMENT = tl.constexpr(16)


@triton.jit
def peer_ptr(peer_base_ptr, rank, region_offset, dtype: tl.constexpr, ALIGNED: tl.constexpr = False):
    """The start of a region of `rank`'s symmetric buffer (`region_offset` bytes from its base). It is ROW_ALIGNMENT-
    aligned; ALIGNED declares it, which the compiler cannot infer for an address read from memory, so that the row
    copies into the region use 16-byte vector stores instead of one store per element. The caller adds its element
    offset, whose divisibility the compiler knows from the launch's specialisation (H, max_tokens).
    (`tl.multiple_of` annotates the operation that made its argument, so it is applied here, not in a helper.)"""
    region = (tl.load(peer_base_ptr + rank) + region_offset).to(tl.pointer_type(dtype))
    if ALIGNED:
        region = tl.multiple_of(region, ROW_ALIGNMENT)
    return region


@triton.jit
def call_io_ptr(io_ptr, word, ALIGNED: tl.constexpr):
    """x (word 0) or out (word 1) of a resident call, by the address the call's pack stored: ROW_ALIGNMENT-aligned
    (backend.py, `_aligned_io`), declared so with ALIGNED (as in `peer_ptr`)."""
    pointer = tl.load(io_ptr + word).to(tl.pointer_type(tl.bfloat16))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, ROW_ALIGNMENT)
    return pointer
