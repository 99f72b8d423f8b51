"""The suite's pytest plugin (checks/suite/pytest_plugin.py) outside this repository: from an empty directory, with
none of pyproject.toml's pytest settings in force, `-p dpep --pyargs dpep_parity.property_tests.test_parity` runs a pinned
example on the spec target; bad options are still a usage error; and inside the repository the root conftest
loads the plugin exactly once, whether or not pytest already has it.

The runs see the entry point that `pip install` writes (pyproject.toml's, in a dist-info of its own on the path),
so they load the plugin the way an installed copy does, whether or not this checkout is installed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "dpep_parity.checks.suite.pytest_plugin"
ONE_PIN = "moe_pinned and noshared"   # one pinned example, two ranks: seconds


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder holding only the dist-info of an installed dpep-parity: its pytest11 entry point."""
    d = tmp_path_factory.mktemp("site") / "dpep_parity-0.dist-info"
    d.mkdir()
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: dpep-parity\nVersion: 0\n")
    (d / "entry_points.txt").write_text(f"[pytest11]\ndpep = {MODULE}\n")
    return d.parent


def pytest_run(argv: list[str], cwd: Path, site: Path, **env: str) -> subprocess.CompletedProcess:
    # this checkout first on the path, so an installed copy of the package cannot stand in for it
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DPEP_PROFILE"))}
    path = [str(ROOT), str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    full.update(PYTHONPATH=os.pathsep.join(path), DPEP_MAX_EXAMPLES="1", **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *argv], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=300)


def test_the_entry_point_is_the_plugin_module():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"dpep": MODULE}


@pytest.mark.slow
def test_pinned_examples_run_from_an_empty_directory(tmp_path, site):
    p = pytest_run(["-p", "dpep", "--pyargs", "dpep_parity.property_tests.test_parity", "-k", ONE_PIN], tmp_path, site)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "1 passed" in out, out[-3000:]
    assert f"rootdir: {tmp_path}" in out, out[-3000:]   # none of this repository's pytest settings applied
    assert "dpep: target=spec device=cpu world sizes=1,2,4" in out, out[-3000:]
    assert "hypothesis profile=ci+max_examples=1" in out, out[-3000:]
    report = json.loads((tmp_path / "reports" / "property-suite.json").read_text())
    assert (report["passed"], report["failed"]) == (1, 0), report


def test_a_bad_target_from_an_empty_directory_is_a_usage_error(tmp_path, site):
    """Negative control of the run above: the plugin's options are checked, not merely accepted."""
    p = pytest_run(["-p", "dpep", "--pyargs", "dpep_parity.property_tests.test_parity", "--target", "nonexistent.module:X"],
                   tmp_path, site)
    out = p.stdout + p.stderr
    assert p.returncode == 4, out[-3000:]
    assert "--target: cannot load target 'nonexistent.module:X'" in out, out[-3000:]
    assert not (tmp_path / "reports").exists()


@pytest.mark.slow
@pytest.mark.parametrize("autoload", ["0", "1"], ids=["root-conftest", "entry-point"])
def test_the_repository_loads_the_plugin_once(autoload, site):
    """With autoload off only the root conftest loads the plugin; with it on, pytest registers the entry point
    first (as `dpep`) and the root conftest must not register the same module a second time."""
    p = pytest_run(["property_tests/test_parity.py", "--collect-only", "-k", ONE_PIN], ROOT, site,
                   **({"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"} if autoload == "0" else {}))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert out.count("dpep: target=spec") == 1, out[-3000:]
    assert "1/19 tests collected" in out or "1 selected" in out, out[-3000:]


def test_property_searches_get_a_timeout_scaled_to_their_example_count():
    from dpep_parity.checks.suite.pytest_plugin import scaled_timeout
    assert scaled_timeout(900, 12) == 900 and scaled_timeout(900, 4) == 900      # ci and smaller: as configured
    assert scaled_timeout(900, 500) == 900 * 500 / 12                            # fuzz: 37,500 s
    assert scaled_timeout(0, 500) == 0                                           # no timeout stays none


