"""Loaded at start-up by every Python process a test starts (tests/conftest.py puts this folder on
PYTHONPATH): while a test that is not `slow` runs, $DSV4_COMPILE_GUARD_LOG names a file, and each
compile this process makes is appended to it; conftest fails the test when the file is not empty."""

import os

if os.environ.get("DSV4_COMPILE_GUARD_LOG"):
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import guard

    del sys.path[0]

    def _log(what: str, path: str = os.environ["DSV4_COMPILE_GUARD_LOG"]) -> None:
        with open(path, "a") as f:
            f.write(f"pid {os.getpid()}: {what}\n")

    guard.install(_log)
