"""Start an SGLang server for one configuration, wait for /health, and always tear it down.

``SGLangServer`` is a context manager. The server runs in its own process group (``start_new_session``)
with its output in a log file; leaving the block kills the whole group (SIGTERM, then SIGKILL after
``grace_s``). A server that exits early or is not healthy by the deadline raises :class:`EngineError`
with the tail of its log - never a hang.
"""
from __future__ import annotations

import contextlib
import dataclasses
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

from dpep_parity.evals.engines.base import Engine, EngineError
from dpep_parity.evals.engines.openai import ServerOptions, make_openai_lm

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


@dataclasses.dataclass
class SGLangOptions(ServerOptions):
    server_args: list[str] = dataclasses.field(default_factory=list)   # extra launch_server flags
    launch: list[str] = dataclasses.field(default_factory=list)        # command prefix, default python -m ...
    health_timeout_s: float = 900.0


class SGLangEngine(Engine):
    """`engine = "sglang"`: the sign-off launches an SGLang server per configuration and ends it after."""
    name = "sglang"
    Options = SGLangOptions
    hub_ids = True

    def problems(self, config, label: str) -> list[str]:
        o, p = config.options, config.options.problems(label)
        for key in ("server_args", "launch"):
            v = getattr(o, key)
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                p.append(f"[required] {label}: {key} must be a list of strings")
        if not isinstance(o.health_timeout_s, int | float) or o.health_timeout_s <= 0:
            p.append(f"[required] {label}: health_timeout_s must be a positive number")
        return p

    def preflight(self, config) -> list[str]:
        import importlib.util
        if not config.options.launch and importlib.util.find_spec("sglang") is None:
            return [f"config {config.name!r}: engine 'sglang' needs the sglang package (pip install sglang) or a "
                    "'launch' command"]
        return []

    def describe(self, config) -> str:
        return "sglang.launch_server" + (f" {' '.join(config.options.server_args)}" if config.options.server_args
                                         else "")

    @contextlib.contextmanager
    def open(self, config, max_gen_toks, log_dir):
        o = config.options
        server = SGLangServer(config.model_path, tp=config.tp, dp=config.dp, ep=config.ep, dtype=config.dtype,
                              log_path=Path(log_dir) / f"{config.name}.server.log", extra_args=tuple(o.server_args),
                              health_timeout_s=o.health_timeout_s, launch=tuple(o.launch) if o.launch else SGLANG_LAUNCH)
        with server:
            try:
                yield make_openai_lm(server.base_url, o.served_model or config.model_path,
                                     config.tokenizer or config.model_path, max_gen_toks,
                                     max_length=o.max_length, num_concurrent=o.num_concurrent)
            except Exception as e:
                if server.proc is not None and server.proc.poll() is not None:
                    raise EngineError(f"the server of {config.name!r} died during the run (exit code "
                                      f"{server.proc.returncode}); last log lines of {server.log_path}:\n"
                                      f"{log_tail(server.log_path)}") from e
                raise


ENGINE = SGLangEngine()
