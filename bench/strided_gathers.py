"""Find the dispatches that gather (`tensor.extract` at computed indices) from a strided slice of a
binding: the pattern IREE 3.13's GPU codegen compiles with the slice's own strides instead of the
binding's (bench/slot_gather.py shows the wrong reads; docs/performance.md, session 21).

    iree-compile model.mlir <the export's flags> --compile-to=executable-sources \\
        --iree-hal-dump-executable-sources-to=SRC -o /dev/null
    python bench/strided_gathers.py SRC

Prints each such dispatch with its load; exits 1 when there is one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LOAD = re.compile(r"(%[\w.]+) = iree_tensor_ext\.dispatch\.tensor\.load %[\w.]+, offsets = \[([^\]]*)\], "
                  r"sizes = \[([^\]]*)\], strides = \[[^\]]*\] : !iree_tensor_ext\.dispatch\.tensor<readonly:tensor<([^>]*)>>"
                  r"(?:\{([^}]*)\})?")


def _dims(shape: str, dynamic: str | None) -> list[str]:
    """"64x?x16xbf16" with dynamic "%7" -> ["64", "%7", "16"]: a dynamic dim named by its SSA value."""
    dyn = iter(d.strip() for d in (dynamic or "").split(",") if d.strip())
    return [next(dyn, "?") if d == "?" else d for d in shape.split("x")[:-1]]


def contiguous(sizes: list[str], full: list[str]) -> bool:
    """A slice is one contiguous block when, after its outermost partial dim, every dim is whole
    (and before it every dim has size 1)."""
    partial = [i for i, (s, f) in enumerate(zip(sizes, full)) if s != f]
    if not partial:
        return True
    p = partial[0]
    return all(sizes[i] == "1" for i in range(p)) and all(sizes[i] == full[i] for i in range(p + 1, len(full)))


def scan(src: Path) -> list[str]:
    found = []
    for f in sorted(src.glob("*.mlir")):
        text = f.read_text()
        for m in LOAD.finditer(text):
            name, offs, sizes, shape, dynamic = m.groups()
            offs, sizes, full = ([o.strip() for o in offs.split(",")], [s.strip() for s in sizes.split(",")],
                                 _dims(shape, dynamic))
            if contiguous(sizes, full):
                continue
            if re.search(rf"tensor\.extract {re.escape(name)}\[", text):
                found.append(f"{f.stem}: offsets [{', '.join(offs)}] sizes [{', '.join(sizes)}] of tensor<{shape}>")
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    found = scan(Path(argv[0]))
    for line in found:
        print(line)
    print(f"{len(found)} dispatch(es) gather from a strided slice of a binding")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
