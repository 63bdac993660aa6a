"""`python -m data_tools ...`: the shard-writing command line (see data_tools.cli)."""

import sys

from .cli import main

sys.exit(main())
