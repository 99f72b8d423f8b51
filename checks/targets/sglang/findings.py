"""Known SGLang findings (docs/findings.md) and the museum's shipped bugs on the releases that shipped them
(docs/museum.md) as a predicate, for marking expected failures:

    from dpep_parity.checks.targets.sglang.findings import explained
    reason = explained(res, fixture)      # res: checks.judge.parity.ParityResult
    if reason: pytest.xfail(reason)

A failure is explained only when *every* failed check is: F1 when the unit runs a layer of a Qwen fixture that
transformers builds dense (mlp_only_layers / decoder_sparse_step): the moe and decoder units on such a layer, the model
on a fixture that has one (attention does not touch the MLP); F2 when the only failed check is `dispatch`
with surplus rows (pad rows dispatched) under DP attention; F6 when a MiniMax-M2 model unit with dp_lm_head
fails only its ownership check, every rank returning its rows with a vocabulary shard's columns (attention TP 1),
or by a crash in the logits' attention-TP gather (attention TP > 1, the other ranks left waiting); F7 when a GPT-OSS
unit with EP > 1 fails only by a crash in FusedMoE's fused weight loader; a museum exhibit
when the installed release shipped it and its `explains` predicate holds (every failed check is that bug's
signature).
"""
from __future__ import annotations

import re

from dpep_parity.checks import units
from dpep_parity.fixtures.families import sparse_layers
from dpep_parity.fixtures.specs import FIXTURES

F1 = "sglang F1 (docs/findings.md): dense layer built as a MoE block, its weights dropped (B09)"
F1_ARCHS = ("qwen2_moe", "qwen3_moe")     # the model files F1 is in (GLM builds its dense layers dense)
F2 = "sglang F2 (docs/findings.md): padded rows dispatched to experts under DP attention (B11)"
F6 = "sglang F6 (docs/findings.md): MiniMax-M2's lm_head ignores --enable-dp-lm-head: logits of a vocabulary shard"
F6_ARCHS = ("minimax_m2",)
F7 = ("sglang F7 (docs/findings.md): unquantized GPT-OSS does not load with EP > 1 (FusedMoE.weight_loader_fused "
      "copies every expert into the rank's local buffer)")
F7_ARCHS = ("gpt_oss",)
_SHAPES = re.compile(r"returned \((\d+), (\d+)\), owes \((\d+), (\d+)\)")


def explained(res, fixture: str, layer: int | None = None) -> str | None:
    fails = res.failures()
    if not fails:
        return None
    spec = FIXTURES.get(fixture)
    layer = getattr(res, "layer", layer)
    if spec is not None and spec.arch in F1_ARCHS and _reaches_dense_layer(spec, res.unit, layer):
        return F1
    if res.layout.dp > 1 and all(c.prop == "dispatch" and "padded rows dispatched" in c.message
                                 and ": +" in c.message for c in fails):
        return F2
    if spec is not None and spec.arch in F6_ARCHS and res.layout.dp_lm_head and all(
            (c.prop == "ownership" and _vocab_shards(c.message))
            or (c.prop == "no-crash" and "_gather_attn_tp_logits" in c.message) for c in fails):
        return F6
    if spec is not None and spec.arch in F7_ARCHS and res.layout.ep > 1 and all(
            c.prop == "no-crash" and "weight_loader_fused" in c.message for c in fails):
        return F7
    from dpep_parity.checks.targets.sglang import museum, releases
    release = releases.installed_version()
    ex = museum.explaining(res, fixture, release)
    if ex is not None:
        return f"sglang {release}: museum {ex.id} (docs/museum.md): {ex.title}"
    return None


def _vocab_shards(message: str) -> bool:
    """Every rank returned the rows it owes with fewer columns than the vocabulary (a shard of it)."""
    shapes = [tuple(map(int, m)) for m in _SHAPES.findall(message)]
    return bool(shapes) and all(r == ro and c < co for r, c, ro, co in shapes)


def _reaches_dense_layer(spec, unit: str, layer) -> bool:
    dense = [not s for s in sparse_layers(spec)]
    return units.get(unit).reaches_dense_layer(dense, layer)
