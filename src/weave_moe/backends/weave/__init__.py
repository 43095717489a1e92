"""The weave backend: one persistent Triton megakernel per GPU (see backend.py for one call's steps)."""

from weave_moe.backends.weave.backend import KernelConfig, WeaveBackend, WeaveError, WeaveTimeoutError

__all__ = ["WeaveBackend", "WeaveError", "WeaveTimeoutError", "KernelConfig"]
