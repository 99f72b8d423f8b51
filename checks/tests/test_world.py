"""Multi-rank execution: reuse, speed, and hangs / errors / deadlines that are diagnosed and leave nothing."""
from __future__ import annotations

import inspect
import os
import time

import pytest

from dpep_parity.checks.harness.world import World, WorldFailure
from dpep_parity.checks.tests.jobs import RaiseOnRank, SeesFile, ShapeMismatch, SkipOnRank, Sleep, SumRanks
from dpep_parity.checks.tests.jobs_extra import PidAndSum
from dpep_parity.checks.tests.procs import running as running_anywhere


def running(pid: int) -> bool:
    """True while `pid` is a live (not zombie) rank of this process: its child (spawned) or the child of its
    forkserver (forked: checks.harness.world._rank_context). A pid reused by someone else is not ours, and a
    zombie has exited."""
    from multiprocessing import forkserver
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state, ppid = fields[0], int(fields[1])
    parents = {os.getpid(), getattr(forkserver._forkserver, "_forkserver_pid", None)}
    return ppid in parents and state not in ("Z", "X")


def line_of(job_cls, text: str) -> str:
    """`file:line` of the first source line of job_cls.__call__ containing `text`."""
    src, start = inspect.getsourcelines(job_cls.__call__)
    n = next(i for i, line in enumerate(src) if text in line)
    return f"{os.path.basename(inspect.getsourcefile(job_cls))}:{start + n}"


@pytest.fixture(scope="module")
def world():
    w = World(2, deadline_s=60)
    yield w.start()
    w.close()
    assert not any(running(p) for p in w.pids())


def test_world2_sums_ranks(world):
    res = world.run(SumRanks())
    assert [r.rank for r in res] == [0, 1]
    assert [r.value for r in res] == [1.0, 1.0]
    # one all_reduce on the world group recorded per rank
    assert [[(x.op, x.group) for x in r.records] for r in res] == [[("all_reduce", (0, 1))]] * 2


def test_world4_sums_ranks():
    with World(4, deadline_s=60) as w:
        pids = w.pids()
        assert len(set(pids)) == 4 and all(running(p) for p in pids)
        res = w.run(PidAndSum())
        assert [r.value for r in res] == [(pids[r], r, 6.0) for r in range(4)]
    assert not any(running(p) for p in pids)


def test_world_is_reused_and_cheap(world):
    pids, starts = world.pids(), world.starts
    world.run(SumRanks())                      # warm
    t0 = time.perf_counter()
    for _ in range(20):
        res = world.run(PidAndSum())
        assert [r.value for r in res] == [(pids[0], 0, 1.0), (pids[1], 1, 1.0)]
    per_job = (time.perf_counter() - t0) / 20
    assert world.starts == starts and world.pids() == pids
    assert per_job < 0.05, f"{per_job * 1e3:.1f} ms per job"


def test_skipped_collective_is_a_hang_named_and_cleaned_up(world):
    world.run(SumRanks())
    pids, starts = world.pids(), world.starts
    t0 = time.perf_counter()
    with pytest.raises(WorldFailure) as e:
        world.run(SkipOnRank(1))
    assert time.perf_counter() - t0 < 10
    msg = str(e.value)
    assert e.value.kind == "hang", msg
    assert "rank 1" in msg and "skipped" in msg and "all_reduce" in msg
    assert line_of(SkipOnRank, "dist.all_reduce") in msg          # the call site where rank 0 waits
    assert "rank 0: blocked in" in msg                           # where everyone is
    assert [r.op for r in e.value.records[0]] == ["all_reduce"] and e.value.records[1] == []
    assert not any(running(p) for p in pids)
    assert not world.alive
    # the same World object restarts on next use
    assert [r.value for r in world.run(SumRanks())] == [1.0, 1.0]
    assert world.starts == starts + 1 and set(world.pids()).isdisjoint(pids)


def test_rank_error_returns_the_traceback_with_the_rank(world):
    pids = world.start().pids()
    with pytest.raises(WorldFailure) as e:
        world.run(RaiseOnRank(1))
    msg = str(e.value)
    assert e.value.kind == "rank-error", msg
    assert "--- rank 1 raised:" in msg and "--- rank 0 raised" not in msg
    assert "Traceback (most recent call last)" in msg and "ValueError: boom on rank 1" in msg
    assert line_of(RaiseOnRank, "raise ValueError").split(":")[1] in msg.split("rank 1 raised:")[1]
    assert not any(running(p) for p in pids)


