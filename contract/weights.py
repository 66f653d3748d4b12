"""An export's weights as sharded IREE parameter archives (.irpa), written and read torch-free
(numpy + iree.runtime).

Files: ``<prefix>-00001-of-0000N.irpa`` (`artifact.shard_names`, with the other names of the contract),
listed in config.json's ``parameters`` (contract/artifact.py documents those fields); an old export's single ``model.irpa`` reads the same
way. Each archive holds whole tensors under their vmfb keys, each with turbine's metadata
(``PYTORCH:{"type": "Tensor", "dtype": ..., "shape": [...]}``), so turbine's own readers read them too.

Writing (`write_shards`) takes one (name, array, dtype) at a time and streams it to disk: the
archive's data goes first and its entry table and metadata after it, so memory holds one tensor,
never a shard. A shard is closed before a tensor that would take it past `shard_bytes` (`plan_shards`
is the same rule, so the file count is known from the inventory alone); a tensor larger than that
gets a shard of its own. Files appear under their final names only when complete. Given the
inventory, the header (which sits in the first page but depends on every entry) is computed when a
shard opens, so the file is written front to back and its sha256 computed on the way (`digests`:
what config.json records and `dsv4 check` verifies) without reading it back; without the inventory
the header is written last, and no digest is made.

Reading: `open_weights(paths)` maps every key to a read-only uint8 view of the memory-mapped file
(zero copy); `Weights.tensor(name)` views it with its shape and storage dtype (bfloat16 as uint16,
FP8 as uint8). `check_weights` compares archives (or a stream) with the inventory; `check_irpa` checks
a file's structure before IREE sees it. The archive layout is spelled once, below.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .artifact import DTYPES, ExportConfig, TensorSpec, check_vmfb, shard_names, whole_key
from .errors import ArtifactError

__all__ = ["SHARD_BYTES", "check_irpa", "plan_shards", "planned_names", "write_shards", "Weights", "WholeWeights",
           "open_weights", "check_weights", "checked", "storage_dtype", "file_sha256", "verify_export"]

SHARD_BYTES = 2 << 30  # default shard size: a few files for Flash's ~150 GB, each mmap-friendly
Tensor = tuple[str, np.ndarray, str]  # (key, array in the dtype's storage type, dtype name)

# The IREE parameter archive layout (iree/schemas/parameter_archive.h), the one place it is spelled
_MAGIC = 0x41505249  # b"IRPA" little-endian
_HEADER = struct.Struct("<IHHQQQQ" + "QQ" * 3)  # prefix (magic, version 0.0, size, next, flags), count, 3 segments (88)
_ENTRY = struct.Struct("<QIQQQQQQ")  # every entry: size, type, flags, name, metadata, alignment (60)
_DATA_ENTRY = struct.Struct(_ENTRY.format + "QQ")  # a data entry: + its storage range (76)
_TYPE_DATA = 2
_STORAGE_AT = 4096  # the storage segment starts at the first page; entry table and metadata follow it
_DATA_ALIGN = 64  # every tensor's bytes start at a multiple of this (IREE's default)
_META = "PYTORCH:"


def storage_dtype(dtype: str) -> np.dtype:
    """numpy storage type of a DTYPES name (bfloat16 -> uint16, FP8 -> uint8)."""
    try:
        return np.dtype(DTYPES[dtype][0])
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; one of {', '.join(DTYPES)}") from None


def _padded(n: int) -> int:
    return (n + _DATA_ALIGN - 1) // _DATA_ALIGN * _DATA_ALIGN


def plan_shards(sizes: Iterable[int], shard_bytes: int = SHARD_BYTES) -> list[int]:
    """How many tensors of `sizes` (bytes, in write order) each shard takes: a shard is closed before
    a tensor that would take its data past `shard_bytes`."""
    counts: list[int] = []
    used = 0
    for n in sizes:
        if not counts or (counts[-1] and used + n > shard_bytes):
            counts.append(0)
            used = 0
        counts[-1] += 1
        used += _padded(n)
    return counts


def planned_names(specs: Sequence[TensorSpec], prefix: str = "model", shard_bytes: int = SHARD_BYTES) -> list[str]:
    """The file names `write_shards` gives the tensors of `specs` written in that order (what an export
    made without weights lists in config.json)."""
    return shard_names(prefix, len(plan_shards([s.nbytes for s in specs], shard_bytes)))


def _meta(dtype: str, shape: Sequence[int]) -> bytes:
    return f"{_META}{json.dumps({'type': 'Tensor', 'dtype': dtype, 'shape': [int(x) for x in shape]})}".encode()


class _ArchiveWriter:
    """One .irpa: tensor data as it comes, then entry table, metadata and header. With `plan` (the
    shard's TensorSpecs, in the order they will come) the header is known up front, the file is
    written front to back and `sha256` is its digest; without, the header is written last."""

    def __init__(self, path: Path, plan: Sequence[TensorSpec] | None = None):
        self.path = path
        self.f = open(path, "wb")
        self.used = 0  # bytes of the storage segment
        self.entries: list[tuple[bytes, bytes, int, int]] = []  # name, metadata, offset, length
        self.plan = list(plan) if plan is not None else None
        self.hash = hashlib.sha256() if plan is not None else None
        head = self._header([(s.name.encode(), _meta(s.dtype, s.shape), s.nbytes) for s in self.plan]) \
            if self.plan is not None else bytes(_HEADER.size)
        self._write(head + bytes(_STORAGE_AT - len(head)))

    def _write(self, b: bytes | memoryview) -> None:
        self.f.write(b)
        if self.hash is not None:
            self.hash.update(b)

    @staticmethod
    def _header(entries: Sequence[tuple[bytes, bytes, int]]) -> bytes:
        """The header of an archive of `entries` (name, metadata, data length) in that order."""
        used = 0
        for _, _, n in entries:
            used = _padded(used) + n
        table_at = _STORAGE_AT + _padded(used)
        table_len = len(entries) * _padded16(_DATA_ENTRY.size)
        meta_len = sum(len(name) + len(md) for name, md, _ in entries)
        return _HEADER.pack(_MAGIC, 0, 0, _HEADER.size, 0, 0, len(entries), table_at, table_len,
                            table_at + table_len, meta_len, _STORAGE_AT, used)

    @property
    def full(self) -> bool:
        """Every tensor of the plan is in (always False without a plan)."""
        return self.plan is not None and len(self.entries) == len(self.plan)

    def add(self, name: str, data: np.ndarray, dtype: str) -> None:
        if self.plan is not None:
            want = self.plan[len(self.entries)] if len(self.entries) < len(self.plan) else None
            if want is None or want.name != name:
                raise ValueError(f"{name} came out of the inventory's order (expected "
                                 f"{want.name if want else 'no more tensors'} in {self.path.name})")
        meta = _meta(dtype, data.shape)
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if self.plan is not None and (meta, flat.nbytes) != (_meta(want.dtype, want.shape), want.nbytes):
            raise ValueError(f"{name}: got {dtype} {list(data.shape)}, the inventory says {want.dtype} "
                             f"{list(want.shape)}")
        pad = _padded(self.used) - self.used
        if pad:
            self._write(bytes(pad))
            self.used += pad
        self._write(flat.data)
        self.entries.append((name.encode(), meta, self.used, flat.nbytes))
        self.used += flat.nbytes

    def close(self) -> str | None:
        """Finish the file; returns its sha256 (hex) when it was written with a plan."""
        if self.plan is not None and not self.full:
            raise ValueError(f"{self.path.name}: {len(self.plan) - len(self.entries)} tensor(s) of its plan never came")
        table, meta = bytearray(), bytearray()
        for name, md, off, length in self.entries:
            entry = _DATA_ENTRY.pack(_DATA_ENTRY.size, _TYPE_DATA, 0, len(meta), len(name), len(meta) + len(name),
                                     len(md), _DATA_ALIGN, off, length)
            table += entry + bytes(-len(entry) % 16)
            meta += name + md
        table_at = _STORAGE_AT + _padded(self.used)
        self._write(bytes(table_at - _STORAGE_AT - self.used))
        self._write(bytes(table))
        self._write(bytes(meta))
        end = table_at + len(table) + len(meta)
        self._write(bytes(-end % 4096))  # whole pages, as IREE's own writer leaves them
        if self.plan is None:
            self.f.seek(0)
            self.f.write(self._header([(n, md, ln) for n, md, _, ln in self.entries]))
        self.f.close()
        return None if self.hash is None else self.hash.hexdigest()

    def abort(self) -> None:
        self.f.close()
        self.path.unlink(missing_ok=True)


def _padded16(n: int) -> int:
    return -(-n // 16) * 16


def write_shards(out_dir: str | os.PathLike, tensors: Iterable[Tensor], prefix: str = "model",
                 shard_bytes: int = SHARD_BYTES, *, names: Sequence[str] | None = None,
                 progress: Callable[[str], None] | None = None, total_bytes: int | None = None,
                 inventory: Sequence[TensorSpec] | None = None, digests: dict[str, str] | None = None) -> list[str]:
    """Write `tensors` ((key, array, dtype name) one at a time) into .irpa shards in `out_dir`;
    returns the file names, ``prefix-0000i-of-0000n.irpa`` unless `names` gives them (their count
    must then be the number of shards written). Existing files of those names are replaced.
    `progress` gets a line per shard and every ~10 s (GB written, of `total_bytes` when given).
    With `inventory` (the TensorSpecs in the order the tensors come; ValueError otherwise) each
    file's sha256 is computed as it is written and put in `digests` (file name -> hex)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[Path] = []
    sums: list[str | None] = []
    w: _ArchiveWriter | None = None
    t0 = last = time.perf_counter()
    done = 0
    log = progress or (lambda s: None)
    plans: list[list[TensorSpec]] = []
    if inventory is not None:
        at = 0
        for n in plan_shards([s.nbytes for s in inventory], shard_bytes):
            plans.append(list(inventory[at:at + n]))
            at += n

    def status() -> str:
        of = f" of {total_bytes / 1e9:.2f}" if total_bytes else ""
        return f"{done / 1e9:.2f}{of} GB written, {time.perf_counter() - t0:.0f} s"

    def open_next() -> _ArchiveWriter:
        if inventory is not None and len(parts) >= max(len(plans), 1):
            raise ValueError(f"more tensors than the inventory's {len(inventory)}")
        parts.append(out / f".{prefix}-{len(parts) + 1:05d}.irpa.partial")
        return _ArchiveWriter(parts[-1], plans[len(parts) - 1] if plans else [] if inventory is not None else None)

    try:
        for name, arr, dtype in tensors:
            if not isinstance(arr, np.ndarray) or arr.dtype.itemsize != storage_dtype(dtype).itemsize:
                raise ValueError(f"{name}: expected a numpy array stored as {storage_dtype(dtype)} for {dtype}, "
                                 f"got {getattr(arr, 'dtype', type(arr).__name__)}")
            if w is None or (w.full if inventory is not None else
                             (w.entries and _padded(w.used) + arr.nbytes > shard_bytes)):
                if w is not None:
                    sums.append(w.close())
                    log(f"  shard {len(parts)} closed ({w.used / 1e9:.2f} GB); {status()}")
                w = open_next()
            w.add(name, arr, dtype)
            done += arr.nbytes
            del arr  # so the next tensor is made while this one is already freed
            if time.perf_counter() - last > 10:
                last = time.perf_counter()
                log(f"  {status()}")
        if w is None:  # no tensors at all: one empty archive, so the export still names a file
            w = open_next()
        sums.append(w.close())
        w = None
    except BaseException:
        if w is not None:
            w.abort()
        for p in parts:
            p.unlink(missing_ok=True)
        raise
    final = list(names) if names is not None else shard_names(prefix, len(parts))
    if len(final) != len(parts):
        for p in parts:
            p.unlink(missing_ok=True)
        raise ValueError(f"the weights took {len(parts)} shard(s) of at most {shard_bytes} bytes, but "
                         f"{len(final)} file name(s) were given ({', '.join(final)})")
    for p, f, h in zip(parts, final, sums):
        p.replace(out / f)
        if digests is not None and h is not None:
            digests[f] = h
    log(f"wrote {len(final)} file(s) to {out}: {status()}")
    return final


def check_irpa(path: str | os.PathLike) -> int:
    """Check that `path` is a complete IREE parameter archive (header, entry table, and every data
    entry inside the file); returns the number of entries. ArtifactError naming the file otherwise
    (a truncated download is named here instead of crashing inside the runtime)."""
    p = Path(path)

    def bad(msg: str) -> ArtifactError:
        return ArtifactError(f"{p}: {msg} (re-export or re-download it)")

    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size:
                raise bad(f"not an IREE parameter archive ({size} bytes, too short for its header)")
            (magic, major, _minor, _hsize, _next, _flags, count, e_off, e_len, m_off, m_len,
             s_off, s_len) = _HEADER.unpack(head)
            if magic != _MAGIC:
                raise bad("not an IREE parameter archive (no IRPA magic)")
            if major != 0:
                raise bad(f"parameter archive version {major} is not supported (this runtime reads 0)")
            for name, off, ln in (("entry", e_off, e_len), ("metadata", m_off, m_len), ("storage", s_off, s_len)):
                if off + ln > size:
                    raise bad(f"truncated: the {name} segment ends at byte {off + ln}, the file has {size}")
            f.seek(e_off)
            table = f.read(e_len)
    except OSError as e:
        raise ArtifactError(f"{p}: cannot read: {e.strerror or e}") from None
    at = 0
    for i in range(count):
        if at + _ENTRY.size > len(table):
            raise bad(f"entry table holds fewer than its {count} entries")
        esize, etype, _f, n_off, n_len, md_off, md_len, _al = _ENTRY.unpack_from(table, at)
        if n_off + n_len > m_len or md_off + md_len > m_len or esize < _ENTRY.size:
            raise bad(f"entry {i} is malformed")
        if etype == _TYPE_DATA:
            if esize < _DATA_ENTRY.size or at + _DATA_ENTRY.size > len(table):
                raise bad(f"entry {i} is malformed")
            st_off, st_len = _DATA_ENTRY.unpack_from(table, at)[-2:]
            if st_off + st_len > s_len:
                raise bad(f"truncated: entry {i}'s data ends at byte {s_off + st_off + st_len}, the file has {size}")
        at += (esize + 15) // 16 * 16
    return count


class Weights(Mapping[str, np.ndarray]):
    """The parameters of one or more .irpa files: key -> read-only uint8 view of the memory map.

    The views stay valid while this object lives. `tensor(key)` gives the typed view, `spec(key)`
    the (shape, dtype) recorded in the archive (None for an entry without turbine metadata),
    `file_of(key)` the file that holds it."""

    def __init__(self, paths: Sequence[str | os.PathLike]):
        import iree.runtime as rt

        self.paths = [Path(p) for p in paths]
        self._indices = []
        self._entries: dict[str, Any] = {}
        self._files: dict[str, Path] = {}
        for p in self.paths:
            check_irpa(p)
            idx = rt.ParameterIndex()
            try:
                idx.load(str(p))
            except (RuntimeError, ValueError, OSError) as e:
                raise ArtifactError(f"{p}: cannot load the parameter archive: {e}") from None
            self._indices.append(idx)
            for key, e in idx.items():
                if key in self._entries:
                    raise ArtifactError(f"{p}: parameter {key} is also in {self._files[key].name}")
                if not e.is_file:
                    raise ArtifactError(f"{p}: parameter {key} holds no data (a splat entry)")
                self._entries[key] = e
                self._files[key] = p

    def __getitem__(self, key: str) -> np.ndarray:
        return np.frombuffer(self._entries[key].file_view, dtype=np.uint8)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self, key: str) -> int:
        return int(self._entries[key].length)

    def file_of(self, key: str) -> Path:
        return self._files[key]

    def spec(self, key: str) -> tuple[tuple[int, ...], str] | None:
        meta = bytes(self._entries[key].metadata).decode("utf-8", "replace")
        if not meta.startswith(_META):
            return None
        d = json.loads(meta[len(_META):])
        return tuple(int(x) for x in d["shape"]), str(d["dtype"])

    def tensor(self, key: str, shape: Sequence[int] | None = None, dtype: str | None = None) -> np.ndarray:
        """The entry viewed as `shape` in `dtype`'s storage type (from the archive's metadata when not
        given); ArtifactError when the byte size or the recorded shape/dtype disagree."""
        where = self._files[key]
        rec = self.spec(key)
        if shape is None or dtype is None:
            if rec is None:
                raise ArtifactError(f"{where}: {key} has no shape/dtype metadata; pass them")
            shape, dtype = shape if shape is not None else rec[0], dtype or rec[1]
        shape = tuple(int(x) for x in shape)
        if rec is not None and rec != (shape, dtype):
            raise ArtifactError(f"{where}: {key} is {rec[1]} {list(rec[0])}, expected {dtype} {list(shape)}")
        spec = TensorSpec(key, shape, dtype)
        if self.nbytes(key) != spec.nbytes:
            raise ArtifactError(f"{where}: {key} has {self.nbytes(key)} bytes, {dtype} {list(shape)} needs {spec.nbytes}")
        return self[key].view(storage_dtype(dtype)).reshape(shape)


