"""Static screen of IREE's scheduled concurrent regions: pairs of commands inside one
stream.cmd.concurrent whose byte ranges of one resource overlap, at least one of them writing.

    iree-compile MODEL.mlir <target flags> --compile-to=executable-sources -o sched.mlir
    python bench/stream_hazards.py sched.mlir

Each dispatch's ranges come from its executable's binding subspans: offset (a constant, or a push
constant the command passes, through index_castui / util.assume.int) and the binding's static size;
copies and fills carry theirs. "unknown" rows have an offset or size this parser could not resolve.
Session 12 ran it on the Flash-4 decode probe (default partitioning, cuda): 172 regions, 513 commands,
no overlapping pair; lengthening one copy of that schedule by 104 bytes makes it report the copy
against the dispatch it then overlaps (docs/real-size.md).
"""
import re, sys
from collections import defaultdict

text = open(sys.argv[1]).read()
lines = text.split("\n")
DT = {"i1": 1, "i4": 0.5, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "f8E4M3FN": 1, "f8E4M3FNUZ": 1}

def cval(name):
    m = re.match(r"%c(\d+)(?:_i\d+|_\d+)*$", name)
    return int(m.group(1)) if m else None

# --- executables: per function, each binding's (offset expr, bytes, access)
funcs = {}
cur = None
for ln in lines:
    m = re.match(r"\s*func.func @(\S+)\(\)", ln)
    if m:
        cur = {"ssa": {}, "subspans": []}
        funcs[m.group(1)] = cur
        continue
    if cur is None:
        continue
    m = re.match(r"\s*(%\w+) = arith.constant (\d+) : index", ln)
    if m:
        cur["ssa"][m.group(1)] = ("const", int(m.group(2)))
    m = re.match(r"\s*(%\w+) = hal.interface.constant.load .* ordinal\((\d+)\)", ln)
    if m:
        cur["ssa"][m.group(1)] = ("pc", int(m.group(2)))
    m = re.match(r"\s*(%\w+) = arith.index_cast(?:ui)? (%\w+) ", ln)
    if m and m.group(2) in cur["ssa"]:
        cur["ssa"][m.group(1)] = cur["ssa"][m.group(2)]
    m = re.match(r"\s*(%\w+) = util.assume.int (%\w+)\[", ln)
    if m:
        cur["ssa"][m.group(1)] = cur["ssa"].get(m.group(2), ("?", None))
        continue
    m = re.match(r"\s*(%\w+)(?::(\d+))? = util.assume.int\s*$", ln)
    if m:
        cur["assume"] = (m.group(1), [])
        continue
    if "assume" in cur:
        m = re.match(r"\s*(%\w+)\[", ln)
        if m:
            base, lst = cur["assume"]
            cur["ssa"][f"{base}#{len(lst)}"] = cur["ssa"].get(m.group(1), ("?", None))
            lst.append(m.group(1))
            if ": index" in ln:
                del cur["assume"]
            continue
        if ": index" in ln:
            del cur["assume"]
    m = re.search(r"binding\((\d+)\) alignment\(\d+\) offset\((%[\w#]+)\).*dispatch.tensor<(\w+):tensor<([^>]*)>>", ln)
    if m:
        shape = m.group(4).split("x")
        dt, dims = shape[-1], shape[:-1]
        n = None if any(d == "?" for d in dims) else 1
        if n is not None:
            for d in dims:
                n *= int(d)
            n = int(n * DT.get(dt, 4))
        cur["subspans"].append((int(m.group(1)), cur["ssa"].get(m.group(2), ("?", None)), n, m.group(3)))

# --- the scheduled commands, with their concurrent-region nesting
regions, stack, cmd, n_cmd = [], [], None, 0
def flush():
    global cmd
    if cmd is not None:
        (stack[-1] if stack else []).append(cmd)
        cmd = None
for i, ln in enumerate(lines):
    s = ln.strip()
    if s.startswith("stream.cmd.concurrent {"):
        flush(); stack.append([]); continue
    m = re.match(r"stream.cmd.dispatch @[^:]+::@[^:]+::@(\S+?)(?:\((.*?) : [^)]*\))? \{", s)
    if m:
        flush()
        pcs = [cval(x.strip()) for x in m.group(2).split(",")] if m.group(2) else []
        cmd = {"line": i + 1, "name": m.group(1), "pcs": pcs, "bind": []}
        continue
    if cmd is not None:
        m = re.match(r"(ro|wo|rw) (%\w+)\[", s)
        if m:
            cmd["bind"].append((m.group(1), m.group(2)))
            continue
        if s == "}":
            flush(); continue
    m = re.match(r"stream.cmd.copy (%\w+)\[(%\w+)\], (%\w+)\[(%\w+)\], (%\w+)", s)
    if m:
        flush()
        L = cval(m.group(5))
        c = {"line": i + 1, "name": "copy", "ranges": [(m.group(1), cval(m.group(2)), L, "r"), (m.group(3), cval(m.group(4)), L, "w")]}
        (stack[-1] if stack else []).append(c); continue
    m = re.match(r"stream.cmd.fill %\w+, (%\w+)\[(%\w+) for (%\w+)\]", s)
    if m:
        flush()
        c = {"line": i + 1, "name": "fill", "ranges": [(m.group(1), cval(m.group(2)), cval(m.group(3)), "w")]}
        (stack[-1] if stack else []).append(c); continue
    if s == "}" and stack and cmd is None:
        regions.append(stack.pop())

def ranges(c):
    if "ranges" in c:
        return c["ranges"]
    f = funcs.get(c["name"])
    out = []
    for b, off, n, acc in (f["subspans"] if f else []):
        if b >= len(c["bind"]):
            continue
        mode, res = c["bind"][b]
        kind, v = off
        start = v if kind == "const" else (c["pcs"][v] if kind == "pc" and v < len(c["pcs"]) else None)
        w = "w" if acc in ("writeonly", "readwrite") else "r"
        out.append((res, start, n, w))
    return out

bad = 0
for reg in regions:
    rs = [(c, ranges(c)) for c in reg]
    for a in range(len(rs)):
        for b in range(a + 1, len(rs)):
            for (ra, sa, na, wa) in rs[a][1]:
                for (rb, sb, nb, wb) in rs[b][1]:
                    if ra != rb or "w" not in (wa + wb):
                        continue
                    if None in (sa, na, sb, nb):
                        overlap = "unknown"
                    elif sa < sb + nb and sb < sa + na:
                        overlap = "yes"
                    else:
                        continue
                    bad += 1
                    print(f"{overlap}: {rs[a][0]['name']} (line {rs[a][0]['line']}) {wa} {ra}[{sa}+{na}]  vs  "
                          f"{rs[b][0]['name']} (line {rs[b][0]['line']}) {wb} {rb}[{sb}+{nb}]")
print(f"{len(regions)} concurrent regions, {sum(len(r) for r in regions)} commands in them, {bad} overlapping pairs")
