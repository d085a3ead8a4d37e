"""``python -m spokefs.wan ...``: the WAN emulator on its own (benchmarks launch it this way)."""

import sys

from spokefs.wan.cli import main

sys.exit(main())
