"""Harness faults: a target's glue that does not fit the system it drives ends an example as an ERROR, never as
a verdict on the system (checks.targets.protocol.harness_modules, HarnessFault); the same error raised by the
system itself stays a FAIL of the no-crash property. Plus the sglang target's guards that turn a release its
adapter was not written for into harness faults (ForwardBatch fields, stand-in attributes) and the CPU stand-ins
of device kernels, against the kernels' contracts."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dpep_parity.checks.core.batches import parse_batch
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.targets import protocol
from dpep_parity.fixtures.build import fixture_path

BATCH = parse_batch("dp0:0+3 seed=1")


def _run(target: str):
    return run_example(target, "moe", str(fixture_path("qwen3-moe")), Layout(1, 1, 1), BATCH, "float32", 1,
                       deadline_s=120)


def test_glue_that_does_not_fit_is_a_harness_error_not_a_verdict():
    with pytest.raises(protocol.HarnessFault, match="not a verdict on the target") as e:
        _run("checks.tests.glue_target:GLUE")
    assert "AttributeError" in str(e.value) and "old_name" in str(e.value)


@pytest.mark.parametrize("target", ["checks.tests.glue_target:CRASH", "checks.tests.glue_target:CRASH_UNDER_GLUE"])
def test_the_same_error_raised_by_the_system_is_a_crash_it_must_answer_for(target):
    """Negative control of the classification: no glue declared, or the error raised inside the system the
    glue calls (the spec's own code), is the system's crash: the no-crash property fails."""
    res = _run(target)
    assert not res.ok and [c.prop for c in res.failures()] == ["no-crash"]


def test_replay_exits_3_on_a_harness_error(capsys):
    from dpep_parity.checks.tools import replay
    rc = replay.main(["--target", "checks.tests.glue_target:GLUE", "--unit", "moe", "--fixture", "qwen3-moe",
                      "--layout", "tp1-dp1-ep1", "--layer", "1", "--batch", "dp0:0+3 seed=1"])
    out = capsys.readouterr().out
    assert rc == 3 and out.rstrip().endswith("ERROR")


def _raised_in(code: str, exc: type) -> BaseException:
    try:
        exec(compile(code, "/nowhere/other_package/mod.py", "exec"), {})
    except exc as e:
        return e
    raise AssertionError("did not raise")


def test_classification_reads_the_innermost_frame_outside_torch():
    glue = type("T", (), {"harness_modules": ("dpep_parity.checks.tests.glue_target",)})()
    from dpep_parity.checks.tests import glue_target
    try:
        glue_target._renamed_api()
    except AttributeError as e:
        assert protocol.harness_fault(glue, e)
        assert not protocol.harness_fault(object(), e)              # no glue declared
    elsewhere = _raised_in("x = None\nx.attr", AttributeError)
    assert not protocol.harness_fault(glue, elsewhere)               # raised outside the glue
    assert not protocol.harness_fault(glue, ZeroDivisionError())     # not a glue error type
    assert protocol.harness_fault(object(), protocol.HarnessFault("explicit"))


# ---------------------------------------------------------------- the sglang target's guards (no sglang needed)
def test_a_forward_batch_field_the_release_does_not_declare_is_a_harness_fault():
    from dpep_parity.checks.targets.sglang.eras import set_fields

    @dataclasses.dataclass
    class ForwardBatch:
        num_token_non_padded: int | None = None

    fb = ForwardBatch()
    set_fields(fb, num_token_non_padded=3)
    assert fb.num_token_non_padded == 3
    with pytest.raises(protocol.HarnessFault, match="global_num_token_non_padded"):
        set_fields(fb, global_num_token_non_padded=3)        # 0.5.20's name on a release before it
    assert not hasattr(fb, "global_num_token_non_padded")


def test_a_stand_in_lacking_an_attribute_is_a_harness_fault_that_getattr_still_sees():
    from dpep_parity.checks.targets.sglang.eras import StandIn

    class Runner(StandIn):
        device = "cpu"

    r = Runner()
    assert r.device == "cpu" and getattr(r, "mambaish_config", "default") == "default" and not hasattr(r, "x")
    with pytest.raises(protocol.HarnessFault, match="has no 'lora_manager'"):
        print(r.lora_manager)


def test_the_cpu_row_copy_keeps_the_triton_kernels_contract():
    from dpep_parity.checks.targets.sglang.cpu_shims import _memcpy_rows
    src, dst = torch.arange(12.).view(6, 2), torch.zeros(4, 2)
    _memcpy_rows(dst, src, 0, torch.tensor(2), torch.tensor(3), True)        # src[2:5] -> dst[0:3]
    assert dst[:3].tolist() == src[2:5].tolist() and dst[3].tolist() == [0, 0]
    out = torch.zeros(6, 2)
    _memcpy_rows(out, src[:2], 0, 3, 2, False)                               # src[0:2] -> out[3:5]
    assert out[3:5].tolist() == src[:2].tolist() and out[:3].abs().sum() == 0 and out[5].abs().sum() == 0
    with pytest.raises(IndexError):                                          # the kernel would read past src
        _memcpy_rows(dst, src, 0, 5, 3, True)


def test_the_cpu_torch_view_moves_cuda_tables_to_the_cpu_and_unpins():
    from dpep_parity.checks.targets.sglang.cpu_shims import _CpuTorch
    t = _CpuTorch(torch)
    assert t.full((3,), -1, dtype=torch.int32, device="cuda").device.type == "cpu"
    assert t.tensor([1, 2], pin_memory=True).tolist() == [1, 2]
    assert t.cat is torch.cat
