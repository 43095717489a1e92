"""Compile a Triton kernel for Hopper (sm_90) without a GPU, specialised exactly as a launch with given arguments
would be: what the CPU tests and CI use to read the PTX, registers, spills and shared memory of the kernels that run.
"""

from __future__ import annotations

import triton

__all__ = ["specialize_for_sm90", "compile_for_sm90", "ptxas_report"]


def specialize_for_sm90(kernel, args, kwargs, capability: int = 90):
    """(ASTSource, target, options) of `kernel` launched with these arguments, without a GPU: the same steps as
    Triton's JITFunction.run (its binder computes each argument's specialisation: pointer alignment and integer
    divisibility by 16 as "tt.divisibility" attrs, tensor descriptor types from the host TensorDescriptors,
    constexprs; then `_pack_args`), for target sm_<capability>."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    if kernel.is_gluon():   # a Gluon kernel (kernels/ws_gemm.py) starts from its own IR builder
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource(kernel, signature, constexprs, attrs), target, options
    return ASTSource(kernel, signature, constexprs, attrs), target, options


def compile_for_sm90(kernel, args, kwargs, capability: int = 90):
    """Compile `kernel` for sm_<capability> without a GPU, specialised exactly as a launch with these arguments
    would be (`specialize_for_sm90`); returns triton's CompiledKernel (its .asm["ptx"], .n_regs, .n_spills need no GPU
    except n_regs, which is filled in at load time)."""
    source, target, options = specialize_for_sm90(kernel, args, kwargs, capability)
    return triton.compile(source, target=target, options=options.__dict__)


def ptxas_report(ptx: str, directory) -> str:
    """ptxas -v's report (registers, stack frame, spills) of `ptx` assembled for sm_90a in `directory` (a
    pathlib.Path); RuntimeError with its output when ptxas fails."""
    import subprocess

    from triton import knobs

    path = directory / "kernel.ptx"
    path.write_text(ptx)
    result = subprocess.run([knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", str(path), "-o", str(directory / "k.o")],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ptxas failed: {result.stderr[-2000:]}")
    return result.stderr
