"""Known SGLang findings (docs/findings.md) and the museum's shipped bugs on the releases that shipped them
(docs/museum.md) as a predicate, for marking expected failures:

    from dpep_parity.checks.targets.sglang.findings import explained
    reason = explained(res, fixture)      # res: checks.parity.ParityResult
    if reason: pytest.xfail(reason)

A failure is explained only when *every* failed check is: F1 when the unit runs a layer of a Qwen fixture that
transformers builds dense (mlp_only_layers / decoder_sparse_step): the moe and decoder units on such a layer, the model
on a fixture that has one (attention does not touch the MLP); F2 when the only failed check is `dispatch`
with surplus rows (pad rows dispatched) under DP attention; a museum exhibit when the installed release shipped
it and its `explains` predicate holds (every failed check is that bug's signature).
"""
from __future__ import annotations

from dpep_parity.checks import units
from dpep_parity.fixtures.specs import FIXTURES, sparse_layers

F1 = "sglang F1 (docs/findings.md): dense layer built as a MoE block, its weights dropped (B09)"
F1_ARCHS = ("qwen2_moe", "qwen3_moe")     # the model files F1 is in (GLM builds its dense layers dense)
F2 = "sglang F2 (docs/findings.md): padded rows dispatched to experts under DP attention (B11)"


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
    from dpep_parity.checks.targets.sglang import museum, releases
    release = releases.installed_version()
    ex = museum.explaining(res, fixture, release)
    if ex is not None:
        return f"sglang {release}: museum {ex.id} (docs/museum.md): {ex.title}"
    return None


def _reaches_dense_layer(spec, unit: str, layer) -> bool:
    dense = [not s for s in sparse_layers(spec)]
    return units.get(unit).reaches_dense_layer(dense, layer)
