"""How `pytest -n N` splits the suite (tests/conftest.py): the modules that read one shared export
are one work unit, run by one worker; every other module is a unit of its own; the export units are
handed out first. Checked on nodeids of this suite and on xdist's scheduler driven by fake workers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import EXPORT_GROUPS, _check_groups, _order_for_workers, pytest_xdist_make_scheduler, work_unit

EMBEDDED = ["tests/test_embedded.py::test_held_out_perplexity", "tests/test_serve.py::test_chat_stream",
            "tests/test_batch_invariance.py::test_decode_functions_agree_bitwise[embedded]"]
TINY_Q = ["tests/test_fnuz_export.py::test_gfx942_gets_the_fnuz_weights",
          "tests/test_weights.py::test_load_irpa_round_trips_an_export",
          "tests/test_multidevice.py::test_n_devices_equal_one_device", "tests/test_cli.py::test_help"]
TINY_FP32 = ["tests/test_bench.py::test_bench_table_and_plot", "tests/test_engine_tiny.py::TestX::test_y",
             "tests/test_batch_invariance.py::test_decode_functions_agree_bitwise[tiny]"]
OTHERS = ["tests/test_config.py::test_presets", "tests/test_config.py::test_bad[x-1]",
          "tests/test_formats.py::test_fp8_round_trip[e4m3fn]", "tests/test_audit.py::test_clean_export_is_consistent",
          "tests/test_speculative_export.py::test_mtp_matches_eager", "tests/test_runtime.py::TestRing::test_wrap"]


def test_modules_sharing_an_export_are_one_unit() -> None:
    assert {work_unit(n) for n in EMBEDDED} == {"embedded_bf16_export"}
    assert {work_unit(n) for n in TINY_Q} == {"tiny_q_export"}
    assert {work_unit(n) for n in TINY_FP32} == {"tiny_fp32_export"}


def test_other_modules_are_a_unit_each() -> None:
    assert [work_unit(n) for n in OTHERS] == ["tests/test_config.py", "tests/test_config.py", "tests/test_formats.py",
                                              "tests/test_audit.py", "tests/test_speculative_export.py",
                                              "tests/test_runtime.py"]
    # a parameter named like a model only counts in the module listed with it
    assert work_unit("tests/test_topk.py::test_radix[tiny]") == "tests/test_topk.py"
    assert work_unit("tests/test_batch_invariance.py::test_new_one") == "tests/test_batch_invariance.py"
    # the same module in another folder (nodeids are relative to the rootdir)
    assert work_unit("test_weights.py::test_x") == "tiny_q_export"


def _item(nodeid: str, slow: bool = False, fixtures: tuple[str, ...] = (), marks: tuple[str, ...] = ()):
    markers = {"slow"} if slow else set()
    markers |= set(marks)
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures),
                           path=SimpleNamespace(name=nodeid.split("::")[0].rsplit("/")[-1]),
                           get_closest_marker=lambda name: object() if name in markers else None)


def test_workers_order_export_units_first_then_slow_modules() -> None:
    items = [_item(OTHERS[0]), _item(TINY_FP32[0], slow=True), _item(OTHERS[3], slow=True), _item(TINY_Q[3]),
             _item(EMBEDDED[1], slow=True), _item(OTHERS[2]), _item(TINY_Q[0], slow=True), _item(OTHERS[1]),
             _item(EMBEDDED[0], slow=True)]
    _order_for_workers(items)
    assert [work_unit(i.nodeid) for i in items] == [
        "embedded_bf16_export", "embedded_bf16_export", "tiny_q_export", "tiny_q_export", "tiny_fp32_export",
        "tests/test_audit.py", "tests/test_config.py", "tests/test_config.py", "tests/test_formats.py"]
    assert list(EXPORT_GROUPS) == ["embedded_bf16_export", "tiny_q_export", "tiny_fp32_export"]
    # collection order inside a unit
    assert [i.nodeid for i in items[:4]] == [EMBEDDED[1], EMBEDDED[0], TINY_Q[3], TINY_Q[0]]


def test_a_module_missing_from_its_exports_group_fails_the_collection() -> None:
    _check_groups([_item(TINY_Q[0], fixtures=("tiny_q_export",)), _item(OTHERS[0], fixtures=("tmp_path",))])
    with pytest.raises(pytest.UsageError, match=r"test_speculative_export.py in EXPORT_GROUPS\['tiny_q_export'\]"):
        _check_groups([_item(OTHERS[4], fixtures=("tiny_q_export",))])
    with pytest.raises(pytest.UsageError, match="xdist_group does not hold"):
        _check_groups([_item(OTHERS[0], marks=("xdist_group",))])


class _Worker:
    """What xdist's scheduler calls on a worker: it records the tests it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.queue: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.queue.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def _run(collection: list[str], n_workers: int, dist: str = "load") -> dict[int, list[str]]:
    """Drive conftest's scheduler like xdist's controller does, the workers finishing one test each in
    turn; which nodeids each worker ran."""
    from xdist.remote import Producer

    option = SimpleNamespace(loadscopereorder=True)
    config = SimpleNamespace(option=option, getvalue={"dist": dist, "tx": ["popen"] * n_workers}.__getitem__)
    sched = pytest_xdist_make_scheduler(config, Producer("sched", enabled=False))
    workers = [_Worker(f"gw{i}") for i in range(n_workers)]
    for w in workers:
        sched.add_node(w)
    for w in workers:
        sched.add_node_collection(w, collection)
    sched.schedule()
    assert option.loadscopereorder is True  # restored
    ran: dict[int, list[str]] = {i: [] for i in range(n_workers)}
    while any(w.queue for w in workers):
        for i, w in enumerate(workers):
            if w.queue:
                index = w.queue.pop(0)
                ran[i].append(collection[index])
                sched.mark_test_complete(w, index)
    assert sched.tests_finished
    return ran


def test_xdist_runs_each_exports_modules_on_one_worker() -> None:
    collection = EMBEDDED + TINY_Q + TINY_FP32 + OTHERS  # the workers' order
    for n_workers in (2, 3, 4):
        ran = _run(collection, n_workers)
        assert sorted(n for r in ran.values() for n in r) == sorted(collection)  # each test once
        for unit in (EMBEDDED, TINY_Q, TINY_FP32, OTHERS[:2]):
            assert len([w for w, r in ran.items() if set(unit) & set(r)]) == 1, (n_workers, unit, ran)
        # the first export units start at once on different workers
        assert ran[0][0] == EMBEDDED[0] and ran[1][0] == TINY_Q[0]
    # the fast modules spread over both workers
    ran = _run(collection, 2)
    assert all(set(OTHERS) & set(r) for r in ran.values())
    assert len(set(work_unit(n) for n in OTHERS)) > 1


def test_xdist_s_own_modes_stay_xdist_s() -> None:
    config = SimpleNamespace(option=SimpleNamespace(), getvalue={"dist": "loadfile"}.__getitem__)
    assert pytest_xdist_make_scheduler(config, None) is None
