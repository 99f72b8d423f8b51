"""`python -m checks.tools.replay` refuses a bad example as a usage error (exit 2) that names the problem, before any
rank starts; a malformed --batch names its bad part. Positive control: the replay line a failing property
prints (property_tests/strategies.py) parses and has no problem."""
from __future__ import annotations

import argparse

import pytest

from dpep_parity.checks.core.batches import Request, parse_batch
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.tools import replay

BASE = ["--unit", "moe", "--fixture", "qwen3-moe", "--layout", "tp2-dp2-ep2", "--batch", "dp0:0+5 dp1:idle seed=7"]


def _with(**change):
    args = dict(zip(BASE[::2], BASE[1::2]))
    args.update({f"--{k.replace('_', '-')}": v for k, v in change.items()})
    return [x for kv in args.items() for x in kv]


@pytest.mark.parametrize("change, says", [
    ({"batch": "dp0:0+5 dp1:3-1"}, "batch part 'dp1:3-1': requests are PREFIX+EXTEND"),
    ({"batch": "dp0:0+5 dp2:idle"}, "batch part 'dp2:idle': expected 'dp1:...' here"),
    ({"batch": "dp0:0+5 seed=x"}, "batch part 'seed=x'"),
    ({"batch": "seed=3"}, "names no DP rank"),
    ({"layout": "tp2-xx"}, "cannot parse layout 'tp2-xx'"),
    ({"layout": "tp3-dp3-ep3", "batch": "dp0:0+1 dp1:idle dp2:idle"}, "num_experts % ep == 0"),
    ({"batch": "dp0:0+5"}, "--batch names 1 DP ranks, --layout tp2-dp2-ep2 has dp=2"),
    ({"fixture": "qwen9"}, "--fixture 'qwen9' is unknown"),
    ({"layer": "7"}, "qwen3-moe has layers 0..1"),
    ({"target": "nope.mod:X"}, "cannot load target 'nope.mod:X'"),
    ({"dtype": "float8"}, "invalid choice: 'float8'"),
], ids=lambda x: str(x)[:30])
def test_bad_example_is_a_usage_error_naming_the_problem(change, says, capsys, monkeypatch):
    monkeypatch.setattr(replay, "run_example", lambda *a, **k: pytest.fail("a rank would have started"))
    with pytest.raises(SystemExit) as e:
        replay.main(_with(**change))
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_the_printed_replay_line_is_accepted():
    ns = argparse.Namespace(target="spec", unit="moe", fixture="qwen3-moe", layout=Layout.parse("tp2-dp2-ep2"),
                            dtype="bfloat16", layer=1, batch=parse_batch("dp0:0+5,3+1 dp1:idle seed=7"))
    assert replay.problems(ns) == []
    assert ns.batch.per_dp == ((Request(0, 5), Request(3, 1)), ())
