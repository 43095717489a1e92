"""`python -m weave_moe.bench ARGS` = `weave-moe bench ARGS` (for a checkout without the console script)."""

import sys

from weave_moe.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
