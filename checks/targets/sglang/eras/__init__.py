"""Era adapters: what the `sglang` target does differently on each SGLang release.

SGLang's internals move in eras (docs/sglang.md, "Releases"): the layer-boundary era (0.5.21 - 0.5.23,
`srt/layers/layer_boundary/`), the communicator era before it (0.5.16 - 0.5.20, `srt/layers/communicator.py`
with `distributed/bootstrap.py`), the pre-bootstrap era (0.5.8 - 0.5.15, the groups from ModelRunner's own
code). Each
era is one module here holding one `Adapter` subclass per release it supports (`ADAPTERS`: version -> class);
`checks.targets.sglang.releases` names the module of every release. The units, the session and the batch
builder call the adapter of the installed release and never test a version themselves.

Imported on the rank processes (an era module imports sglang when its methods run).
"""
from __future__ import annotations

import importlib
from functools import cache

from dpep_parity.checks.core.batches import MAX_LEN


class Adapter:
    """One release's way of doing the steps the target needs. `units`: the units it reaches; `unreached`:
    unit -> why not (the release x unit table of docs/sglang.md is made from these)."""

    units: tuple[str, ...] = ()
    unreached: dict[str, str] = {}
    # DpPaddingMode.get_dp_padding_mode when both modes cost the same: MAX_LEN (0.5.23 layers/dp_attention.py,
    # `sum_len * 2 >= max_len * dp_size`: "prefer MAX_LEN when communication cost is equal")
    padding_ties: str = MAX_LEN

    def setup(self, s, server_args_kw: dict, rank: int, device) -> None:
        """SGLang's parallel state over the suite's process group, and its model config: sets
        s.server_args and s.model_config."""
        raise NotImplementedError

    def teardown(self) -> None:
        raise NotImplementedError

    def init_num_token_non_padded(self, fb, device, n: int) -> None:
        raise NotImplementedError

    def prepare_eager(self, runner, fb) -> None:
        """What the model runner does to a batch before an eager forward (DP padding, gathered-buffer sizes,
        num_token_non_padded), with `runner` standing in for the ModelRunner."""
        from sglang.srt.model_executor.model_runner import ModelRunner
        ModelRunner._prepare_eager_forward_batch(runner, fb)

    def model_is_mrope(self, model_config) -> bool:
        """Whether SGLang keeps M-RoPE positions for this model (ModelConfig.model_is_mrope)."""
        return bool(model_config.model_is_mrope)

    def init_expert_location(self, s) -> None:
        """ModelRunner.maybe_init_expert_location_metadata: the placement the server arguments name
        (init_expert_location, 'trivial' by default) for this rank's MoE-EP rank, published process-wide
        (replacing the previous layout's)."""
        from sglang.srt.distributed.parallel_state import get_moe_expert_parallel_rank
        from sglang.srt.eplb import expert_location as el
        self._publish_expert_location(el, el.compute_initial_expert_location_metadata(
            model_config=s.model_config, moe_ep_rank=get_moe_expert_parallel_rank(),
            **self._expert_location_args(s)))

    def _expert_location_args(self, s) -> dict:
        return {}

    def _publish_expert_location(self, el, metadata) -> None:
        el.set_global_expert_location_metadata(metadata, allow_overwrite=True)

    def initialize_model(self, initialize, model_config, load_config):
        """SGLang's loader `_initialize_model` (passed in) on the model config."""
        return initialize(model_config, load_config, None)

    def batch_fields(self, pools) -> dict:
        """ForwardBatch fields ForwardBatch.init_new takes from the model runner in this release, beyond
        the batch's own (none since 0.5.13: the forward context carries the backend)."""
        return {}

    def token_allocator_class(self):
        """SGLang's TokenToKVPoolAllocator (page size 1)."""
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        return TokenToKVPoolAllocator

    def alloc_rows(self, pool, n: int) -> list[int] | None:
        """n rows of SGLang's ReqToTokenPool, None when it has not that many free."""
        return pool.alloc_rows(n)

    def free_rows(self, pool, rows: list[int]) -> None:
        pool.free_rows(rows)

    def running(self, s, fb):
        """Context manager: the scope the model runner opens around a forward."""
        raise NotImplementedError

    def moe(self, s, fb, block, x, dp: int):
        raise NotImplementedError

    def attention_sum(self, y, fb):
        raise NotImplementedError

    def attend(self, s, attn, fb, x):
        """One layer's self-attention on `x` (this rank's rows): SGLang's attention module called as its decoder
        layer calls it. DeepSeek's latent attention (DeepseekV2AttentionMLA) reads its input from the attention-TP
        context its layer's boundary fills, and takes the layer's zero allocator."""
        if not hasattr(attn, "kv_lora_rank"):
            return attn(positions=fb.positions, hidden_states=x, forward_batch=fb)
        from sglang.srt.layers.layer_boundary import get_attn_tp_context
        from sglang.srt.layers.layer_boundary.adapters.attention import AttentionInputs
        ctx = get_attn_tp_context()
        ctx.set_attn_inputs(AttentionInputs(x, fb, attn.prepare_qkv_latent))
        try:
            out = attn(positions=fb.positions, hidden_states=x, forward_batch=fb, zero_allocator=_zeros(x))
        finally:
            ctx.clear_attn_inputs()
        return out[0] if isinstance(out, tuple) else out

    def layer_forward(self, layer, fb, x):
        """A decoder layer's forward as its model calls it: DeepSeek's takes the model's zero allocator and
        returns (hidden, topk indices)."""
        if "zero_allocator" not in _parameters(type(layer).forward):
            return layer(fb.positions, x, fb)
        out = layer(fb.positions, x, fb, _zeros(x))
        return out[0] if isinstance(out, tuple) else out

    def decoder(self, s, layer, fb, x):
        raise NotImplementedError


