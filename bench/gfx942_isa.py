"""Count the matrix-core and FMA instructions in a gfx942 vmfb (a static report: no AMD GPU needed).

    python -m dsv4.bench.gfx942_isa OUT/model.gfx942.vmfb [more.vmfb ...]

Disassembles every HSACO code object inside the vmfb with llvm-objdump-19 (Debian: apt-get install
llvm-19) and prints, per file: kernels (the `.kd` descriptors), v_mfma_* by kind, v_fma_f32 and
v_fmac_f32 (the f32 FMAs of non-matrix GEMMs), v_cvt_pk_f32_fp8 (hardware fp8 -> f32), v_dot*.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

_PATTERN = re.compile(r"\b(v_mfma_\w+|v_fma_f32|v_fmac_f32|v_cvt_pk_f32_fp8|v_dot\w+)")


def disassemble(vmfb: Path) -> str:
    tool = shutil.which("llvm-objdump-19") or shutil.which("llvm-objdump-20")
    if tool is None:
        raise SystemExit("llvm-objdump-19 not found (apt-get install -y llvm-19)")
    out = []
    with zipfile.ZipFile(vmfb) as z, tempfile.TemporaryDirectory() as tmp:
        for i, member in enumerate(z.namelist()):
            data = z.read(member)
            at = data.find(b"\x7fELF")
            if "hsaco" not in member or at < 0:
                continue
            elf = Path(tmp) / f"{i}.elf"
            elf.write_bytes(data[at:])
            res = subprocess.run([tool, "-d", "--triple=amdgcn-amd-amdhsa", "--mcpu=gfx942", str(elf)],
                                 capture_output=True, text=True, check=True)
            syms = subprocess.run([tool, "-t", str(elf)], capture_output=True, text=True, check=True)
            out.append(res.stdout + "\n" + "\n".join(ln for ln in syms.stdout.splitlines() if ln.endswith(".kd")))
    return "\n".join(out)


def counts(vmfb: Path) -> dict[str, int]:
    text = disassemble(vmfb)
    c = collections.Counter(m.group(1) for m in _PATTERN.finditer(text))
    c["kernels"] = sum(1 for ln in text.splitlines() if ln.endswith(".kd"))
    return dict(c)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dsv4.bench.gfx942_isa",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("vmfb", nargs="+", help="gfx942 vmfb files (one column each)")
    argv = ap.parse_args(argv).vmfb
    rows = {p: counts(Path(p)) for p in argv}
    keys = sorted({k for c in rows.values() for k in c}, key=lambda k: (k != "kernels", k))
    print("instruction".ljust(34) + "".join(Path(p).parent.name[-18:].rjust(20) for p in argv))
    for k in keys:
        print(k.ljust(34) + "".join(str(rows[p].get(k, 0)).rjust(20) for p in argv))


if __name__ == "__main__":
    main()
