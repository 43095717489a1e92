"""weave_moe.backends.weave.kernels"""
