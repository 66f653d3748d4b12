"""Shared test fixtures: the one-thread switch, the cache of exported models, and the slow rule.

Exports take minutes on 2 cores, so each export fixture builds once and caches the result under
`.cache/<tag>-<key>/`, the key hashing graph_sources() (every file that shapes an exported graph or
its parameters), the fixture's own key parts (config, export arguments, weights) and the compiler
version. `cached_export` is the only export cache of the suite; no environment variable points a
test at a prebuilt export. Delete `.cache/` to force fresh exports.

The slow rule: `pytest -m "not slow"` is the fast tier, plain `pytest` (`make test`) runs all.
* A test is `slow` when a fixture it uses (directly or through other fixtures) calls cached_export,
  export_model or compile_mlir (found in the fixtures' source at collection), or when it says so.
* Everything else runs under tests/compile_guard/guard.py: a compile of any kind (iree-compile
  process, in-process compiler, cached_export) in a test not marked slow fails it with "this test
  compiles: mark it slow", in the pytest process at the call and in a child process the test
  started when the test ends. The allowances, each explicit and for seconds of compiling:
  compile_small (the `kernel_compile` fixture: one small module per call, cached under
  .cache/kernels/), the export's target preflight, and a test marked `small_compile` (a few-line
  function, eager turbine kernels) whose subject is the compile itself."""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import json
import os
import re
import shutil
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
import torch

from compile_guard import guard as compile_guard

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # a worker of `make test`: its share of the cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def graph_sources() -> list[Path]:
    """Every file that can change an exported graph or its parameters: the model package (the
    checkpoint loaders included, minus its assets), the exporter and the contract (config.json and the .irpa
    shards), Python and MLIR templates."""
    files = []
    for top in ("contract", "model", "export"):
        for f in (REPO / top).rglob("*"):
            rel = f.relative_to(REPO)
            if (f.suffix == ".py" or ".mlir" in f.name) and "assets" not in rel.parts and "__pycache__" not in rel.parts:
                files.append(f)
    return sorted(files)


def export_key(key_parts: Iterable[Any]) -> str:
    import iree.compiler

    h = hashlib.sha256()
    for f in graph_sources():
        h.update(f.relative_to(REPO).as_posix().encode())
        h.update(f.read_bytes())
    for part in key_parts:
        if isinstance(part, Path):  # a weights/tokenizer file: its bytes
            h.update(part.name.encode())
            h.update(part.read_bytes())
        else:
            h.update(json.dumps(part, sort_keys=True, default=repr).encode())
    # the toolchain: the compiler, and the tracer (torch.export, iree-turbine) that makes the MLIR
    from importlib.metadata import version

    h.update(json.dumps([str(getattr(iree.compiler, "__version__", "")), version("iree-base-compiler"),
                         version("iree-turbine"), torch.__version__]).encode())
    return h.hexdigest()[:16]


def cached_export(tag: str, build: Callable[[Path], Any], key_parts: Iterable[Any]) -> Path:
    """`.cache/<tag>-<key>`, made by `build(directory)` (an export_model call) when missing.
    A test that gets an export is slow even when the cache holds it: a fresh clone builds it."""
    compile_guard.compiling(f"cached_export({tag!r})")
    cache = REPO / ".cache" / f"{tag}-{export_key(key_parts)}"
    cache.parent.mkdir(parents=True, exist_ok=True)
    # one builder per export: a second pytest worker asking for it waits here, then reads it
    with open(cache.with_name(cache.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=cache.parent))
            try:
                build(tmp)
                if cache.exists():
                    shutil.rmtree(cache)
                tmp.rename(cache)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return cache


# ---- the slow rule ----------------------------------------------------------------------------

# a fixture whose source calls one of these builds an export or compiles: its tests are slow
_COMPILING_CALL = re.compile(r"\b(cached_export|export_model|compile_mlir|compile_str|compile_file)\(")
_GUARD_SITE = Path(__file__).resolve().parent / "compile_guard"
_current: dict[str, Any] = {"item": None, "compiles": []}


def _fixture_compiles(fixturedef: Any) -> bool:
    if fixturedef.argname == "kernel_compile":  # the allowance
        return False
    try:
        src = inspect.getsource(fixturedef.func)
    except (OSError, TypeError):
        return False
    return bool(_COMPILING_CALL.search(src))


