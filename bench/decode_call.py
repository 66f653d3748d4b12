"""Superseded by `dsv4 bench` (decode ms/step per exported batch size, plus the per-dispatch profile on
cuda); kept as a thin wrapper: `python bench/decode_call.py OUT --device cuda` = `dsv4 bench OUT --device cuda`.
"""

import sys

from dsv4.runtime.bench import main

if __name__ == "__main__":
    sys.exit(main())
