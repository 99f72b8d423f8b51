"""Deliberately broken SGLang steps: negative controls for the `sglang` target's units.

Each mutant is the `sglang` target with one SGLang function patched on the ranks for the duration of one
example (undone afterwards: rank processes are shared with the unmutated target). They show that the attention,
decoder and model units observe SGLang's own positions, cache writes, DP offsets and reductions, not a copy of
them, and that the suite's properties fail when those go wrong:

    python -m checks.tools.replay --target checks.targets.sglang.mutants:S01 --unit decoder --fixture qwen3-moe \
        --layout tp2-dp2-ep2 --layer 1 --batch 'dp0:4+1,2+1 dp1:3+1,5+1 seed=5'

| id | what is broken (where) | class |
|---|---|---|
| S01 | decode positions off by one: `clamp_position(seq_lens)` returns seq_lens, not seq_lens - 1 | RoPE / position bug |
| S02 | every KV cache write lands one slot later (`MHATokenToKVPool` / `MLATokenToKVPool.set_kv_buffer`) | cache write bug |
| S03 | every DP rank takes its rows from offset 0 of the gathered buffer (`get_dp_local_info`) | B06 |
| S04 | the MoE output's sum runs twice (`moe.utils._post_experts_sum`) | B14 |
| S05 | the MoE output's sum is skipped: each rank keeps its partial sum (`moe.utils._post_experts_sum`) | SGLang #36884 (GLM's missing post-MoE combine) |
| S06 | the router's top-k weights renormalised in the activation dtype (`moe.topk.select_experts`; bfloat16 runs) | catalog P05 |
| S07 | an idle DP rank returns from the SUM_LEN gather without entering its all-reduce (`dp_attention._dp_gather_via_all_reduce`) | B02 (idle rank skips a collective: the server hangs) |
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from dpep_parity.checks.targets.sglang import SGLangTarget


def _patch_everywhere(module: str, name: str, make: Callable) -> Callable[[], None]:
    """Replace `module.name` by make(original) in that module and in every loaded sglang module that imported
    it by name; returns the undo."""
    import importlib
    mod = importlib.import_module(module)
    original = getattr(mod, name)
    replacement = make(original)
    owners = [m for m in list(sys.modules.values())
              if m is not None and getattr(m, "__name__", "").startswith("sglang")
              and vars(m).get(name) is original]
    for m in owners:
        setattr(m, name, replacement)

    def undo():
        for m in owners:
            setattr(m, name, original)
    return undo


def _patch_method(module: str, cls: str, name: str, make: Callable) -> Callable[[], None]:
    import importlib
    klass = getattr(importlib.import_module(module), cls)
    original = vars(klass)[name]
    setattr(klass, name, make(original))
    return lambda: setattr(klass, name, original)


def _s01():
    def make(original):
        def clamp_position(seq_lens):
            return seq_lens.clamp(min=0).to(original(seq_lens).dtype)
        return clamp_position
    return _patch_everywhere("sglang.srt.model_executor.forward_batch_info", "clamp_position", make)


def _s02():
    import dataclasses

    def later(loc_info):
        if dataclasses.is_dataclass(loc_info):
            return dataclasses.replace(loc_info, loc=loc_info.loc + 1)
        return loc_info + 1

    def make(original):
        def set_kv_buffer(self, layer, loc_info, *args, **kwargs):
            return original(self, layer, later(loc_info), *args, **kwargs)
        return set_kv_buffer
    undo = [_patch_method("sglang.srt.mem_cache.memory_pool", cls, "set_kv_buffer", make)
            for cls in ("MHATokenToKVPool", "MLATokenToKVPool")]      # GQA's cache, DeepSeek's latent cache
    return lambda: [u() for u in undo]


def _s03():
    import torch

    def make(original):
        def get_dp_local_info(forward_batch):
            start, n = original(forward_batch)
            return torch.zeros_like(start), n
        return get_dp_local_info
    return _patch_everywhere("sglang.srt.layers.dp_attention", "get_dp_local_info", make)


def _s04():
    def make(original):
        def _post_experts_sum(hidden_states, *, reduce_ep, reduce_tp):
            once = original(hidden_states, reduce_ep=reduce_ep, reduce_tp=reduce_tp)
            return original(once, reduce_ep=reduce_ep, reduce_tp=reduce_tp)
        return _post_experts_sum
    return _patch_everywhere("sglang.srt.layers.moe.utils", "_post_experts_sum", make)


def _s05():
    def make(original):
        def _post_experts_sum(hidden_states, *, reduce_ep, reduce_tp):
            return hidden_states
        return _post_experts_sum
    return _patch_everywhere("sglang.srt.layers.moe.utils", "_post_experts_sum", make)


def _s06():
    import torch

    def make(original):
        def select_experts(hidden_states, router_logits, topk_config, **kwargs):
            out = original(hidden_states, router_logits, topk_config, **kwargs)
            if not topk_config.renormalize or hidden_states.dtype not in (torch.bfloat16, torch.float16):
                return out
            w = out.topk_weights.to(hidden_states.dtype)
            return out._replace(topk_weights=(w / w.sum(-1, keepdim=True)).to(out.topk_weights.dtype))
        return select_experts
    return _patch_everywhere("sglang.srt.layers.moe.topk", "select_experts", make)


def _s07():
    def make(original):
        def _dp_gather_via_all_reduce(global_tokens, local_tokens, forward_batch, is_partial, *args, **kwargs):
            if local_tokens.shape[0] == 0:          # an idle DP rank: nothing of its own to add, so it skips
                global_tokens.fill_(0)              # the gather's all-reduce, which its peers are waiting in
                return
            return original(global_tokens, local_tokens, forward_batch, is_partial, *args, **kwargs)
        return _dp_gather_via_all_reduce
    return _patch_everywhere("sglang.srt.layers.dp_attention", "_dp_gather_via_all_reduce", make)


@dataclass(frozen=True)
class Mutant:
    id: str
    mechanism: str
    patch: Callable[[], Callable[[], None]]


MUTANTS = {m.id: m for m in (
    Mutant("S01", "decode positions off by one (clamp_position returns seq_lens)", _s01),
    Mutant("S02", "KV cache writes land one slot later (set_kv_buffer loc + 1)", _s02),
    Mutant("S03", "DP rank rows taken from offset 0 of the gathered buffer (get_dp_local_info)", _s03),
    Mutant("S04", "MoE output summed twice (_post_experts_sum)", _s04),
    Mutant("S05", "MoE output's sum skipped, partial sums kept (_post_experts_sum)", _s05),
    Mutant("S06", "top-k weights renormalised in the activation dtype (select_experts)", _s06),
    Mutant("S07", "an idle DP rank skips the SUM_LEN gather's all-reduce (_dp_gather_via_all_reduce)", _s07),
)}


class SGLangMutant(SGLangTarget):
    """The sglang target with one SGLang step broken while an example runs."""

    def __init__(self, mutant_id: str):
        super().__init__()
        self.mutant = MUTANTS[mutant_id]
        self.name = f"sglang+{mutant_id}"

    def known_failure(self, result, fixture, layer):
        return None      # a mutant's failures are the point: never reported as SGLang's known findings

    def run(self, built, step):
        from dpep_parity.checks.targets.sglang import session
        session.session_for(built.env)          # SGLang imported and set up before its functions are patched
        with _patched(self.mutant):
            return super().run(built, step)


@contextmanager
def _patched(mutant: Mutant):
    undo = mutant.patch()
    try:
        yield
    finally:
        undo()


S01, S02, S03, S04, S05, S06, S07 = (SGLangMutant(i) for i in MUTANTS)
