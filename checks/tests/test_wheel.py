"""The built wheel in a fresh virtual environment, beside a package named `fixtures` (PyPI has one: the testtools
family's): both import, the wheel carries no tests, `dpep --help` answers fast without torch, and the pytest plugin
runs a pinned property example from an empty directory.

The environment takes this interpreter's site-packages for torch and the rest through a .pth line (installing them
again would take minutes), which does not run that site-packages' own .pth files: this checkout's editable install
stays out. The stand-in `fixtures` package on PYTHONPATH is the collision the wheel must survive; the full check
with PyPI's real `fixtures` is `pip install fixtures` in the same environment (docs in README, "Layout").
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow     # a whole sub-run per test (checks/suite/tiers.py)

ROOT = Path(__file__).resolve().parents[2]
ONE_PIN = "moe_pinned and noshared"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    # the build backend of this environment when it has one (no download), else pip's isolated build
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    # built from a copy: setuptools writes build/ and dpep_parity.egg-info into the tree it builds, and an
    # egg-info left in the checkout declares entry points that a later pytest run loads (docs/architecture.md)
    src = tmp / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "venv", "build", "dist", "*.egg-info", "reports", "runs", ".hypothesis", "__pycache__",
        ".ruff_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w",
                    str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("dpep_parity-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python*/site-packages"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)            # a pure wheel installs by unpacking (pip is not in this venv)
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    shadow = tmp / "shadow" / "fixtures"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("WHO = 'the other fixtures package'\n")
    env = {**os.environ, "PYTHONPATH": str(shadow.parent), "DPEP_FIXTURE_CACHE": str(tmp / "fx"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    empty = tmp / "empty"
    empty.mkdir()
    return wheel, venv / "bin" / "python", env, empty


def test_the_wheel_carries_no_tests_and_no_top_level_packages(installed):
    wheel = installed[0]
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"dpep_parity"}, tops
    assert not [n for n in names if "/tests/" in n]
    assert any(n.endswith("evals/tasks/gsm8k.yaml") for n in names)


def test_both_packages_named_fixtures_import(installed):
    _, py, env, empty = installed
    code = ("import fixtures, dpep_parity.fixtures as ours, sys; assert fixtures.WHO == 'the other fixtures package'; "
            "assert 'site-packages/dpep_parity/fixtures' in ours.__file__, ours.__file__; "
            "assert 'qwen3-moe' in ours.FIXTURES; assert not {'checks', 'evals'} & set(sys.modules)")
    r = subprocess.run([str(py), "-c", code], cwd=empty, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_dpep_help_is_fast_and_imports_no_torch(installed):
    _, py, env, empty = installed
    code = ("import sys, time; t = time.perf_counter(); from dpep_parity.checks.tools.cli import main\n"
            "try: main(['--help'])\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules; print(time.perf_counter() - t, file=sys.stderr)")
    t0 = time.perf_counter()
    r = subprocess.run([str(py), "-c", code], cwd=empty, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "killtable" in r.stdout, r.stderr[-2000:]
    assert float(r.stderr.strip().splitlines()[-1]) < 1.0 and time.perf_counter() - t0 < 10


def test_the_plugin_runs_a_pinned_example_from_an_empty_directory(installed):
    _, py, env, empty = installed
    r = subprocess.run([str(py), "-m", "pytest", "-p", "dpep", "-p", "no:cacheprovider", "-q", "--pyargs",
                        "dpep_parity.property_tests.test_parity", "-k", ONE_PIN], cwd=empty, capture_output=True,
                       text=True, timeout=600, env={**env, "DPEP_MAX_EXAMPLES": "2"})
    assert r.returncode == 0 and "1 passed" in r.stdout, (r.stdout + r.stderr)[-3000:]


def test_a_failing_propertys_replay_line_replays_in_an_engine_repository(installed):
    """An engine's repository with the wheel installed: a property fails on a catalog mutant (B08, at its pinned
    trigger), and the `replay:` line it prints, run as it is in that repository, replays the same FAIL."""
    _, py, env, empty = installed
    repo = empty.parent / "engine-repo"
    (repo / "src").mkdir(parents=True)
    (repo / "pyproject.toml").write_text('[project]\nname = "an-engine"\nversion = "0"\n')
    bindir = py.parent                  # the console script pip writes from the wheel's entry_points.txt
    script = bindir / "dpep"
    script.write_text(f"#!{py}\nimport re\nimport sys\nfrom dpep_parity.checks.tools.cli import main\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      "    sys.exit(main())\n")
    script.chmod(0o755)
    env = {**env, "PATH": f"{bindir}{os.pathsep}{env.get('PATH', '')}", "DPEP_MAX_EXAMPLES": "2"}
    r = subprocess.run([str(py), "-m", "pytest", "-p", "dpep", "-p", "no:cacheprovider", "-q", "--pyargs",
                        "dpep_parity.property_tests.test_parity", "-k", ONE_PIN, "--target", "checks.catalog.mutants:B08"],
                       cwd=repo, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 1 and "1 failed" in r.stdout, (r.stdout + r.stderr)[-3000:]
    line = next(ln.split("replay: ", 1)[1] for ln in r.stdout.splitlines() if "replay: dpep replay " in ln)
    assert "--target checks.catalog.mutants:B08" in line
    out = subprocess.run(line, shell=True, cwd=repo, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 1 and "FAIL" in out.stdout, (line, (out.stdout + out.stderr)[-3000:])
    control = subprocess.run(line.replace("checks.catalog.mutants:B08", "spec"), shell=True, cwd=repo,
                             capture_output=True, text=True, timeout=600, env=env)
    assert control.returncode == 0 and "PASS" in control.stdout, (control.stdout + control.stderr)[-3000:]
