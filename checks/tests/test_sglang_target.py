"""The `sglang` target's units can fail: deliberately broken SGLang steps (checks.targets.sglang.mutants) are
caught by the attention / moe, decoder and model units, while unmutated SGLang passes the same examples; and
finding F3 (DP attention with the torch-native backend) reproduces without its workaround.

Skipped without a supported sglang (scripts/install_sglang_cpu.sh); CI installs it.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from dpep_parity.checks.batches import parse_batch
from dpep_parity.checks.parity import run_example
from dpep_parity.checks.targets.sglang import unavailable_reason
from dpep_parity.checks.topology import Layout
from dpep_parity.fixtures.build import fixture_path

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

# (mutant, layout, batch that reaches the broken step, units that must catch it)
KILLS = [
    ("S01", Layout(2, 2, 2), "dp0:4+1,2+1 dp1:3+1,5+1 seed=5", ("attention", "decoder", "model")),   # decode
    ("S02", Layout(2, 1, 1), "dp0:0+3,2+2 seed=5", ("attention", "decoder", "model")),               # cache
    ("S03", Layout(2, 2, 2), "dp0:0+3 dp1:2+2 seed=6", ("moe", "decoder", "model")),                 # SUM_LEN
    ("S04", Layout(2, 1, 1), "dp0:0+3,2+2 seed=5", ("moe", "decoder", "model")),                     # tp > 1
]


# Every other model family: the DP gather and the MoE output's reduction broken (SGLang #36884 / #37187 /
# #23431 were exactly these, in GLM's, GPT-OSS's and MiniMax-M2's model files).
FAMILY_KILLS = {
    "glm4-moe": [
        ("S03", Layout(2, 2, 2), "dp0:0+3 dp1:2+2 seed=6", ("moe", "decoder", "model")),
        ("S04", Layout(2, 2, 1), "dp0:0+3,2+2 dp1:0+2 seed=5", ("moe", "decoder", "model")),
        ("S05", Layout(2, 1, 2), "dp0:0+3,2+2 seed=5", ("moe", "decoder", "model")),
    ],
    "deepseek-v3": [
        ("S02", Layout(2, 1, 1), "dp0:0+3,2+2 seed=5", ("attention", "decoder", "model")),   # latent cache
        ("S03", Layout(2, 2, 2), "dp0:0+3 dp1:2+2 seed=6", ("moe", "decoder", "model")),
        ("S04", Layout(2, 2, 1), "dp0:0+3,2+2 dp1:0+2 seed=5", ("moe", "decoder", "model")),
        ("S05", Layout(2, 1, 2), "dp0:0+3,2+2 seed=5", ("moe", "decoder", "model")),
    ],
}


def test_broken_sglang_steps_are_caught():
    _kills("qwen3-moe", KILLS)


@pytest.mark.parametrize("fixture", sorted(FAMILY_KILLS))
def test_broken_steps_are_caught_in_every_family(fixture):
    _kills(fixture, FAMILY_KILLS[fixture])


def _kills(fixture: str, kills) -> None:
    model = str(fixture_path(fixture))
    problems = []
    for mutant, layout, text, units in kills:
        batch = parse_batch(text)
        for unit in units:
            layer = 0 if unit == "model" else 1        # layer 1 is sparse in every fixture here
            good = run_example("sglang", unit, model, layout, batch, "float32", layer, deadline_s=300)
            if not good.ok:        # positive control: SGLang itself passes the example
                problems.append(f"unmutated sglang failed {unit} {layout} [{text}]:\n{good.report()}")
            bad = run_example(f"checks.targets.sglang.mutants:{mutant}", unit, model, layout, batch, "float32",
                              layer, deadline_s=300)
            caught = {c.prop for c in bad.failures()} & {"parity", "routing", "greedy"}
            if not caught:
                problems.append(f"{mutant} not caught by {unit} {layout} [{text}]: "
                                f"{[c.prop for c in bad.failures()] or 'passed'}\n{bad.report()}")
    assert not problems, "\n\n".join(problems)


F3_PROBE = """
from dpep_parity.checks.targets.sglang import cpu_shims
cpu_shims.install_import_shims()
import inspect
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
src = inspect.getsource(ForwardBatch._pad_inputs_to_size)
assert "get_cuda_graph_seq_len_fill_value()" in src and "get_cpu_graph_seq_len_fill_value()" in src, src
assert not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value")
backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
try:
    backend.get_cuda_graph_seq_len_fill_value()
except NotImplementedError:
    print("F3 reproduced")
"""


def test_finding_f3_torch_native_backend_has_no_fill_value():
    """F3 (docs/findings.md): the DP padding step asks the attention backend for the sequence length of padded
    requests; TorchNativeAttnBackend has no answer (no CPU method, the base class's CUDA method raises)."""
    out = subprocess.run([sys.executable, "-c", F3_PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "F3 reproduced" in out.stdout, out.stderr[-3000:]
