"""The `dpep` command (checks/tools/cli.py): its help is fast and imports nothing heavy, an unknown subcommand is a usage
error, and a subcommand gets its arguments exactly as typed and gives back its exit code."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dpep_parity import own_module
from dpep_parity.checks.tools import cli

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "hypothesis", "transformers", "lm_eval")


def dpep(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "checks.tools.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_help_lists_every_subcommand_fast_and_imports_nothing_heavy():
    probe = ("import sys, time\nfrom checks.tools.cli import main\nt0 = time.perf_counter()\n"
             "try:\n    main(['--help'])\nexcept SystemExit as e:\n    code = e.code\n"
             f"print('RESULT', code, time.perf_counter() - t0, [m for m in {HEAVY!r} if m in sys.modules])\n")
    p = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    result = p.stdout.splitlines()[-1].split(" ", 3)
    assert result[0] == "RESULT" and result[1] == "0", p.stdout
    assert float(result[2]) < 1.0, f"dpep --help took {result[2]} s"
    assert result[3] == "[]", f"dpep --help imported {result[3]}"
    for name in cli.COMMANDS:
        assert f"    {name} " in p.stdout or f"    {name}\n" in p.stdout, p.stdout


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["nonexistent"])
    assert e.value.code == 2
    assert "invalid choice: 'nonexistent'" in capsys.readouterr().err


@pytest.mark.slow
def test_subcommand_help_is_the_modules_own_under_the_name_typed():
    p = dpep("killtable", "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: dpep killtable"), p.stdout
    assert "--control" in p.stdout and "The kill table" in p.stdout
    direct = subprocess.run([sys.executable, "-m", "checks.tools.killtable", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert direct.stdout.startswith("usage: python -m checks.tools.killtable"), direct.stdout
    assert "--control" in direct.stdout and "The kill table" in direct.stdout


# (signoff: argparse reports an unknown option from its top parser, which `dpep` names)
@pytest.mark.parametrize("sub, usage", [("replay", "usage: dpep replay"), ("signoff", "usage: dpep [-h] {signoff}"),
                                        ("fixtures", "usage: dpep fixtures"), ("bench", "usage: dpep bench")])
def test_errors_name_the_command_typed(sub, usage):
    p = dpep(sub, "--no-such-option")
    assert p.returncode == 2 and p.stderr.startswith(usage), p.stderr


def test_arguments_pass_through_unchanged_and_the_exit_code_comes_back(tmp_path, monkeypatch):
    (tmp_path / "fake_tool.py").write_text("SEEN = []\n\ndef main(argv):\n    SEEN.append(argv)\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_tool", ("sub",), "a stand-in"))
    argv = ["--help", "-x", "--", "fake", "--target=a:b"]
    assert cli.main(["fake", *argv]) == 3
    assert sys.modules["fake_tool"].SEEN == [["sub", *argv]]


def test_every_subcommand_module_exists_and_the_script_is_declared():
    missing = [m for m, _, _ in cli.COMMANDS.values() if importlib.util.find_spec(own_module(m)) is None]
    assert not missing
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["dpep"] == "dpep_parity.checks.tools.cli:main"