def _parameters(fn) -> dict:
    import inspect
    return inspect.signature(fn).parameters


def _zeros(x):
    """The BumpAllocator of zeros DeepseekV2Model.forward makes for its layers (deepseek_v2.py)."""
    import torch
    from sglang.srt.utils import BumpAllocator
    return BumpAllocator(buffer_size=2, dtype=torch.float32, device=x.device)


class StandIn:
    """A stand-in for an SGLang object the harness does not build whole (a model runner, a request): a
    read of an attribute it lacks is the harness's gap, not SGLang's bug (StandInGap)."""

    def __getattr__(self, name):
        raise StandInGap(f"{type(self).__qualname__} (sglang target) has no {name!r}: this release reads it")


def _standin_gap():
    from dpep_parity.checks.targets.protocol import HarnessFault

    class StandInGap(HarnessFault, AttributeError):
        """An AttributeError (hasattr / getattr with a default still see a missing attribute) and a harness
        fault."""
    return StandInGap


StandInGap = _standin_gap()


def set_fields(fb, **values) -> None:
    """Set ForwardBatch fields, each one the installed release declares (a field SGLang renamed would be set
    on the side and never read: a harness fault, not a silent no-op)."""
    import dataclasses

    from dpep_parity.checks.targets.protocol import HarnessFault
    declared = {f.name for f in dataclasses.fields(type(fb))}
    missing = sorted(set(values) - declared)
    if missing:
        raise HarnessFault(f"ForwardBatch of this sglang release has no field {missing}: the era adapter is "
                           "written for another release")
    for k, v in values.items():
        setattr(fb, k, v)


@cache
def adapter(version: str) -> Adapter:
    """The adapter of release `version` (one of releases.supported())."""
    from dpep_parity.checks.targets.sglang import releases
    rel = releases.get(version)
    if rel.era is None:
        raise RuntimeError(f"sglang {version}: {rel.blocked}")
    module = importlib.import_module(f"{__name__}.{rel.era}")
    return module.ADAPTERS[rel.version]()