# ---- distributing the tests over pytest-xdist workers (`make test`) -----------------------------
# Under `pytest -n N` the tests run in work units, each on one worker from start to end: the modules
# that read one session-wide export form its unit (the export is built once, by the worker that runs
# them, and no worker waits on another one's build), and every other module is a unit of its own (so
# its module-scoped fixtures, some of them exports or compiles, are set up once). "module[param]":
# only that module's tests of that parameter. The export units start first, in this order (the
# longest first, as estimated: tiny_q's carries test_multidevice's own exports), then the modules with
# slow tests, then the rest. A test that uses one of these
# fixtures from a module not listed under it fails the collection (see _check_groups).
EXPORT_GROUPS: dict[str, tuple[str, ...]] = {
    "embedded_bf16_export": ("test_embedded.py", "test_serve.py", "test_batch_invariance.py[embedded]"),
    "tiny_q_export": ("test_multidevice.py", "test_fnuz_export.py", "test_weights.py", "test_cli.py"),
    "tiny_fp32_export": ("test_export_model.py", "test_engine_tiny.py", "test_bench.py", "test_inspect.py",
                         "test_batch_invariance.py[tiny]"),
}
SHARED_EXPORTS = tuple(EXPORT_GROUPS)


def work_unit(nodeid: str) -> str:
    """The work unit of a test, from its nodeid alone (the xdist controller sees no more): the name
    of the shared export its module reads (EXPORT_GROUPS), else its module's path."""
    path = nodeid.split("::", 1)[0]
    module = path.rsplit("/", 1)[-1]
    name = nodeid.rsplit("::", 1)[-1]
    params = name[name.index("[") + 1:-1].split("-") if "::" in nodeid and name.endswith("]") and "[" in name else []
    for export, members in EXPORT_GROUPS.items():
        for member in members:
            mod, _, param = member.partition("[")
            if mod == module and (not param or param[:-1] in params):
                return export
    return path


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`-n N` (xdist's `--dist load`, or `loadgroup`): the tests in work_unit's units. xdist 3.8's own
    groups (xdist_group, --dist loadgroup) do not hold under pytest 9.2: the '@group' it appends to an
    item's `_nodeid` is not the nodeid pytest 9 reports (it reads `_id`), so each test would be a unit
    of its own, and two workers would set up a module's fixtures (one waiting on the other's export).
    --dist loadscope, loadfile, worksteal and each stay xdist's."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ExportGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def schedule(self) -> None:
            # the units in the workers' collection order (_order_for_workers), not by test count
            reorder = self.config.option.loadscopereorder
            self.config.option.loadscopereorder = False
            try:
                super().schedule()
            finally:
                self.config.option.loadscopereorder = reorder

    return ExportGroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_slow(items)
    _check_groups(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers collect (their config says dist "no")
        _order_for_workers(items)


def _check_groups(items: list[pytest.Item]) -> None:
    """EXPORT_GROUPS lists every module that uses a shared export fixture (a module missing there
    would build the export on a second worker, or wait for it); xdist_group marks would not hold."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            raise pytest.UsageError(f"{item.nodeid}: xdist_group does not hold under pytest 9 (see "
                                    "tests/conftest.py's pytest_xdist_make_scheduler): use EXPORT_GROUPS")
        used = [name for name in EXPORT_GROUPS if name in item.fixturenames]
        if used and work_unit(item.nodeid) not in used:
            raise pytest.UsageError(f"{item.nodeid} uses {used[0]}: list {item.path.name} in "
                                    f"EXPORT_GROUPS[{used[0]!r}] (tests/conftest.py)")


def _order_for_workers(items: list[pytest.Item]) -> None:
    """The order the workers collect the tests in, which is the order the scheduler hands out their
    units: the export units (EXPORT_GROUPS' order), then the modules with slow tests, then the rest,
    each unit's tests together in collection order."""
    group = {item.nodeid: work_unit(item.nodeid) for item in items}
    slow = {group[item.nodeid] for item in items if item.get_closest_marker("slow")}
    first: dict[str, int] = {}
    for item in items:
        first.setdefault(group[item.nodeid], len(first))

    def rank(item: pytest.Item) -> tuple[int, int]:
        g = group[item.nodeid]
        r = SHARED_EXPORTS.index(g) if g in EXPORT_GROUPS else len(SHARED_EXPORTS) + (g not in slow)
        return r, first[g]

    items.sort(key=rank)


def _mark_slow(items: list[pytest.Item]) -> None:
    """Every test that uses a compiling fixture (see _COMPILING_CALL) is `slow`; tests that compile
    by themselves carry the marker explicitly (the guard fails them otherwise)."""
    seen: dict[Any, bool] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None or item.get_closest_marker("slow"):
            continue
        for name in item.fixturenames:
            for fd in info.name2fixturedefs.get(name, ()):
                if fd not in seen:
                    seen[fd] = _fixture_compiles(fd)
                if seen[fd]:
                    item.add_marker(pytest.mark.slow)
                    break
            else:
                continue
            break


def _report_compile(what: str) -> None:
    item = _current["item"]
    if item is None or item.get_closest_marker("slow") or item.get_closest_marker("small_compile"):
        return
    _current["compiles"].append(what)
    pytest.fail(f"{item.nodeid}: this test compiles ({what}): mark it slow", pytrace=True)


compile_guard.install(_report_compile)
# child Python processes load tests/compile_guard/sitecustomize.py (logs their compiles)
os.environ["PYTHONPATH"] = os.pathsep.join([str(_GUARD_SITE), *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any):
    allowed = item.get_closest_marker("slow") or item.get_closest_marker("small_compile")
    log = None
    if not allowed:
        fd, log = tempfile.mkstemp(prefix="dsv4-compile-guard-", suffix=".log")
        os.close(fd)
        os.environ["DSV4_COMPILE_GUARD_LOG"] = log
    _current["item"], _current["compiles"] = item, []
    try:
        yield
    finally:
        _current["item"] = None
        os.environ.pop("DSV4_COMPILE_GUARD_LOG", None)
        if log:
            os.unlink(log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A compile the test caught and swallowed (`except BaseException`) still fails it."""
    result = yield
    if _current["compiles"]:
        pytest.fail(f"{item.nodeid}: this test compiles ({_current['compiles'][0]}): mark it slow", pytrace=False)
    return result


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Any) -> None:
    """After the fixtures' teardown: what the test's child processes compiled."""
    log = os.environ.get("DSV4_COMPILE_GUARD_LOG")
    child = Path(log).read_text().strip() if log and Path(log).is_file() else ""
    if child and _current["item"] is item:
        Path(log).write_text("")
        pytest.fail(f"{item.nodeid}: this test compiles in a child process: mark it slow\n{child}", pytrace=False)


def compile_small(mlir: str, name: str) -> Path:
    """The slow rule's allowance: compile one small module (a kernel template at a tiny shape, the
    runtime tests' toy model: seconds each) for llvm-cpu and return the .vmfb path, cached under
    .cache/kernels/ by the MLIR text (the rendered templates included), the flags and the compiler
    version. Only tests/test_kernel_templates.py (through `kernel_compile`) and tests/test_engine_toy.py's
    toy export call it; anything bigger is an export and slow."""
    import iree.compiler

    from dsv4.export.compile import compile_mlir, resolve_target

    tgt = resolve_target("llvm-cpu")
    h = hashlib.sha256(mlir.encode())
    h.update(json.dumps([tgt.flags, str(getattr(iree.compiler, "__version__", ""))]).encode())
    out = REPO / ".cache" / "kernels" / f"{name}-{h.hexdigest()[:16]}.vmfb"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        with compile_guard.allowed():
            compile_mlir(mlir, tgt, tmp, log_path=tmp.with_suffix(".log"))
        tmp.rename(out)
        tmp.with_suffix(".log").unlink(missing_ok=True)
    return out


@pytest.fixture(scope="session")
def kernel_compile() -> Callable[[str, str], Path]:
    """`compile(mlir_text, name) -> .vmfb`: conftest.compile_small, the one compile a fast test may make."""
    return compile_small


# ---- model configs for the checkpoint and export tests --------------------------------------------

def grid_cfg():
    """tiny widened so that the dense FP8 weights have 2-D 128x128 block-scale grids (wq_a, the shared
    experts, wkv: 2x2; wq_b: 4x2) and the routed experts are 256x256 (re-encoded as FP8: 2x2). The
    presets' grids are 1xN or Nx1, where a transposed grid read fails on shape or goes unnoticed."""
    from dsv4.model.config import ModelConfig

    return ModelConfig.preset("tiny").replace(hidden_size=256, q_lora_rank=256, moe_intermediate_size=256)


def scatter_block_scales(model: Any, seed: int, stacks: bool = False) -> Any:
    """Multiply each 128x128 block of every float weight of at least 256x256 (and, with `stacks`, of
    each matrix of the stacked expert weights) by
    its own random power of two (2^-2..2^2), the two off-diagonal blocks of every 2x2 corner different:
    the quantized checkpoint's scale grids are then random and never symmetric, so a grid read
    transposed changes values."""
    import math

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() < 2 or (p.dim() > 2 and not stacks) or min(p.shape[-2:]) < 256 or not p.dtype.is_floating_point:
                continue
            for m in p.view(-1, *p.shape[-2:]):
                nb, kb = math.ceil(m.shape[0] / 128), math.ceil(m.shape[1] / 128)
                e = torch.randint(-2, 3, (nb, kb), generator=g)
                if e[0, 1] == e[1, 0]:
                    e[0, 1] = e[1, 0] + (1 if e[1, 0] < 2 else -1)
                f = torch.exp2(e.float()).repeat_interleave(128, 0).repeat_interleave(128, 1)
                m.mul_(f[: m.shape[0], : m.shape[1]])
    return model


# ---- exports shared across test modules ------------------------------------------------------------
# Each distinct export costs minutes on 2 cores (the embedded default: ~4 min); modules that can run
# on the same one share it here.

# The embedded default checkpoint as stored (FP8 linears, MXFP4 experts) with bf16 activations and its
# tokenizer, max_seq_len 512, for llvm-cpu (the gfx942 hand-off is tiny_q_export's): tests/test_embedded.py
# (held-out perplexity and greedy against eager), tests/test_serve.py (the server) and tests/test_batch_invariance.py (decode bs1 against bs4 bit for
# bit, which is also why the server may serve a request alone or among others through different batch
# sizes). Prefill bs1 only: the Engine's default (batch-invariant) mode, which the server runs, prefills
# one request per call; decode batches (bs1 and bs4). The 256-token chunk scores a 256-token
# perplexity window in one call.
EMBEDDED_BF16_ARGS = dict(targets=("llvm-cpu",), batch_sizes=(1,), decode_batch_sizes=(1, 4), n_slots=4,
                          max_chunk=256)
EMBEDDED_BF16_MAX_SEQ_LEN = 512


def embedded_bf16_model() -> Any:
    """The model embedded_bf16_export was made from (eager)."""
    from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, load_checkpoint

    return load_checkpoint(EMBEDDED_CHECKPOINT, dtype=torch.bfloat16,
                           overrides={"max_seq_len": EMBEDDED_BF16_MAX_SEQ_LEN}).eval()


@pytest.fixture(scope="session")
def embedded_bf16_export() -> Path:
    """EMBEDDED_BF16_ARGS's export of embedded_bf16_model() (cached under .cache/embedded-bf16-*)."""
    from dsv4.export.exporter import ExportSpec, export_model
    from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT

    def build(out: Path) -> None:
        export_model(embedded_bf16_model(), ExportSpec(**EMBEDDED_BF16_ARGS), out, tokenizer=EMBEDDED_CHECKPOINT,
                     progress=print)

    files = sorted(EMBEDDED_CHECKPOINT.glob("*.json")) + sorted(EMBEDDED_CHECKPOINT.glob("*.safetensors"))
    return cached_export("embedded-bf16", build, [*files, sorted(EMBEDDED_BF16_ARGS.items()), EMBEDDED_BF16_MAX_SEQ_LEN])


# The tiny preset in fp32 (random weights of seed 0, --quant-sim off, so a compiled-vs-eager
# difference is the compiler's and not a flipped FP8/FP4 rounding), for llvm-cpu and gfx942: one export
# for tests/test_export_model.py (the graph against eager torch, the config ABI, the gfx942 code, the
# top-k probe), tests/test_engine_tiny.py and tests/test_bench.py (the Engine and dsv4 bench on a real
# model) and tests/test_batch_invariance.py's tiny case (bs1 against bs4 bit for bit). Prefill and decode
# batch sizes 1 and 4 on 4 slots (decode batches four requests and a fifth one queues; prefill_bs4 is
# held to eager and profiled by dsv4 bench); a 32-token prefill chunk, so prompts of 33+ tokens take
# several calls. Its MLIR is kept for tests/test_inspect.py (dispatch counts against --compile-to=stream).
TINY_FP32_SEED = 0
TINY_FP32_ARGS = dict(targets=("llvm-cpu", "gfx942"), batch_sizes=(1, 4), decode_batch_sizes=(1, 4), n_slots=4,
                      max_chunk=32, probe_topk=True, keep_mlir=True)


def tiny_fp32_cfg() -> Any:
    from dsv4.model.config import ModelConfig

    return ModelConfig.preset("tiny").replace(quant_sim=False)


def tiny_fp32_model() -> Any:
    """The model tiny_fp32_export was made from (eager, fp32)."""
    from dsv4.model.model import Transformer, init_random

    return init_random(Transformer(tiny_fp32_cfg(), dtype=torch.float32), seed=TINY_FP32_SEED).eval()


@pytest.fixture(scope="session")
def tiny_fp32_export() -> Path:
    """TINY_FP32_ARGS's export of tiny_fp32_model() (cached under .cache/tiny-fp32-*)."""
    from dsv4.export.exporter import ExportSpec, export_model

    def build(out: Path) -> None:
        export_model(tiny_fp32_model(), ExportSpec(**TINY_FP32_ARGS), out, progress=print)

    return cached_export("tiny-fp32", build, [tiny_fp32_cfg().to_dict(), TINY_FP32_SEED, sorted(TINY_FP32_ARGS.items())])


# The tiny preset with 8 query heads in 8 o_groups (so 1, 2, 4 and 8 devices divide heads, groups, the
# 8 routed experts and the 512-token vocabulary) in the release format (FP8 linears, MXFP4 experts),
# fp32 activations, `dsv4 weights random` weights of seed 0 loaded into the model and exported from it,
# for llvm-cpu (e4m3fn) and gfx942 (its own e4m3fnuz weights and graph, MLIR kept):
# tests/test_multidevice.py (the one-device reference of its N-device exports, which get the same
# random weights cut per device), tests/test_cli.py (the shards' sha256 in config.json),
# tests/test_weights.py (the .irpa round trip, the no-weights flow) and tests/test_fnuz_export.py (the
# gfx942 hand-off: its weights, and its graph compiled for llvm-cpu).
TINY_Q_SEED = 0
TINY_Q_ARGS = dict(targets=("llvm-cpu", "gfx942"), batch_sizes=(1,), score=False, keep_mlir=True)


def tiny_q_cfg() -> Any:
    from dsv4.model.config import ModelConfig

    return ModelConfig.preset("tiny", num_attention_heads=8, o_groups=8)


def tiny_q_model(tmp: Path) -> Any:
    """The model tiny_q_export was made from: random weights of TINY_Q_SEED written for its inventory
    (under `tmp`), read back with load_irpa."""
    from dsv4.contract.random_weights import random_tensors
    from dsv4.contract.weights import write_shards
    from dsv4.model.checkpoint.irpa import load_irpa, param_inventory
    from dsv4.model.model import Transformer

    cfg = tiny_q_cfg()
    model = Transformer(cfg, dtype=torch.float32, quantized=True)
    files = write_shards(tmp, random_tensors(param_inventory(model), cfg.to_dict(), TINY_Q_SEED), prefix="init")
    return load_irpa(model, [tmp / f for f in files]).eval()


@pytest.fixture(scope="session")
def tiny_q_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY_Q_ARGS's export of tiny_q_model() (cached under .cache/tiny-q-*)."""
    from dsv4.export.exporter import ExportSpec, export_model

    def build(out: Path) -> None:
        export_model(tiny_q_model(tmp_path_factory.mktemp("tiny-q-init")), ExportSpec(**TINY_Q_ARGS), out,
                     progress=print)

    return cached_export("tiny-q", build, [tiny_q_cfg().to_dict(), TINY_Q_SEED, sorted(TINY_Q_ARGS.items())])


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: OpenMP threads only add synchronization (and spin-waiting on a busy 2-core box).
    Opt in per module with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# A prelude for `python -c` subprocesses: imports of torch, iree.compiler and iree.turbine fail as if
# they were not installed (a runtime-only install)
NO_TORCH_PRELUDE = textwrap.dedent("""
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] == 'torch' or name.startswith(('iree.compiler', 'iree.turbine')):
                raise ModuleNotFoundError('blocked: ' + name, name=name)  # as if not installed
            return None
    sys.meta_path.insert(0, Block())
""")
