"""pytest runs in processes of their own, forked from one that imported torch, hypothesis, pytest and transformers'
model classes once (multiprocessing's forkserver, as CPU ranks start: checks.harness.world).

The kill table runs the property suite once per mutant, each in a process of its own so that a hang or a crash in
one cannot touch another. A fresh `python -m pytest` spends most of a killed mutant's run importing: on 2 cores
10.1 s for B08's run against 2.6 s forked from a pre-imported process (the same exit code and report). Nothing
of this project is imported before the fork: the suite's plugin reads its settings (DPEP_PROFILE, the hypothesis
profile) from the environment the run is given, at its own import in the child. The child leads a process group of
its own, so a run past its time limit is ended with everything it started (its ranks, their forkserver).

Where this process cannot fork from a forkserver (no `fork` start method), or one already serves other work here
(worlds: the forkserver is one per process), each run is a fresh `python -m pytest` as before, also in a process
group of its own.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading

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


def _forkserver():
    """The forkserver context with PRELOAD, or None where it cannot serve these runs (see the module's doc)."""
    with _LOCK:
        if "ctx" not in _DECIDED:
            _DECIDED["ctx"] = _decide()
        return _DECIDED["ctx"]


def _decide():
    if "fork" not in mp.get_all_start_methods() or os.environ.get("DPEP_WORLD_PRELOAD") == "off":
        return None
    from multiprocessing import forkserver
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return None                       # already started for other work: its preload is not ours to change
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _end_group(pid: int, kill_one) -> None:
    """SIGKILL to the run's process group (the run, its ranks and their forkserver); the run alone where it has
    not become its group's leader yet."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        kill_one()


def run(args: list[str], env: dict, cwd: str, log: str, timeout_s: float) -> tuple[int | None, str]:
    """`python -m pytest ARGS` in `cwd` with environment `env`: (exit code, or None past `timeout_s`; its output).
    `log`: a file for the output (its folder must exist)."""
    ctx = _forkserver()
    if ctx is None:
        with subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=cwd, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True) as p:
            try:
                out = p.communicate(timeout=timeout_s)[0]
                return p.returncode, out
            except subprocess.TimeoutExpired:
                _end_group(p.pid, p.kill)
                return None, f"suite exceeded {timeout_s:.0f}s: {p.communicate()[0][-2000:]!r}"
    p = ctx.Process(target=_child, args=(list(args), dict(env), str(cwd), str(log)), daemon=False)
    p.start()
    p.join(timeout_s)
    rc = p.exitcode
    if p.is_alive():
        _end_group(p.pid, p.kill)
        p.join()
        rc = None
    try:
        with open(log, errors="replace") as f:
            out = f.read()
    except FileNotFoundError:
        out = ""
    if rc is None:
        return None, f"suite exceeded {timeout_s:.0f}s: {out[-2000:]!r}"
    return rc, out
