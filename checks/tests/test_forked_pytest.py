"""checks.tools.forked_pytest, the kill table's pytest runs: forked from a pre-imported process, or a fresh
`python -m pytest` where that cannot be (DPEP_WORLD_PRELOAD=off here), each run gives pytest's exit code and
output, sees the environment and folder it was given (not its parent's) and not its caller's main module, and past
its time limit, or on `interrupt()` (the kill table's Ctrl-C), is ended with everything it started (negative control, run by hand: with only the run itself killed, the hung test's own child
outlives it and the test fails). Each mode runs in a process of its own: the forkserver is one per process, and this test
process's worlds may hold it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

DRIVER = textwrap.dedent('''
    import json, os, sys, threading, time
    from dpep_parity.checks.tools import forked_pytest
    if __name__ == "__main__":
        tests, out = sys.argv[1], sys.argv[2]
        # the runs' environment: this process's without DPEP_PARENT_ONLY, with a probe
        base = {**{k: v for k, v in os.environ.items() if k != "DPEP_PARENT_ONLY"}, "DPEP_FORKED_PROBE": "given",
                "DPEP_DRIVER": os.path.abspath(sys.argv[0])}
        res = {}

        def one(name, test, limit, pidfile=""):
            t = time.perf_counter()
            rc, text = forked_pytest.run(["-q", "-p", "no:cacheprovider", test], {**base, "DPEP_PIDFILE": pidfile},
                                         tests, os.path.join(out, name + ".log"), limit)
            res[name] = {"rc": rc, "out": text[-3000:], "s": time.perf_counter() - t}
        one("verdicts", "test_verdicts.py", 120)
        one("hang", "test_hang.py", 10, os.path.join(out, "hang.pid"))
        # Ctrl-C in the kill table: interrupt() ends a run in flight
        pidfile = os.path.join(out, "interrupted.pid")
        th = threading.Thread(target=one, args=("interrupted", "test_hang.py", 300, pidfile))
        th.start()
        deadline = time.monotonic() + 60
        while not os.path.exists(pidfile) and time.monotonic() < deadline:
            time.sleep(0.1)
        forked_pytest.interrupt(grace_s=10)
        th.join(60)
        res["forked"] = forked_pytest._forkserver() is not None
        print(json.dumps(res))
''')

TESTS = {
    "test_verdicts.py": textwrap.dedent('''
        import os, sys
        def test_sees_its_environment_and_folder():
            assert os.environ.get("DPEP_FORKED_PROBE") == "given" and "DPEP_PARENT_ONLY" not in os.environ
            assert os.path.exists("test_verdicts.py")
            # the caller's main module (driver.py) was not imported into the run
            assert not [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == os.environ["DPEP_DRIVER"]]
        def test_fails():
            assert 1 == 2
    '''),
    "test_hang.py": textwrap.dedent('''
        import os, subprocess, time
        def test_hangs_with_a_child():
            child = subprocess.Popen(["sleep", "600"])
            with open(os.environ["DPEP_PIDFILE"], "w") as f:
                f.write(str(child.pid))
            time.sleep(600)
    '''),
}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the hung run's child")
@pytest.mark.parametrize("mode", ["forked", "fresh"])
def test_runs_give_verdicts_environment_and_end_on_time(tmp_path, mode):
    tests = tmp_path / "tests"
    tests.mkdir()
    for name, text in TESTS.items():
        (tests / name).write_text(text)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "DPEP_PARENT_ONLY": "1"}
    if mode == "fresh":
        env["DPEP_WORLD_PRELOAD"] = "off"
    p = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tests), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["forked"] == (mode == "forked")
    v = res["verdicts"]
    assert v["rc"] == 1 and "1 failed, 1 passed" in v["out"], v["out"]
    h = res["hang"]
    assert h["rc"] is None and "exceeded 10s" in h["out"] and h["s"] < 90, h
    i = res["interrupted"]
    assert i["rc"] == 2 and i["s"] < 90, i            # pytest's exit code for an interrupted run
    for name in ("hang", "interrupted"):
        pid = int((tmp_path / f"{name}.pid").read_text())
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"the {name} run's own child outlived it"


def test_a_run_whose_library_settings_differ_is_not_forked():
    """The forkserver's libraries read their settings (TORCH_*, HYPOTHESIS_*, CI) when it starts, from this process's
    environment: a run given other values of them must not be forked (it would not see them); DPEP_* variables,
    which only this project reads, at its import in the run, may differ."""
    from dpep_parity.checks.tools.forked_pytest import _same_settings
    env = dict(os.environ)
    assert _same_settings(env) and _same_settings({**env, "DPEP_PROFILE": "kill"})
    assert not _same_settings({**env, "TORCH_LOGS": "+dynamo"})
    assert not _same_settings({k: v for k, v in env.items() if k != "PATH"})
