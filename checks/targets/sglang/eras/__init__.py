"""Era adapters: what the `sglang` target does differently on each SGLang release.

SGLang's internals move in eras (docs/sglang.md, "Releases"): the layer-boundary era (0.5.21 - 0.5.23,
`srt/layers/layer_boundary/`), the communicator era before it (`srt/layers/communicator.py`), and so on. Each
era is one module here holding one `Adapter` subclass per release it supports (`ADAPTERS`: version -> class);
`checks.targets.sglang.releases` names the module of every release. The units, the session and the batch
builder call the adapter of the installed release and never test a version themselves.

Imported on the rank processes (an era module imports sglang when its methods run).
"""
from __future__ import annotations

import importlib
from functools import cache


class Adapter:
    """One release's way of doing the steps the target needs. `units`: the units it reaches; `unreached`:
    unit -> why not (the release x unit table of docs/sglang.md is made from these)."""

    units: tuple[str, ...] = ()
    unreached: dict[str, str] = {}

    def setup(self, s, server_args_kw: dict, rank: int, device) -> None:
        """SGLang's parallel state over the suite's process group, and its model config: sets
        s.server_args and s.model_config."""
        raise NotImplementedError

    def teardown(self) -> None:
        raise NotImplementedError

    def init_num_token_non_padded(self, fb, device, n: int) -> None:
        raise NotImplementedError

    def running(self, s, fb):
        """Context manager: the scope the model runner opens around a forward."""
        raise NotImplementedError

    def moe(self, s, fb, block, x, dp: int):
        raise NotImplementedError

    def attention_sum(self, y, fb):
        raise NotImplementedError

    def decoder(self, s, layer, fb, x):
        raise NotImplementedError


@cache
def adapter(version: str) -> Adapter:
    """The adapter of release `version` (one of releases.supported())."""
    from dpep_parity.checks.targets.sglang import releases
    rel = releases.get(version)
    if rel.era is None:
        raise RuntimeError(f"sglang {version}: {rel.blocked}")
    module = importlib.import_module(f"{__name__}.{rel.era}")
    return module.ADAPTERS[rel.version]()
