"""Bad input, every command: the exit code of bad input (pytest 4, the other commands 2), a message naming the
problem, and no rank process started (every rank process that starts writes to DPEP_RANK_LOG: checks.harness.world).
Each case runs as its own process, as a user would type it. Positive control: a valid replay starts its
ranks and they are logged, so an empty log means something."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
FIXTURE_MATRIX = ('[defaults]\nmodel = "fixture:qwen2-moe-shared"\nengine = "inproc"\ntarget = "spec"\n'
                  '[[config]]\nname = "base"\nbaseline = true\n')


def signoff(matrix: str, data: str | None = None) -> list[str]:
    return [PY, "-m", "evals", "signoff", "--matrix", "{tmp}/m.toml", "--data-dir", data or "{data}", "--out",
            "{tmp}/out", "--tasks", "gsm8k", "--gsm8k-limit", "2", "--no-progress", "#matrix:" + matrix]


PYTEST = [PY, "-m", "pytest", "property_tests", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
REPLAY = [PY, "-m", "checks.tools.replay", "--unit", "moe", "--fixture", "qwen3-moe", "--dtype", "float32"]
CASES = {
    "pytest-world-size-0": (PYTEST + ["--world-sizes", "0"], {}, 4, "--world-sizes: '0' is not a positive integer"),
    "pytest-world-size-3": (PYTEST + ["--world-sizes", "3"], {}, 4, "no valid layout of 3 ranks"),
    "pytest-dtype": (PYTEST + ["--dtypes", "float8"], {}, 4, "--dtypes: unknown ['float8']"),
    "pytest-target": (PYTEST + ["--target", "nope.mod:X"], {}, 4, "cannot load target 'nope.mod:X'"),
    "pytest-models": (PYTEST + ["--models", "unknown"], {}, 4, "unknown fixtures ['unknown']"),
    "pytest-device-cuda-without-gpu": (PYTEST + ["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": ""}, 4,
                                       "--device cuda: no GPU is visible"),
    "pytest-max-examples": (PYTEST, {"DPEP_MAX_EXAMPLES": "lots"}, 4, "DPEP_MAX_EXAMPLES: 'lots' is not"),
    "pytest-profile": (PYTEST, {"DPEP_PROFILE": "fast"}, 4, "DPEP_PROFILE: unknown profile 'fast'"),
    "signoff-layout": (signoff(FIXTURE_MATRIX + '[[config]]\nname = "three"\ntp = 3\ndp = 3\nep = 3\n'), {}, 2,
                       "config 'three': layout tp=3 dp=3 ep=3 cannot serve"),
    "signoff-dead-server": (signoff(FIXTURE_MATRIX + '[[config]]\nname = "served"\nengine = "openai"\n'
                                    'base_url = "http://127.0.0.1:{port}"\n'), {}, 2,
                            "config 'served': no server at http://127.0.0.1:{port}"),
    "signoff-missing-data": (signoff(FIXTURE_MATRIX + '[[config]]\nname = "c"\ntp = 2\n', "{tmp}/nope"), {}, 2,
                             "does not exist"),
    "signoff-bad-matrix": (signoff('[[config]]\nname = "a"\nmodel = "x"\ntarget = "hf"\ntp = 3\ndp = 2\n'), {}, 2,
                           "[tp%dp]"),
    "replay-batch": (REPLAY + ["--layout", "tp2-dp2-ep1", "--batch", "dp0:0+x"], {}, 2, "dp0:0+x"),
    "replay-layout": (REPLAY + ["--layout", "tp4-dp3-ep1", "--batch", "dp0:0+3"], {}, 2, "tp4-dp3-ep1"),
    "replay-too-long": (REPLAY + ["--layout", "tp1", "--batch", "dp0:300+1"], {}, 2,
                        "exceeds qwen3-moe's max_position_embeddings"),
    "invariance-pair": ([PY, "-m", "checks.judge.invariance", "pair", "--unit", "moe", "--fixture", "qwen3-moe",
                         "--layout", "tp2-dp2-ep1", "--batch", "dp0:0+2@900 dp1:idle seed=1",
                         "--against", "dp0:0+2 dp1:idle seed=1"], {}, 2, "no request with stream 900"),
    "killtable-mutant": ([PY, "-m", "checks.tools.killtable", "--only", "B99"], {}, 2, "unknown mutant ids ['B99']"),
}


def run(argv: list[str], env: dict, tmp: Path) -> tuple[int, str, list[str]]:
    from dpep_parity.evals.data import default_data_dir
    from dpep_parity.evals.engines.sglang_server import free_port  # a port nothing listens on once it returns
    port, log = free_port(), tmp / "ranks.log"
    fill = {"tmp": str(tmp), "data": str(default_data_dir()), "port": str(port)}
    matrix = [a for a in argv if a.startswith("#matrix:")]
    if matrix:
        (tmp / "m.toml").write_text(matrix[0].removeprefix("#matrix:").format(**fill))
    args = [a.format(**fill) for a in argv if not a.startswith("#matrix:")]
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "DPEP_PROFILE"))}
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**full, **env, "DPEP_RANK_LOG": str(log)})
    started = log.read_text().splitlines() if log.exists() else []
    return p.returncode, (p.stdout + p.stderr).replace(str(port), "{port}"), started


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_before_any_rank_starts(case, tmp_path):
    argv, env, code, says = CASES[case]
    rc, out, started = run(argv, env, tmp_path)
    assert rc == code, f"exit {rc}, expected {code}:\n{out[-3000:]}"
    assert says in out, out[-3000:]
    assert not started, f"rank processes started for bad input: {started}"
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.slow
def test_the_rank_log_sees_ranks_that_do_start(tmp_path):
    """Positive control of the detector: a valid replay starts two ranks and both are logged."""
    rc, out, started = run(REPLAY + ["--layout", "tp2-dp2-ep1", "--batch", "dp0:0+3 dp1:idle"], {}, tmp_path)
    assert rc == 0 and "PASS" in out, out[-3000:]
    assert sorted(line.split(" ", 1)[1] for line in started) == ["rank 0 of 2", "rank 1 of 2"]
