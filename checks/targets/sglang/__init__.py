"""The `sglang` target: SGLang's real layers (the releases of `releases.py`) under the property suite, on every rank of the
suite's torch.distributed world (gloo on CPU, NCCL on GPU runners). See docs/sglang.md.

    python -m pytest property_tests --target checks.targets.sglang:TARGET --world-sizes 1,2,4

This module is light: it checks the installed release (importlib.metadata, `releases`) and, in rank processes, installs
the import-time stand-ins (cpu_shims: torchvision, sgl_kernel) *before* anything imports sglang (the ranks import this
module to resolve the target). SGLang itself is imported on the ranks only, in `session` (SGLang's state per layout: parallel runtime,
model, KV pools, attention backend), `batch` (ForwardBatch per step) and `units` (moe, attention, decoder,
model). What differs between releases is in `eras/` (one adapter module per era, chosen by the installed
release); `museum/` holds SGLang's shipped bugs reproduced on the releases that shipped them.
"""
from __future__ import annotations

import multiprocessing
import sys

from dpep_parity.checks.core.batches import MAX_LEN
from dpep_parity.checks.targets.sglang import cpu_shims, releases

# Rank processes (spawned children of the suite's World) import this module to resolve the target, before
# anything imports sglang: install the import stand-ins there. The parent process (pytest) never imports
# sglang and keeps the real import behaviour (transformers probes torchvision with find_spec).
if multiprocessing.parent_process() is not None:
    cpu_shims.install_import_shims()

INSTALL_HINT = ("run scripts/install_sglang_cpu.sh (another release: scripts/install_sglang_cpu.sh --release X, "
                "docs/sglang.md) or pip install dpep-parity[sglang]")


def sglang_version() -> str | None:
    return releases.installed_version()


def unavailable_reason() -> str | None:
    """None when a supported sglang is installed; else the message (missing / unknown / unsupported)."""
    v = sglang_version()
    if v is None:
        return f"sglang is not installed: {INSTALL_HINT}"
    supported = ", ".join(r.version for r in releases.supported())
    try:
        rel = releases.get(v)
    except releases.UnknownRelease:
        return (f"sglang {v} is installed but the sglang target knows only the releases of "
                f"checks/targets/sglang/releases.py (supported: {supported}): install one of them ({INSTALL_HINT})")
    if not rel.supported:
        return f"sglang {v} is installed but the sglang target cannot run it: {rel.blocked} (supported: {supported})"
    return None


def _fail(reason: str):
    """A missing sglang skips (under pytest: the test is SKIPPED with the reason); an unsupported version
    fails with the message."""
    if reason.startswith("sglang is not installed") and "pytest" in sys.modules:
        import pytest
        raise pytest.skip.Exception(reason, allow_module_level=True)
    raise RuntimeError(reason)


class SGLangTarget:
    """SGLang's model on the suite's worlds; `placement`: a static expert placement of session.PLACEMENTS
    given to SGLang as --init-expert-location (None: its trivial placement); `server_options`: further server
    arguments, (name, value) pairs of ServerArgs (an option SGLang offers under DP attention)."""

    def __init__(self, placement: str | None = None, server_options: tuple = (), name: str | None = None,
                 invariances: tuple = ()):
        self.placement = placement
        self.server_options = tuple(server_options)
        self.name = name or ("sglang" if placement is None else f"sglang-{placement}-experts")
        self.invariances = frozenset(invariances)     # what this configuration promises (checks/judge/invariance.py)

    # This package is glue around SGLang: an ImportError / AttributeError / TypeError raised in it means an
    # adapter does not fit the installed release, a harness error, never a verdict on SGLang (protocol).
    harness_modules = ("dpep_parity.checks.targets.sglang",)
    # SGLang's imports, done once by a CPU world's forkserver: a world restarted after a hang skips them
    preload_modules = ("dpep_parity.checks.targets.sglang.preload",)
    sessions = True          # serving sessions keep their KV cache in SGLang's pools (units.serve_model)

    @staticmethod
    def report_header(device: str) -> list[str]:
        """What the pytest header says of this target on `device`: on a GPU, which of SGLang's kernels run."""
        import importlib.util

        from dpep_parity.checks.harness.gpus import drives_gpus
        if not drives_gpus(device):
            return []
        from dpep_parity.checks.targets.sglang.session import ATTENTION_BACKEND
        kernels = "found (a rank that cannot import it runs the stand-in below)" if importlib.util.find_spec(
            "sgl_kernel") else (
            "absent: a stand-in in every rank; each SGLang fused op whose CUDA path calls it runs its own "
            "forward_native instead, and the fused RoPE + KV-cache write is off (the backend writes the cache), "
            "each named on the rank's stderr ('dpep: SGLang kernel replaced: ...'; cpu_shims._CUDA_SHIMS)")
        return [f"dpep: sglang on {device}: attention backend {ATTENTION_BACKEND}, CUDA graphs off; "
                f"sgl_kernel {kernels}"]

    @property
    def units(self) -> tuple[str, ...]:
        # Read by the suite before it runs anything (protocol.resolve / test_parity.evaluate): the place
        # where a missing sglang becomes a skip with its reason rather than an import error on the ranks.
        reason = unavailable_reason()
        if reason:
            _fail(reason)
        return self._adapter().units

    @property
    def padding_ties(self) -> str:
        return self._adapter().padding_ties if not unavailable_reason() else MAX_LEN

    def skip_reason(self, unit, config, layout) -> str | None:
        """A unit the installed release's adapter does not reach: why (docs/sglang.md, release x unit)."""
        if unit in self.units:
            return None
        why = self._adapter().unreached.get(unit, "no adapter step for this unit")
        return f"sglang {sglang_version()}: {why}"

    @staticmethod
    def _adapter():
        from dpep_parity.checks.targets.sglang import eras
        return eras.adapter(sglang_version())

    def known_failure(self, result, fixture, layer):
        from dpep_parity.checks.targets.sglang.findings import explained
        return explained(result, fixture, layer)

    def build(self, unit, env):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        from dpep_parity.checks.targets.sglang import session
        return session.build(unit, env, self.placement, self.server_options)

    def run(self, built, step):
        from dpep_parity.checks.targets.sglang import units
        return units.run(built, step)


TARGET = SGLangTarget()
# The same, serving with every expert moved to another physical slot (another rank under EP): EPLB's static
# placement, which must change no token's experts (museum M39580).
ROTATED_EXPERTS = SGLangTarget(placement="rotated")
# The same with the dense layers' MLP fully data-parallel (--moe-dense-tp-size 1: replicated weights, each DP
# rank's rows alone, no gather and no sum), SGLang's option for models with dense layers (DeepSeek, GLM).
DENSE_FULLY_DP = SGLangTarget(server_options=(("moe_dense_tp_size", 1),), name="sglang-moe-dense-tp1")
# SGLang's deterministic inference (--enable-deterministic-inference: batch-invariant GEMM / log-softmax / mean
# kernels, fixed-split attention): a request's output independent of its batch, what the mode promises (its
# docs; TP invariance is an open request, #15041). It needs a deterministic attention backend (FA3, FlashInfer,
# Triton, ...) and Triton kernels: on a CPU host SGLang refuses to start it (docs/property-suite.md).
DETERMINISTIC = SGLangTarget(server_options=(("enable_deterministic_inference", True),),
                             name="sglang-deterministic", invariances=("batch",))
