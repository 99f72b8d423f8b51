"""What a CPU world's forkserver imports once for the sglang target (its `preload_modules`; checks.harness.world,
`_rank_context`): the modules a rank's first SGLang session imports (SGLang's server arguments, model runner,
loader, its model registry with every model class, the torch-native attention backend, the message queues of
its groups, and this target's own rank-side modules), behind the import shims they need on CPU. Ranks forked
from that process start with them imported, so a world restarted after a hang skips about 10 s of imports per
rank (docs/harness.md, "Recovering from a hang").

Imported for its effect only, never by the test process. It must not raise: the forkserver skips a preload
that raises ImportError and would die of anything else. Each module is tried on its own (a release without
one still gets the others); whatever fails here is imported by the ranks themselves, which report any error
as they always did.
"""
import importlib

MODULES = (
    "sglang.srt.server_args",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_loader.loader",
    "sglang.srt.models.registry",          # imports every model class: 3-4 s here
    "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.distributed.device_communicators.shm_broadcast",
    "dpep_parity.checks.targets.sglang.session",
    "dpep_parity.checks.targets.sglang.units",
    "dpep_parity.checks.targets.sglang.batch",
)

try:
    import os
    if not os.environ.get("DPEP_SGLANG_LOG"):      # as the session's _quiet_sglang: errors only
        import logging
        import warnings
        logging.getLogger("sglang").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module=r"sglang(\.|$)")
    from dpep_parity.checks.targets.sglang import cpu_shims
    cpu_shims.install_import_shims()
except Exception:       # see the docstring: the ranks do it themselves
    pass
else:
    for _name in MODULES:
        try:
            importlib.import_module(_name)
        except Exception:   # noqa: PERF203 (each on its own, see the docstring)
            pass