@pytest.mark.slow
def test_ranks_left_waiting_on_a_raised_rank_end_soon_after_it():
    """A rank raised and the others wait outside every recorded collective: the world ends them after its
    after-error budget with the rank's traceback, instead of holding the example to its deadline (MiniMax-M2's
    F6 crash left such ranks for the whole 300 s). Control: a rank that raises while the others finish within
    the budget is reported as before, the world not restarted."""
    from dpep_parity.checks.tests.jobs_extra import RaiseWhileOthersWait
    with World(2, deadline_s=120, after_error_s=2) as w:
        pids = w.start().pids()
        t0 = time.perf_counter()
        with pytest.raises(WorldFailure) as e:
            w.run(RaiseWhileOthersWait(1, 100))
        took = time.perf_counter() - t0
        msg = str(e.value)
        assert e.value.kind == "rank-error" and "did not finish within 2s" in msg, msg
        assert "ValueError: boom on rank 1" in msg and "rank 0: computing" in msg, msg
        assert 2 <= took < 15, took
        assert not any(running(p) for p in pids)
        starts = w.starts
        with pytest.raises(WorldFailure) as e:
            w.run(RaiseWhileOthersWait(1, 0.2))
        assert "did not finish within" not in str(e.value) and "boom on rank 1" in str(e.value)
        assert w.starts == starts + 1            # started again after the ranks it ended, not after this one
        assert [r.value for r in w.run(SumRanks())] == [1.0, 1.0] and w.starts == starts + 1


def test_shape_mismatch_names_both_shapes(world):
    pids = world.start().pids()
    with pytest.raises(WorldFailure) as e:
        world.run(ShapeMismatch())
    msg = str(e.value)
    # rank 0 gathers 3 elements into 2 * 3, rank 1 gathers 2 into 2 * 2
    assert "all_gather_into_tensor" in msg
    assert "shapes=[(6,), (3,)]" in msg and "shapes=[(4,), (2,)]" in msg, msg
    assert not any(running(p) for p in pids)


def test_meanwhile_runs_in_this_process_while_the_ranks_compute(world, tmp_path):
    """run(meanwhile=...) is how the oracle overlaps the target (checks.judge.parity.run_example): the ranks see
    what it does before they return. Negative control: without it they never do."""
    flag = tmp_path / "oracle-done"
    assert [r.value for r in world.run(SeesFile(str(flag), 1.0))] == [False, False]
    res = world.run(SeesFile(str(flag), 20.0), meanwhile=flag.touch)
    assert [r.value for r in res] == [True, True]


def test_meanwhile_time_is_not_on_the_examples_deadline(world):
    """A slow oracle is no verdict on the target: the deadline counts from when meanwhile is done (a stuck
    job still fails it: test_deadline_kills_a_stuck_example). The ranks take 3 s against a 2.5 s deadline
    counted from the end of a 2 s meanwhile: counted from the send, it would have failed them at 2.5 s."""
    res = world.run(Sleep(3), deadline_s=2.5, meanwhile=lambda: time.sleep(2))
    assert [r.value for r in res] == [0, 1]


class _Interrupt(BaseException):
    pass


def test_an_interrupt_in_meanwhile_ends_the_ranks_and_the_world_restarts(world):
    pids, starts = world.start().pids(), world.starts

    def interrupted():
        raise _Interrupt()
    with pytest.raises(_Interrupt):
        world.run(Sleep(30), meanwhile=interrupted)
    assert not any(running(p) for p in pids)
    assert [r.value for r in world.run(SumRanks())] == [1.0, 1.0]
    assert world.starts == starts + 1


def test_deadline_kills_a_stuck_example(world):
    pids = world.start().pids()
    t0 = time.perf_counter()
    with pytest.raises(WorldFailure) as e:
        world.run(Sleep(30), deadline_s=3)
    took = time.perf_counter() - t0
    assert e.value.kind == "deadline", str(e.value)
    assert "3s deadline" in str(e.value) and "rank 1: computing" in str(e.value)
    assert 3 <= took < 10, took
    assert not any(running(p) for p in pids)


