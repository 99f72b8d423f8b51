"""The SGLang launcher (command, health deadline, teardown) and the OpenAI-compatible path, against a
fake server script (a tiny http.server on a loopback port)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpep_parity.evals.engines.base import EngineError
from dpep_parity.evals.engines.openai import completions_url
from dpep_parity.evals.engines.sglang_server import SGLangServer, free_port, sglang_args

FAKE = str(Path(__file__).with_name("fake_sglang_server.py"))
LAUNCH = [sys.executable, FAKE]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie nobody reaped yet is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


@pytest.fixture
def fake_env(monkeypatch, tmp_path):
    def set_mode(mode, delay=0.0):
        monkeypatch.setenv("FAKE_SGLANG_MODE", mode)
        monkeypatch.setenv("FAKE_SGLANG_DELAY", str(delay))
        monkeypatch.setenv("FAKE_SGLANG_ARGV", str(tmp_path / "argv.json"))
        monkeypatch.setenv("FAKE_SGLANG_CHILD", str(tmp_path / "child.pid"))
    return set_mode


def test_sglang_flags_per_layout():
    assert sglang_args("/m", 4, 1, 1, "bfloat16", "127.0.0.1", 30000) == [
        "--model-path", "/m", "--tp-size", "4", "--dtype", "bfloat16", "--host", "127.0.0.1",
        "--port", "30000"]
    args = sglang_args("/m", 4, 4, 4, "auto", "127.0.0.1", 30001, ["--mem-fraction-static", "0.8"])
    assert args == ["--model-path", "/m", "--tp-size", "4", "--dp-size", "4", "--enable-dp-attention",
                    "--ep-size", "4", "--host", "127.0.0.1", "--port", "30001",
                    "--mem-fraction-static", "0.8"]
    assert completions_url("http://h:1") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/v1/") == "http://h:1/v1/completions"


def test_waits_for_health_then_kills_the_whole_group(fake_env, tmp_path):
    fake_env("ok", delay=0.6)
    srv = SGLangServer("/models/x", tp=4, dp=2, ep=2, dtype="bfloat16", log_path=tmp_path / "s.log",
                       launch=LAUNCH, health_timeout_s=20, poll_s=0.1)
    t = time.monotonic()
    with srv:
        assert time.monotonic() - t >= 0.5 and srv.healthy()
        leader = srv.proc.pid
        argv = json.loads((tmp_path / "argv.json").read_text())
        assert argv[:9] == ["--model-path", "/models/x", "--tp-size", "4", "--dp-size", "2",
                            "--enable-dp-attention", "--ep-size", "2"]
        assert argv[argv.index("--port") + 1] == str(srv.port)
        child = int((tmp_path / "child.pid").read_text())
        assert not gone(child)
    assert wait_gone(leader) and wait_gone(child), "teardown left a process of the server's group alive"


def test_never_healthy_is_an_error_with_the_log_tail_not_a_hang(fake_env, tmp_path):
    fake_env("never")
    # the deadline leaves the fake time to start and log its line on a loaded 2-core runner (1.5 s did not,
    # once, with a full run beside it: the log tail was still empty)
    srv = SGLangServer("/m", log_path=tmp_path / "s.log", launch=LAUNCH, health_timeout_s=6, poll_s=0.1)
    t = time.monotonic()
    with pytest.raises(EngineError) as e, srv:
        pytest.fail("must not get here")
    assert 5.9 < time.monotonic() - t < 30
    assert "not healthy" in str(e.value) and "fake sglang: mode=never" in str(e.value)
    assert srv.proc is None and wait_gone(int((tmp_path / "child.pid").read_text()))


def test_server_that_dies_is_reported_with_its_log(fake_env, tmp_path):
    fake_env("crash")
    srv = SGLangServer("/m", log_path=tmp_path / "s.log", launch=LAUNCH, health_timeout_s=30, poll_s=0.1)
    with pytest.raises(EngineError) as e, srv:
        pass
    assert "exited with code 3" in str(e.value) and "CUDA error" in str(e.value)


def test_exception_inside_the_block_still_tears_down(fake_env, tmp_path):
    fake_env("ok")
    srv = SGLangServer("/m", log_path=tmp_path / "s.log", launch=LAUNCH, health_timeout_s=20, poll_s=0.1)
    with pytest.raises(KeyboardInterrupt), srv:
        leader = srv.proc.pid
        raise KeyboardInterrupt
    assert wait_gone(leader) and wait_gone(int((tmp_path / "child.pid").read_text()))


def test_signoff_through_local_completions(fake_env, tmp_path, tiny_model, data_dir):
    """openai engine (a server we start) as baseline, sglang engine (launched fake) as candidate."""
    fake_env("ok")
    port = free_port()
    server = subprocess.Popen([sys.executable, FAKE, "--port", str(port)], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        probe = SGLangServer("/m", port=port, launch=LAUNCH)
        deadline = time.monotonic() + 20
        while not probe.healthy():
            assert time.monotonic() < deadline, "fake server did not come up"
            time.sleep(0.1)
        m = tmp_path / "m.toml"
        m.write_text(f"""
[defaults]
model = "{tiny_model}"
dtype = "auto"

[[config]]
name = "served"
baseline = true
engine = "openai"
base_url = "http://127.0.0.1:{port}"

[[config]]
name = "sglang-dpa"
engine = "sglang"
tp = 2
dp = 2
ep = 2
launch = {json.dumps(LAUNCH)}
health_timeout_s = 30
""")
        from dpep_parity.evals.__main__ import main

        out = tmp_path / "o"
        rc = main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(out),
                   "--mmlu-limit", "8", "--gsm8k-limit", "2", "--max-gen-toks", "8", "--no-progress"])
        rep = json.loads((out / "signoff.json").read_text())
        assert rc == 4 and rep["verdict"] == "INCONCLUSIVE"        # 8 + 2 items decide nothing: exit 4
        assert {c["config"] for c in rep["comparisons"]} == {"sglang-dpa"}
        assert all(c["agreement"] == 1.0 for c in rep["comparisons"])
        lines = (out / "cache" / "served" / "gsm8k.jsonl").read_text().splitlines()
        gsm = [json.loads(x)["record"] for x in lines]
        assert all(r["extracted"]["strict-match"] == "18" for r in gsm)
        log = (out / "logs" / "sglang-dpa.server.log").read_text()
        assert "fake sglang: mode=ok" in log
        argv = json.loads((tmp_path / "argv.json").read_text())
        assert "--enable-dp-attention" in argv and argv[argv.index("--ep-size") + 1] == "2"
    finally:
        os.killpg(server.pid, 9)
        server.wait(10)
