"""The megakernel's argument list, written once: `MegakernelArgs` (runtime arguments) and `MegakernelConstants`
(compile-time). The launch passes them BY NAME, built from these dataclasses; `compile_ptx` builds the AOT signature
from the same fields; an import-time check compares the field names with the kernel's own parameter list, so a
kernel parameter that is added, removed or reordered without this file fails at import, not as a wrong pointer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import triton

from weave_moe.backends.weave.kernels import sync
from weave_moe.backends.weave.kernels.megakernel import moe_megakernel

__all__ = ["MegakernelArgs", "MegakernelConstants", "NO_DESCRIPTORS", "launch", "warmup", "compile_sm", "compile_ptx"]


def _arg(triton_type: str):
    """A runtime argument and its type in Triton's AOT signature ("*bf16" pointer, "i32" scalar, ...)."""
    return field(metadata={"type": triton_type})


@dataclass
class MegakernelArgs:
    """Runtime arguments of `moe_megakernel`, in its parameter order (buffers: backend.py and workspace.py)."""

    # activations and weights
    x_ptr: torch.Tensor = _arg("*bf16")              # [T, H] this rank's tokens
    out_ptr: torch.Tensor = _arg("*bf16")            # [T, H]
    w13_ptr: torch.Tensor = _arg("*bf16")            # [E_local, 2I, H]
    w2_ptr: torch.Tensor = _arg("*bf16")             # [E_local, H, I]
    # local work buffers
    recv_ptr: torch.Tensor = _arg("*bf16")           # [EP * T_max, H] receive rows (symmetric)
    h_ptr: torch.Tensor = _arg("*bf16")              # [max_pairs, I]
    y_ptr: torch.Tensor = _arg("*bf16")              # [max_pairs, H]
    comb_ptr: torch.Tensor = _arg("*bf16")           # [EP * T_max, H] combine rows of this call's parity
    # symmetric addressing: peer base addresses + byte offsets of this call's regions
    peer_base_ptr: torch.Tensor = _arg("*i64")       # [EP]
    recv_offset: int = _arg("i64")
    comb_offset: int = _arg("i64")
    flags_offset: int = _arg("i64")
    arrival_ptr: torch.Tensor = _arg("*i32")         # [EP * MAX_CHUNKS] arrival counters of this parity
    comb_flag_ptr: torch.Tensor = _arg("*i32")       # [EP] combine counters of this parity
    # control and status
    ctrl_ptr: torch.Tensor = _arg("*i32")
    status_ptr: torch.Tensor = _arg("*i32")          # [4] error code, tag, counter seen, expected
    meta_ptr: torch.Tensor = _arg("*i32")            # layout.META_FIELDS
    plan_ptr: torch.Tensor = _arg("*i32")            # [EP, 4] device plans (read when RESIDENT)
    io_ptr: torch.Tensor = _arg("*i64")              # [2] addresses of x and out (read when RESIDENT)
    tokens_ptr: torch.Tensor = _arg("*i32")          # [1] T of this call (read when RESIDENT)
    timeline_ptr: torch.Tensor = _arg("*i64")
    # task tables (layout.Layout)
    dispatch_tasks_ptr: torch.Tensor = _arg("*i32")
    send_token_ptr: torch.Tensor = _arg("*i32")
    send_slot_ptr: torch.Tensor = _arg("*i32")
    gemm_tasks_ptr: torch.Tensor = _arg("*i32")
    gather_ptr: torch.Tensor = _arg("*i32")
    arrival_expected_ptr: torch.Tensor = _arg("*i32")
    gemm1_expected_ptr: torch.Tensor = _arg("*i32")
    combine_tasks_ptr: torch.Tensor = _arg("*i32")
    combine_token_ptr: torch.Tensor = _arg("*i32")
    combine_pos_ptr: torch.Tensor = _arg("*i32")
    combine_weight_ptr: torch.Tensor = _arg("*fp32")
    token_mask_ptr: torch.Tensor = _arg("*i32")
    combine_expected_ptr: torch.Tensor = _arg("*i32")
    # scalars
    rank: int = _arg("i32")
    world_size: int = _arg("i32")
    max_tokens: int = _arg("i32")
    num_tokens: int = _arg("i32")
    H: int = _arg("i32")
    I: int = _arg("i32")  # noqa: E741 - the kernel's name for the intermediate size
    num_comm_ctas: int = _arg("i32")
    num_steal: int = _arg("i32")
    timeout_ns: int = _arg("i64")
    PHASE_FIRST: int = _arg("i32")
    PHASE_LAST: int = _arg("i32")

    def by_name(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class MegakernelConstants:
    """Compile-time parameters of `moe_megakernel` (each distinct value is a separate compile)."""

    TOP_K: int
    MAX_CHUNKS: int
    BLOCK_M: int
    BLOCK_N0: int
    BLOCK_N1: int
    BLOCK_K: int
    DISPATCH_ROWS: int
    COMBINE_ROWS: int
    REDUCE_ROWS: int
    BLOCK_H: int
    DOT_FP32: bool
    TIMELINE: bool
    MAX_EVENTS: int
    STAGES0: int
    STAGES1: int
    BLOCK_K1: int
    USE_TMA: bool
    RESIDENT: bool = False
    STAGE: int = -1  # -1: phases PHASE_FIRST..PHASE_LAST; 0..3: that phase alone; 4: phases 2-3 (kernels/megakernel.py)
    W13_INTERLEAVED: bool = False  # w13 in the grouped GEMMs' interleaved layout (its descriptor 3-D)
    WIDE_GEMM0: bool = False       # GEMM0 as one MMA over interleaved rows (its descriptor 2-D, 2 * BLOCK_N0 rows)
    GROUPED_SERIAL: bool = False   # resident serial plans' GEMMs run as grouped GEMMs between stage launches
    VECTOR_ROWS: bool = True       # row copies in 16-byte vectors, the dispatch's steps pipelined (KernelConfig)

    @property
    def runs_gemm(self) -> bool:
        """Whether this compile holds the GEMM phase (and reads the TMA descriptors)."""
        return self.STAGE in (-1, 1)

    @classmethod
    def from_config(cls, config, top_k: int, max_chunks: int, timeline_events: int, use_tma: bool,
                    resident: bool = False, interleaved: bool = False):
        """From a KernelConfig; `timeline_events` = events per CTA of the timeline buffer (0: no timeline);
        `resident`: the kernel reads its plan, x / out addresses and T from the device (KernelConfig.resident);
        `interleaved`: w13 in the grouped GEMMs' layout (KernelConfig.wide_gemm0 applies only then)."""
        return cls(TOP_K=top_k, MAX_CHUNKS=max_chunks, BLOCK_M=config.block_m, BLOCK_N0=config.block_n0,
                   BLOCK_N1=config.block_n1, BLOCK_K=config.block_k, DISPATCH_ROWS=config.dispatch_rows,
                   COMBINE_ROWS=config.combine_rows, REDUCE_ROWS=config.reduce_rows, BLOCK_H=config.block_h,
                   DOT_FP32=config.dot_fp32, TIMELINE=timeline_events > 0, MAX_EVENTS=max(timeline_events, 1),
                   STAGES0=config.stages0, STAGES1=config.stages1, BLOCK_K1=config.block_k1, USE_TMA=use_tma,
                   RESIDENT=resident, W13_INTERLEAVED=interleaved,
                   WIDE_GEMM0=bool(interleaved and config.wide_gemm0), VECTOR_ROWS=config.vector_rows)

    def by_name(self) -> dict:
        return dataclasses.asdict(self)


#: The TMA descriptors (host-built, KernelConfig.tma): w13 as [E_local * 2I, H], w2 as [E_local * H, I].
DESCRIPTOR_NAMES = ("w13_desc", "w2_desc")
NO_DESCRIPTORS = dict.fromkeys(DESCRIPTOR_NAMES)


def tma_descriptors(config, constants: MegakernelConstants, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    """Host tensor descriptors of the weights for the TMA tiles (KernelConfig.tma), as every launch passes them:
    w13 [E_local, 2I, H] as [E_local*2I, H] block [BN0, BK]; interleaved (W13_INTERLEAVED) as [E_local*I, 2, H] block
    [BN0, 1, BK]; with WIDE_GEMM0 as [E_local*2I, H] block [2*BN0, BK]; w2 [E_local, H, I] as [E_local*H, I] block
    [BN1/2, BK1]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    H, I = w2.shape[1], w2.shape[2]
    if constants.WIDE_GEMM0:
        w13_desc = TensorDescriptor.from_tensor(w13.view(-1, H), [2 * config.block_n0, config.block_k])
    elif constants.W13_INTERLEAVED:
        w13_desc = TensorDescriptor.from_tensor(w13.view(-1, 2, H), [config.block_n0, 1, config.block_k])
    else:
        w13_desc = TensorDescriptor.from_tensor(w13.view(-1, H), [config.block_n0, config.block_k])
    return dict(w13_desc=w13_desc,
                w2_desc=TensorDescriptor.from_tensor(w2.view(-1, I), [config.block_n1 // 2, config.block_k1]))


def _descriptors(constants: MegakernelConstants, descriptors: dict) -> dict:
    """The descriptors for a launch of `constants`: None where it compiles no GEMM phase, so that the launch encodes
    no tensor map on the host (Triton does that at every launch of a host-built descriptor) and passes none."""
    return descriptors if constants.runs_gemm else NO_DESCRIPTORS


def _check_signature() -> None:
    runtime = [f.name for f in dataclasses.fields(MegakernelArgs)]
    constants = [f.name for f in dataclasses.fields(MegakernelConstants)]
    expected = set(runtime) | set(constants) | set(DESCRIPTOR_NAMES)
    if moe_megakernel.arg_names[:len(runtime)] != runtime or set(moe_megakernel.arg_names) != expected:
        raise ImportError("weave: launch.MegakernelArgs / MegakernelConstants do not match moe_megakernel's "
                          f"parameters {moe_megakernel.arg_names}; update launch.py with the kernel")


_check_signature()


#: Registers per thread the launches without GEMM may use (`maxnreg`, in their compiles). The grid is one CTA per SM,
#: so room for a second CTA on an SM is never used; without a bound, ptxas fitted those launches, whose own need is
#: ~110-220 registers, into 128 (two CTAs of 256 threads per SM) and spilled (sm_90: the combine + reduce launch of
#: the fixed serial policy, 28 bytes; tests/test_megakernel_cpu.py). The launches with the GEMM phase use 255 either
#: way, and spilled more with the bound stated (sm_90: 40 -> 136 bytes of stack, host-driven one-launch kernel).
MAXNREG = 255


def _registers(constants: MegakernelConstants) -> dict:
    """The register bound of a compile and launch of `constants` (MAXNREG), as launch options."""
    return {} if constants.runs_gemm else {"maxnreg": MAXNREG}


def launch(grid: int, args: MegakernelArgs, constants: MegakernelConstants, descriptors: dict, num_warps: int,
           num_stages: int) -> None:
    """One cooperative launch of `grid` CTAs (all resident, or the launch fails instead of hanging)."""
    moe_megakernel[(grid,)](**args.by_name(), **constants.by_name(), **_descriptors(constants, descriptors),
                            num_warps=num_warps, num_stages=num_stages, launch_cooperative_grid=True,
                            **_registers(constants), **sync.LAUNCH)


def compile_as_launched(args: MegakernelArgs, constants: MegakernelConstants, descriptors: dict, num_warps: int,
                        num_stages: int, capability: int = 90):
    """Compile for sm_<capability> without a GPU, specialised exactly as `launch` with these arguments would be
    (pointer alignment, divisibility of the specialised integers H, I, max_tokens, the descriptors' block shapes);
    returns Triton's compiled kernel. Unlike `compile_sm` (which declares no argument attributes), this is the code
    that runs: on sm_90 the resident one-launch kernel of the default config specialises to 48 bytes of stack and
    192 KB of shared memory where `compile_sm` reports 240 and 144 KB (tests/test_megakernel_cpu.py)."""
    from weave_moe.backends.weave.kernels.sm90 import compile_for_sm90

    return compile_for_sm90(moe_megakernel, (), dict(**args.by_name(), **constants.by_name(),
                                                     **_descriptors(constants, descriptors), num_warps=num_warps,
                                                     num_stages=num_stages, **_registers(constants),
                                                     **sync.LAUNCH), capability)


def warmup(grid: int, args: MegakernelArgs, constants: MegakernelConstants, descriptors: dict, num_warps: int,
           num_stages: int) -> None:
    """Compile for these arguments' specialisation without launching."""
    moe_megakernel.warmup(**args.by_name(), **constants.by_name(), **_descriptors(constants, descriptors),
                          grid=(grid,), num_warps=num_warps, num_stages=num_stages, launch_cooperative_grid=True,
                          **_registers(constants), **sync.LAUNCH)


def compile_sm(constants: dict, capability: int = 90, num_warps: int = 8, num_stages: int = 3):
    """Compile the megakernel for `sm_<capability>` without a GPU; returns Triton's compiled kernel (`.asm["ptx"]`,
    `.asm["cubin"]`, `.metadata.shared`: bytes of dynamic shared memory).

    `constants`: MegakernelConstants fields; missing ones take the dataclass's defaults, and STAGES0=3, STAGES1=4,
    BLOCK_K1=64, USE_TMA=False, TIMELINE=False, MAX_EVENTS=1, DOT_FP32=False for the fields without one. The
    descriptors are passed as `launch` passes them (none to a compile without the GEMM phase).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    defaults = {f.name: f.default for f in dataclasses.fields(MegakernelConstants)
                if f.default is not dataclasses.MISSING}
    constants = {**defaults, **dict(STAGES0=3, STAGES1=4, BLOCK_K1=64, USE_TMA=False, TIMELINE=False, MAX_EVENTS=1,
                                    DOT_FP32=False), **constants}
    signature = {f.name: f.metadata["type"] for f in dataclasses.fields(MegakernelArgs)}
    signature.update({name: "constexpr" for name in constants})
    if constants["USE_TMA"] and MegakernelConstants(**constants).runs_gemm:
        bk, bk1 = constants["BLOCK_K"], constants["BLOCK_K1"]
        bn0 = constants["BLOCK_N0"]
        signature["w13_desc"] = (f"tensordesc<bf16[{2 * bn0},{bk}]>" if constants["WIDE_GEMM0"]
                                 else f"tensordesc<bf16[{bn0},1,{bk}]>" if constants["W13_INTERLEAVED"]
                                 else f"tensordesc<bf16[{bn0},{bk}]>")
        signature["w2_desc"] = f"tensordesc<bf16[{constants['BLOCK_N1'] // 2},{bk1}]>"
    else:
        constants.update(w13_desc=None, w2_desc=None)
        signature.update(w13_desc="constexpr", w2_desc="constexpr")
    signature = {name: signature[name] for name in moe_megakernel.arg_names}
    source = ASTSource(fn=moe_megakernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_ptx(constants: dict, capability: int = 90, num_warps: int = 8, num_stages: int = 3) -> str:
    """The PTX of `compile_sm` (same arguments)."""
    return compile_sm(constants, capability, num_warps, num_stages).asm["ptx"]
