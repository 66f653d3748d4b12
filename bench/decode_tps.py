"""Superseded by `dsv4 bench` (dsv4/runtime/bench.py holds the timing code); kept as a thin wrapper.

    python bench/decode_tps.py OUT [--device cuda] [--batch 1,4] [--compare torch-eager]   # = dsv4 bench ...
"""

import sys

from dsv4.runtime.bench import main

if __name__ == "__main__":
    sys.exit(main())