class WholeWeights(Mapping[str, np.ndarray]):
    """The weights of an n-device export as whole tensors (the per-device shards of a cut tensor,
    artifact.SHARD_SPLITS, concatenated along dim 0 on read); the same calls as `Weights`."""

    def __init__(self, weights: Weights, n: int):
        self.weights = weights
        self._parts: dict[str, list[str]] = {}
        for key in weights:
            wk = whole_key(key) if n > 1 else None
            self._parts.setdefault(key if wk is None else wk[0], []).append(key)
        for whole, parts in self._parts.items():
            parts.sort(key=lambda k: (whole_key(k) or (k, 0))[1])
            if len(parts) != (n if whole_key(parts[0]) else 1):
                raise ArtifactError(f"{whole}: {len(parts)} of its {n} per-device parts are in the weight files")

    def __getitem__(self, key: str) -> np.ndarray:
        parts = self._parts[key]
        return self.weights[parts[0]] if len(parts) == 1 else np.concatenate([self.weights[k] for k in parts])

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def nbytes(self, key: str) -> int:
        return sum(self.weights.nbytes(k) for k in self._parts[key])

    def file_of(self, key: str) -> Path:
        return self.weights.file_of(self._parts[key][0])

    def spec(self, key: str) -> tuple[tuple[int, ...], str] | None:
        parts = self._parts[key]
        rec = self.weights.spec(parts[0])
        return None if rec is None else ((rec[0][0] * len(parts), *rec[0][1:]), rec[1])


