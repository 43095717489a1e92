"""Sub-commands of `weave-moe` (see weave_moe.cli)."""