def test_the_header_carries_what_a_target_says_of_itself_and_survives_a_broken_one():
    from types import SimpleNamespace

    from dpep_parity.checks.suite.pytest_plugin import target_header

    class Says:
        @staticmethod
        def report_header(device):
            return [f"kernels on {device}"]

    class Breaks:
        def report_header(self, device):
            raise RuntimeError("no GPU")

    assert target_header(SimpleNamespace(target=Says(), device="cuda")) == ["kernels on cuda"]
    assert target_header(SimpleNamespace(target=object(), device="cuda")) == []
    assert target_header(SimpleNamespace(target=Breaks(), device="cuda")) == [
        "dpep: the target's header failed: RuntimeError: no GPU"]


def test_a_process_driving_gpu_ranks_caps_its_threads_and_a_cpu_run_keeps_them(monkeypatch):
    import pytest
    import torch

    from dpep_parity.checks.harness.gpus import limit_controller_threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert limit_controller_threads("cpu") is None and torch.get_num_threads() == 2
        monkeypatch.setenv("DPEP_CONTROLLER_THREADS", "1")
        assert limit_controller_threads("cuda") == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("DPEP_CONTROLLER_THREADS", "0")        # torch's default kept
        assert limit_controller_threads("cuda") is None and torch.get_num_threads() == 2
        monkeypatch.setenv("DPEP_CONTROLLER_THREADS", "four")
        with pytest.raises(ValueError, match="DPEP_CONTROLLER_THREADS='four'"):
            limit_controller_threads("cuda")
    finally:
        torch.set_num_threads(before)


def test_gpu_ranks_run_beside_the_oracle_only_under_a_listening_mps_daemon(monkeypatch, tmp_path):
    """The oracle computes while GPU ranks compute only where an MPS control daemon accepts connections at
    $CUDA_MPS_PIPE_DIRECTORY/control (checks.harness.gpus.mps_daemon): not where there is no socket, nor where
    a daemon that quit left its socket file; CPU ranks always."""
    import socket
    from types import SimpleNamespace

    from dpep_parity.checks.harness import gpus
    from dpep_parity.checks.judge.parity import overlaps_oracle
    cuda, cpu = SimpleNamespace(rank_device="cuda"), SimpleNamespace(rank_device="cpu")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    path = str(tmp_path / "control")

    def asked():
        gpus.mps_daemon.cache_clear()
        return gpus.mps_daemon(), overlaps_oracle(cuda), overlaps_oracle(cpu)
    try:
        assert asked() == (None, False, True)                     # no daemon
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(path)
        stale.close()                                             # the file stays, nobody listens
        assert asked() == (None, False, True)
        (tmp_path / "control").unlink()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as daemon:
            daemon.bind(path)
            daemon.listen(1)
            assert asked() == (path, True, True)
    finally:
        gpus.mps_daemon.cache_clear()


def _collect_with(name: str, value: str):
    """pytest --collect-only of one small test file in a child process with environment variable `name` set."""
    import os
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                           "checks/tests/test_topology.py"], capture_output=True, text=True,
                          env=dict(os.environ, **{name: value}),
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_a_broken_controller_thread_count_is_a_usage_error_before_anything_runs():
    p = _collect_with("DPEP_CONTROLLER_THREADS", "four")
    assert p.returncode == 4, p.stdout + p.stderr
    assert "DPEP_CONTROLLER_THREADS='four'" in p.stdout + p.stderr


def test_a_broken_oracle_thread_setting_is_a_usage_error_before_anything_runs(monkeypatch):
    """DPEP_ORACLE_THREAD takes 1 or 0; anything else is named before anything is collected (exit 4), as
    DPEP_CONTROLLER_THREADS is. Controls: 0 and 1 read as off and on."""
    from dpep_parity.checks.harness.gpus import oracle_thread
    for raw, on in (("1", True), ("0", False)):
        monkeypatch.setenv("DPEP_ORACLE_THREAD", raw)
        assert oracle_thread() is on
    p = _collect_with("DPEP_ORACLE_THREAD", "yes")
    assert p.returncode == 4, p.stdout + p.stderr
    assert "DPEP_ORACLE_THREAD='yes'" in p.stdout + p.stderr