def open_weights(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> Weights:
    """Memory-map .irpa file(s); see `Weights`."""
    return Weights([paths] if isinstance(paths, (str, os.PathLike)) else list(paths))


def check_weights(found: Mapping[str, int], specs: Sequence[TensorSpec]) -> list[str]:
    """Problems of archives holding {key: bytes} against the inventory: missing, extra, wrong size."""
    problems = []
    want = {s.name: s for s in specs}
    for s in specs:
        n = found.get(s.name)
        if n is None:
            problems.append(f"missing: {s.name} ({s.dtype} {list(s.shape)})")
        elif n != s.nbytes:
            problems.append(f"size: {s.name} has {n} bytes, {s.dtype} {list(s.shape)} needs {s.nbytes}")
    problems += [f"extra: {k} is not in config.json's weights" for k in found if k not in want]
    return problems


def checked(tensors: Iterable[Tensor], specs: Sequence[TensorSpec]) -> Iterator[Tensor]:
    """Pass `tensors` through, checking each against the inventory (name, shape, dtype) and, at the
    end, that every tensor of it came; ValueError naming the first problem."""
    want = {s.name: s for s in specs}
    seen: set[str] = set()
    for name, arr, dtype in tensors:
        s = want.get(name)
        if s is None:
            raise ValueError(f"{name} is not in the weights inventory")
        if name in seen:
            raise ValueError(f"{name} came twice")
        if (tuple(arr.shape), dtype) != (s.shape, s.dtype) or arr.dtype.itemsize != storage_dtype(dtype).itemsize:
            raise ValueError(f"{name}: got {dtype} {list(arr.shape)}, the inventory says {s.dtype} {list(s.shape)}")
        seen.add(name)
        yield name, arr, dtype
    missing = [s.name for s in specs if s.name not in seen]
    if missing:
        raise ValueError(f"{len(missing)} tensor(s) of the inventory never came, e.g. {', '.join(missing[:3])}")


def file_sha256(path: str | os.PathLike, progress: Callable[[int], None] | None = None,
                chunk: int = 16 << 20) -> str:
    """The sha256 (hex) of a file, read in `chunk`-byte pieces; `progress(bytes so far)` after each."""
    h, done = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            done += len(block)
            if progress is not None:
                progress(done)
    return h.hexdigest()


def verify_export(export_dir: str | os.PathLike, progress: Callable[[str], None] | None = None) -> list[str]:
    """Check every file of an export: config.json, each weight file's structure and the sha256 that
    config.json records for it, each vmfb's structure, the tokenizer. Returns one line per problem
    (none: all good); a weight file without a recorded sha256 is a problem (its bytes are unverified).
    `progress` gets a line per file and every ~10 s while a large file is hashed."""
    d = Path(export_dir)
    log = progress or (lambda s: None)
    try:
        cfg = ExportConfig.load(d, weights=False)
    except ArtifactError as e:
        return [str(e)]
    problems: list[str] = []
    weights = list(dict.fromkeys(f for g in cfg.weight_groups() for f in g.files))
    total = sum(f.stat().st_size for f in weights if f.is_file())
    done, t0 = 0, time.perf_counter()
    for i, f in enumerate(weights, 1):
        if not f.is_file():
            problems.append(f"{f}: missing (`dsv4 weights random {d}` writes random weights for an export made "
                            "with --no-weights)")
            continue
        size = f.stat().st_size
        log(f"[{i}/{len(weights)}] {f.name} ({size / 1e9:.2f} GB) ...")
        try:
            check_irpa(f)
        except ArtifactError as e:
            problems.append(str(e))
            done += size
            continue
        last = [time.perf_counter()]

        def tick(n: int) -> None:
            if time.perf_counter() - last[0] > 10:
                last[0] = time.perf_counter()
                log(f"  {(done + n) / 1e9:.2f} of {total / 1e9:.2f} GB hashed, {time.perf_counter() - t0:.0f} s")

        want = cfg.sha256.get(f.name)
        if want is None:
            problems.append(f"{f}: no sha256 recorded in config.json (an export made before checksums, or weights "
                            "written by other means): its structure is fine, its bytes cannot be verified")
        elif file_sha256(f, tick) != want:
            problems.append(f"{f}: sha256 differs from the one config.json records: the file is corrupt "
                            "(re-copy or re-export it)")
        done += size
    for t, info in cfg.targets.items():
        for v in info.get("stages", [info["vmfb"]]):
            log(f"{v} ({t}) ...")
            try:
                check_vmfb(d / v)  # names a missing file too ("cannot read")
            except ArtifactError as e:
                problems.append(str(e))
    if cfg.tokenizer is not None and not cfg.tokenizer.is_file():
        problems.append(f"{cfg.tokenizer}: missing")
    return problems

