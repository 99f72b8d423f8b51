"""Start an SGLang server for one configuration, wait for /health, and always tear it down.

``SGLangServer`` is a context manager. The server runs in its own process group (``start_new_session``)
with its output in a log file; leaving the block kills the whole group (SIGTERM, then SIGKILL after
``grace_s``). A server that exits early or is not healthy by the deadline raises :class:`EngineError`
with the tail of its log - never a hang.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

from dpep_parity.evals.engines.base import EngineError

SGLANG_LAUNCH = (sys.executable, "-m", "sglang.launch_server")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sglang_args(model_path: str, tp: int, dp: int, ep: int, dtype: str, host: str, port: int,
                extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The launch_server flags of one layout: DP attention whenever dp > 1, EP whenever ep > 1."""
    args = ["--model-path", str(model_path), "--tp-size", str(tp)]
    if dp > 1:
        args += ["--dp-size", str(dp), "--enable-dp-attention"]
    if ep > 1:
        args += ["--ep-size", str(ep)]
    if dtype and dtype != "auto":
        args += ["--dtype", dtype]
    args += ["--host", host, "--port", str(port)]
    return args + list(extra)


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty log)"


class SGLangServer:
    def __init__(self, model_path: str, tp: int = 1, dp: int = 1, ep: int = 1, dtype: str = "auto",
                 log_path: Path | str = "sglang-server.log", extra_args: tuple[str, ...] = (),
                 health_timeout_s: float = 900.0, host: str = "127.0.0.1", port: int | None = None,
                 launch: tuple[str, ...] | list[str] = SGLANG_LAUNCH, grace_s: float = 10.0,
                 poll_s: float = 0.5) -> None:
        self.host, self.port = host, port or free_port(host)
        self.command = list(launch) + sglang_args(model_path, tp, dp, ep, dtype, self.host, self.port,
                                                   extra_args)
        self.log_path = Path(log_path)
        self.health_timeout_s, self.grace_s, self.poll_s = float(health_timeout_s), float(grace_s), poll_s
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            try:
                self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as e:
                raise EngineError(f"cannot start {self.command[0]}: {e}") from e
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=min(5.0, self.poll_s * 4)) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise EngineError(f"server exited with code {code} before becoming healthy "
                                  f"({' '.join(self.command)}); last log lines of {self.log_path}:\n"
                                  f"{log_tail(self.log_path)}")
            if self.healthy():
                return
            if time.monotonic() >= deadline:
                raise EngineError(f"server not healthy at {self.base_url}/health after "
                                  f"{self.health_timeout_s:.0f} s; last log lines of {self.log_path}:\n"
                                  f"{log_tail(self.log_path)}")
            time.sleep(self.poll_s)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                # the leader is gone; make sure nothing else in its group survives it
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            except subprocess.TimeoutExpired:
                continue
        if proc.poll() is None:
            proc.wait(timeout=10)

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
