"""weave_moe.kernels"""
