"""pytest runs in processes of their own, forked from one that imported torch, hypothesis, pytest and transformers'
model classes once (multiprocessing's forkserver, as CPU ranks start: checks.harness.world).

The kill table runs the property suite once per mutant, each in a process of its own so that a hang or a crash in
one cannot touch another. A fresh `python -m pytest` spends most of a killed mutant's run importing: on 2 cores
10.1 s for B08's run against 2.6 s forked from a pre-imported process (the same exit code and report).

What a run sees is what a fresh `python -m pytest` would:
- Nothing of this project is imported before `pytest.main` but this module's packages (empty `__init__`s): the
  child is started with pytest's own `__main__` as the main module, so multiprocessing does not import the
  caller's main module (the kill table) into it, nor into the ranks its worlds fork. The suite's plugin reads its
  settings (DPEP_PROFILE, the hypothesis profile) from the run's environment at its own import in the child.
- The preloaded libraries read their own settings (CI, HYPOTHESIS_*, TORCH_*, ...) once, when the forkserver
  starts, from this process's environment: a run whose environment differs from this process's in anything but
  DPEP_* variables is a fresh `python -m pytest` instead.
- Each run leads a process group of its own: a run past its time limit is ended with everything it started (its
  ranks, their forkserver), and whatever of its group outlives a run that ended is ended after it. `interrupt()`
  (the kill table on Ctrl-C) ends every run in flight: SIGINT first, so pytest prints its summary, SIGKILL after a
  grace period.
- Forked runs share this process's multiprocessing resource tracker: shared memory or semaphores a run leaves
  behind are reported in this process's output and removed when it exits.

Where this process cannot fork from a forkserver (no `fork` start method), or one already serves other work here
(worlds: the forkserver is one per process), each run is a fresh `python -m pytest`, also in a group of its own.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import wait as wait_ready

# heavy and free of this project's state: what every run of the property suite imports first
PRELOAD = ("torch", "torch.distributed", "hypothesis", "pytest", "transformers.modeling_utils",
           "transformers.models.auto.modeling_auto")


def _child(args: list[str], env: dict, cwd: str, log: str) -> None:
    os.setpgid(0, 0)                      # a group of its own: a timeout ends the run's ranks with it
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = ["pytest", *args]
    import pytest
    sys.exit(int(pytest.main(args)))


_DECIDED: dict = {}
_LOCK = threading.Lock()      # runs start from several threads (the kill table's --jobs): one decision per process
# A forkserver child's exit status is read once from its pipe, and every Process.start() polls all children: two
# threads reading one status at once leave one of them with 255 (measured: 28 of 600 exits of 3, two threads).
# Starts and status reads hold this lock; waiting for a run only selects on its sentinel.
_POPEN = threading.Lock()
_LIVE: dict[int, object] = {}  # pid -> the run's Process or Popen, while it runs


def _forkserver():
    """The forkserver context with PRELOAD, or None where it cannot serve these runs (see the module's doc)."""
    with _LOCK:
        if "ctx" not in _DECIDED:
            _DECIDED["ctx"] = _decide()
        return _DECIDED["ctx"]


def _decide():
    # the same rule as checks.harness.world's `_rank_context` (not imported here: a run imports nothing of this
    # project before pytest.main but this module)
    if "fork" not in mp.get_all_start_methods() or os.environ.get("DPEP_WORLD_PRELOAD") == "off":
        return None
    from multiprocessing import forkserver
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return None                       # already started for other work: its preload is not ours to change
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _same_settings(env: dict) -> bool:
    """Does `env` differ from this process's environment in DPEP_* variables only (what the preloaded libraries
    read at their import is then what the run would read)?"""
    keys = set(env) | set(os.environ)
    return all(k.startswith("DPEP_") or env.get(k) == os.environ.get(k) for k in keys)


def _end_group(pid: int, sig=signal.SIGKILL, kill_one=None) -> None:
    """`sig` to the run's process group (the run, its ranks and their forkserver); to the run alone (`kill_one`)
    where it has not become its group's leader yet."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        if kill_one is not None:
            kill_one()
    except PermissionError:     # the group id was taken by another user's process: nothing of ours is left there
        pass


def interrupt(grace_s: float = 10.0) -> None:
    """End every run in flight: SIGINT to each run's group, SIGKILL to what is left after `grace_s`."""
    live = list(_LIVE.items())
    for pid, _ in live:
        _end_group(pid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for pid, p in live:
        while _running(p) and time.monotonic() < deadline:
            time.sleep(0.1)
        _end_group(pid)


def _running(p) -> bool:
    if isinstance(p, subprocess.Popen):
        return p.poll() is None
    return not wait_ready([p.sentinel], 0)


def run(args: list[str], env: dict, cwd: str, log: str, timeout_s: float) -> tuple[int | None, str]:
    """`python -m pytest ARGS` in `cwd` with environment `env`: (exit code, or None past `timeout_s`; its output).
    `log`: a file for the output (its folder must exist)."""
    ctx = _forkserver() if _same_settings(env) else None
    if ctx is None:
        return _fresh(args, env, cwd, timeout_s)
    p = ctx.Process(target=_child, args=(list(args), dict(env), str(cwd), str(log)), daemon=False)
    import pytest.__main__ as pytest_main  # the child's main module: what `python -m pytest` runs as
    with _POPEN:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = pytest_main
        try:
            p.start()
        finally:
            sys.modules["__main__"] = main
        _LIVE[p.pid] = p
    try:
        done = bool(wait_ready([p.sentinel], timeout_s))
        with _POPEN:
            if not done:
                _end_group(p.pid, kill_one=p.kill)
            p.join()
            rc = p.exitcode if done else None
    finally:
        _LIVE.pop(p.pid, None)
        _end_group(p.pid)                 # what of its group outlived the run
    try:
        with open(log, errors="replace") as f:
            out = f.read()
    except FileNotFoundError:
        out = ""
    return (rc, out) if rc is not None else _exceeded(timeout_s, out)


def _exceeded(timeout_s: float, out: str) -> tuple[None, str]:
    return None, f"suite exceeded {timeout_s:.0f}s: {out[-2000:]!r}"


def _fresh(args: list[str], env: dict, cwd: str, timeout_s: float) -> tuple[int | None, str]:
    with subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True) as p:
        _LIVE[p.pid] = p
        try:
            out = p.communicate(timeout=timeout_s)[0]
            return p.returncode, out
        except subprocess.TimeoutExpired:
            _end_group(p.pid, kill_one=p.kill)
            return _exceeded(timeout_s, p.communicate()[0])
        finally:
            _LIVE.pop(p.pid, None)
            _end_group(p.pid)
