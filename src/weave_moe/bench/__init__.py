"""weave_moe.bench"""
