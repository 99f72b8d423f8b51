"""The layout sweep reports what it really did: a case whose every example the target skipped is 'skipped',
never 'passed' (its coverage of padding modes, idle ranks and dp-lm-head is asserted in the sweep's own file)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_case_the_target_skips_entirely_is_reported_skipped():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    p = subprocess.run([sys.executable, "-m", "pytest", "property_tests/test_layout_sweep.py", "-p", "no:xdist",
                        "-p", "no:cacheprovider", "-rs", "-q", "--target", "checks.tests.skipping_target:TARGET",
                        "--dtypes", "float32", "-k", "qwen3-moe-tp1-dp1-ep1 or qwen3-moe-tp2-dp2-ep1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "1 passed, 1 skipped" in out, out[-3000:]
    assert "skipped every example of this layout" in out

