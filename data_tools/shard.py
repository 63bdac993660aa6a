"""`python -m data_tools.shard ...`: the shard-writing command line (see data_tools.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m data_tools.shard"))