def test_a_group_playing_several_roles_is_named_by_all_of_them():
    """Negative control: in tp4-dp4-ep4 the TP group and the MoE-EP group are one process group; a TP
    reduction used to be recorded (and a hang diagnosed) as 'all_reduce on moe_ep[0, 1, 2, 3]'. A role is
    named afresh per layout: tp4-dp2-ep1 reuses the same world group as tp and moe_tp."""
    from dpep_parity.checks.core.topology import Layout
    from dpep_parity.checks.tests.jobs_extra import ReduceOnRole
    with World(4, deadline_s=60) as w:
        res = w.run(ReduceOnRole(Layout(4, 4, 4), "tp"))
        assert {r.records[-1].group_name for r in res} == {"tp/moe_ep"}
        res = w.run(ReduceOnRole(Layout(4, 2, 1), "tp"))
        assert {r.records[-1].group_name for r in res} == {"tp/moe_tp"}
        res = w.run(ReduceOnRole(Layout(4, 2, 1), "attn_tp"))
        assert {r.records[-1].group_name for r in res} == {"attn_tp"}     # one role, none left from earlier layouts
        with pytest.raises(WorldFailure) as e:
            w.run(ReduceOnRole(Layout(4, 4, 4), "tp", idle=3))
        assert "all_reduce on tp/moe_ep[0, 1, 2, 3]" in str(e.value), str(e.value)


@pytest.mark.slow
def test_a_world_with_modules_to_preload_restarts_from_a_process_that_imported_them(monkeypatch):
    """A CPU world whose target names modules to preload forks its ranks from the forkserver that imported them,
    so the world that replaces a hung one starts with them imported (the sglang target's ~10 s of imports per
    rank: docs/harness.md, "Recovering from a hang"). The ranks see this process's environment as of the start,
    as spawned ones do, and the hung ranks are ended. Controls: a world naming no module starts without it
    (forked from a server without it: xml.dom.minidom is in no rank's imports), and so does one spawned
    (DPEP_WORLD_PRELOAD=off)."""
    from dpep_parity.checks.tests.jobs import LoadedModules
    probe = LoadedModules(("xml.dom.minidom",), env="DPEP_TEST_PROBE")   # a module no rank imports by itself
    c = World(2, deadline_s=60)       # control, first: the forkserver's list only grows within a process
    try:
        assert [r.value[0] for r in c.run(probe)] == [[False]] * 2 and c.forked
    finally:
        c.close()
    w = World(2, deadline_s=60)
    w.preload = {"xml.dom.minidom"}
    try:
        monkeypatch.setenv("DPEP_TEST_PROBE", "first")
        assert [r.value for r in w.run(probe)] == [([True], "first")] * 2 and w.forked
        pids = w.pids()
        with pytest.raises(WorldFailure) as e:
            w.run(SkipOnRank(1))
        assert e.value.kind == "hang" and "skipped" in str(e.value)
        assert not any(running_anywhere(p) for p in pids)
        monkeypatch.setenv("DPEP_TEST_PROBE", "second")
        assert [r.value for r in w.run(probe)] == [([True], "second")] * 2       # restarted, forked again
        assert w.starts == 2 and set(w.pids()).isdisjoint(pids)
        pids = w.pids()
    finally:
        w.close()
    assert pids and not any(running_anywhere(p) for p in pids)          # closed: the forked ranks are ended too
    monkeypatch.setenv("DPEP_WORLD_PRELOAD", "off")      # control: spawned, whatever the world names
    c = World(2, deadline_s=60)
    c.preload = {"xml.dom.minidom"}
    try:
        assert [r.value[0] for r in c.run(probe)] == [[False]] * 2 and not c.forked
    finally:
        c.close()


@pytest.mark.slow
def test_set_up_has_its_own_deadline_apart_from_the_examples():
    """Time a rank spends in a marked set-up phase (recorder.setup_phase: imports, a model build) counts against
    the world's set-up deadline, not the example's: a set-up longer than the example's deadline passes, one
    longer than the set-up deadline fails naming the phase, and the same time spent outside set-up still
    fails the example's deadline (control)."""
    from dpep_parity.checks.tests.jobs import SleepInSetup
    w = World(2, deadline_s=1.5, setup_deadline_s=120).start()    # joining is set-up too: not what is timed
    w.setup_deadline_s = 4.0
    try:
        assert [r.value for r in w.run(SleepInSetup(2.5))] == [0, 1]          # 2.5 s > the 1.5 s deadline
        with pytest.raises(WorldFailure) as e:
            w.run(SleepInSetup(6.0))
        assert e.value.kind == "deadline" and "set-up exceeded its 4s deadline" in str(e.value), str(e.value)
        assert "rank 0 in a slow import" in str(e.value) and "in set-up (a slow import)" in str(e.value)
        w.setup_deadline_s = 120                        # the failed world restarts: joining is not timed here
        w.start()
        with pytest.raises(WorldFailure) as e:
            w.run(SleepInSetup(0.1, after=2.5))
        assert e.value.kind == "deadline" and "example exceeded its 2s deadline" in str(e.value), str(e.value)
    finally:
        w.close()
