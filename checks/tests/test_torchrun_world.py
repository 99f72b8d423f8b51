"""A world of torchrun workers (checks.harness.torchrun_world): two torchrun agents on this host, two workers each, form
one 4-rank world (c10d rendezvous, gloo), as two hosts would. Examples run on it with the local pools' verdicts;
a planted hang is diagnosed by rank, host and collective and the world recovers; a dead worker is diagnosed
and the world relaunched; nothing is left running on either agent."""
from __future__ import annotations

import contextlib
import re
import socket

import pytest

from dpep_parity.checks.core.batches import Batch
from dpep_parity.checks.core.batches import Request as R
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.harness import world
from dpep_parity.checks.harness.torchrun_world import TorchrunOptions, TorchrunWorld
from dpep_parity.checks.harness.world import WorldFailure, WorldSettings
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.tests.jobs import SkipOnRank
from dpep_parity.checks.tests.jobs_extra import DieOnRank, PidAndSum
from dpep_parity.checks.tests.procs import running
from dpep_parity.fixtures.build import fixture_path

pytestmark = pytest.mark.slow     # a whole sub-run per test (checks/suite/tiers.py)

SETTINGS = WorldSettings("torchrun", TorchrunOptions("127.0.0.1:0", 2, 2))


@contextlib.contextmanager
def world_kind(settings):
    world.configure(settings)
    try:
        yield
    finally:
        world.configure(None)


@pytest.fixture(scope="module")
def trw():
    with world_kind(SETTINGS):
        w = world.get_world(4, "cpu", 60)
    seen: set[int] = set()
    yield w, seen
    seen |= set(w.pids()) | set(w.agent_pids())
    w.close()
    assert not [p for p in seen if running(p)], "processes left after the torchrun world closed"
    assert w._logs is not None and not w._logs.exists(), "the driver's folder (agent logs, workers' temp folders) outlived the world"


def test_two_agents_make_one_world_of_four_ranks(trw):
    w, seen = trw
    res = w.run(PidAndSum())
    pids = w.pids()
    seen |= set(pids) | set(w.agent_pids())
    assert [r.value for r in res] == [(pids[r], r, 6.0) for r in range(4)]
    assert len(set(pids)) == 4 and len(w.agent_pids()) == 2 and all(running(p) for p in pids)
    assert f"rank 3 on {socket.gethostname()} pid {pids[3]}" in w.placement()


def test_planted_hang_is_diagnosed_by_rank_host_and_collective_and_the_world_recovers(trw):
    w, seen = trw
    w.run(PidAndSum())
    pids, generation = w.pids(), w.generation
    with pytest.raises(WorldFailure) as e:
        w.run(SkipOnRank(3))
    msg = str(e.value)
    assert e.value.kind == "hang"
    assert re.search(r"rank [012] waits in #1 all_reduce on world\[0, 1, 2, 3\]", msg) and "rank 3 skipped it" in msg
    assert f"placement (torchrun): rank 0 on {socket.gethostname()} pid {pids[0]}" in msg
    # the workers re-executed in place (same processes, still their agents' children) as a new generation
    assert [r.value[2] for r in w.run(PidAndSum())] == [6.0] * 4
    assert w.pids() == pids and w.generation != generation


def test_dead_worker_is_diagnosed_and_the_world_relaunched_leaving_nothing(trw):
    w, seen = trw
    w.run(PidAndSum())
    old = set(w.pids()) | set(w.agent_pids())
    seen |= old
    host, pid1 = socket.gethostname(), w.pids()[1]
    with pytest.raises(WorldFailure) as e:
        w.run(DieOnRank(1))
    assert f"rank 1 process died (connection lost: pid {pid1} on {host})" in str(e.value)
    assert not [p for p in old if running(p)], "the old agents or workers outlived the teardown"
    res = w.run(PidAndSum())
    assert [r.value[2] for r in res] == [6.0] * 4 and not set(w.pids()) & old
    seen |= set(w.pids()) | set(w.agent_pids())


def test_a_worker_freed_before_its_control_thread_acts_still_joins_the_next_generation(monkeypatch):
    """After a hang the driver drops every worker and asks each to re-execute; a peer's re-execution breaks
    the collective the others wait in, which frees their main threads. Under load a main thread once ended its
    process before its control thread re-executed it (CI: "0 of 4 torchrun workers were ready within 120s"):
    with the control thread slowed by 3 s, the world still recovers in place."""
    monkeypatch.setenv("DPEP_WORLD_TEST_CONTROL_DELAY_S", "3")
    w = TorchrunWorld(SETTINGS, "cpu", deadline_s=60, start_timeout_s=60).start()
    try:
        pids = w.pids()
        with pytest.raises(WorldFailure) as e:
            w.run(SkipOnRank(3))
        assert e.value.kind == "hang"
        assert [r.value[2] for r in w.run(PidAndSum())] == [6.0] * 4 and w.pids() == pids
    finally:
        seen = set(w.pids()) | set(w.agent_pids())
        w.close()
    assert not [p for p in seen if running(p)]


IDLE4 = Batch(((R(0, 3),), (), (), ()), 3)     # property_tests/test_parity.py's pinned B02 / B14 example


@pytest.mark.parametrize("target", ["spec", "checks.catalog.mutants:B02", "checks.catalog.mutants:B14"])
def test_verdicts_equal_the_local_pools(trw, target):
    """A pinned example, the spec and two catalog mutants (a hang, a double reduction): the same checks fail
    on the torchrun world as on a local pool."""
    args = (target, "moe", str(fixture_path("qwen2-moe-shared")), Layout(4, 4, 4), IDLE4, "float32", 0)
    # a generous deadline: on a loaded runner an example must not run into it (the hang of B02 is diagnosed
    # from the records at once, never by the deadline)
    with world_kind(WorldSettings()):
        local = run_example(*args, deadline_s=300)
    with world_kind(SETTINGS):
        remote = run_example(*args, deadline_s=300)
    verdict = [(r.ok, sorted(c.prop for c in r.failures())) for r in (local, remote)]
    assert verdict[0] == verdict[1], f"local {verdict[0]} vs torchrun {verdict[1]}\n{remote.report()}"
    assert verdict[0][0] == (target == "spec"), local.report()
    if target.endswith("B02"):
        assert "placement (torchrun)" in remote.report()


def test_the_signoff_engine_serves_on_the_torchrun_world(trw):
    """The sign-off's in-process serving engine (continuous batching, decode steps, an idle DP rank once its
    short request is done) generates the same tokens on the torchrun world as on a local pool."""
    from dpep_parity.checks.serving.engine import ServingEngine
    prompts, max_new = [[5, 9, 2, 7], [3, 3], [11, 4, 8]], [4, 1, 3]
    outs = {}
    for name, settings in (("local", WorldSettings()), ("torchrun", SETTINGS)):
        with world_kind(settings):
            engine = ServingEngine(str(fixture_path("qwen3-moe")), tp=4, dp=2, ep=2, deadline_s=60)
            outs[name] = engine.generate(prompts, max_new)
        assert (engine.world is trw[0]) == (name == "torchrun")
    assert [len(g) for g in outs["local"]] == max_new and outs["torchrun"] == outs["local"]
