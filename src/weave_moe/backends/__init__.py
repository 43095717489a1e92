"""weave_moe.backends"""
