"""CPU stand-ins that let SGLang's real layers run on a CPU / gloo world. Nothing here touches the parallel
logic under test (group maps, gathers, scatters, reductions, padding modes, expert placement): each shim
replaces a device kernel or a device lookup that has no CPU path in sglang 0.5.23, and names the SGLang
function it stands in for. `install(device)` applies them only for device == "cpu"; on CUDA SGLang runs
unpatched. `install_torchvision_standin()` is import-time and runs before sglang is imported.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_INSTALLED: dict[str, object] = {}


# ---------------------------------------------------------------- import time
class _Unavailable:
    """Any torchvision attribute: resolvable at import time (module-level aliases, default arguments),
    raising the moment it is used."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unavailable(f"{self._name}.{item}")

    def __call__(self, *a, **k):
        raise RuntimeError(f"{self._name}: torchvision is a stand-in here (checks/targets/sglang/cpu_shims.py); "
                           "the parity target never runs SGLang's multimodal code")

    def __repr__(self):
        return f"<torchvision stand-in {self._name}>"


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for `torchvision` (imported unconditionally by sglang.srt.multimodal.internvl_utils via
    sglang.srt.configs, on the import path of every model module). PyPI's torchvision needs CUDA torch and
    fails to import beside the CPU torch ("operator torchvision::nms does not exist")."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []
        module.__version__ = "0.0.0+dpep.standin"
        module.__dpep_standin__ = True
        module.__getattr__ = lambda name, _m=module.__name__: _Unavailable(f"{_m}.{name}")


def install_torchvision_standin() -> bool:
    """Install the stand-in unless a working torchvision is importable. Returns True if installed."""
    if "torchvision" in _INSTALLED:
        return True
    if importlib.util.find_spec("torchvision") is not None:
        try:
            import torchvision  # noqa: F401
            return False                    # a real, working torchvision (GPU runners)
        except Exception:
            for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
                del sys.modules[name]
    finder = _TorchvisionStandIn()
    sys.meta_path.insert(0, finder)
    _INSTALLED["torchvision"] = finder
    return True


def set_cpu_thread_binding(world_size: int) -> None:
    """sglang's CPU thread binding (numa_utils.init_threads_binding, called from
    bootstrap.init_parallel_runtime) asserts on NUMA layouts unless SGLANG_CPU_OMP_THREADS_BIND names one
    core set per rank: give rank r the core r mod ncores."""
    n = os.cpu_count() or 1
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % n) for r in range(world_size))


# ---------------------------------------------------------------- run time (device == "cpu" only)
def install(device: str) -> list[str]:
    """Apply the run-time shims for `device`; returns the names applied (none unless device is cpu)."""
    if device != "cpu":
        return []
    done = []
    for name, fn in _SHIMS:
        if name not in _INSTALLED:
            _INSTALLED[name] = fn()
        done.append(name)
    return done


_SHIMS: list = []
