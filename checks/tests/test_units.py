"""The unit registry (checks/units/): what each unit declares, and that a new unit is one module."""
from __future__ import annotations

import sys

import pytest
import torch

from dpep_parity.checks import units
from dpep_parity.checks.core.batches import Batch, Request, seq_inputs, seq_token_ids
from dpep_parity.registry import Registry

CONFIG = {"hidden_size": 8, "vocab_size": 11}
BATCH = Batch(((Request(3, 2), Request(0, 4)), (), (Request(5, 1),)), seed=7)


def test_registry_lists_the_four_units_in_order_and_names_them_on_a_typo():
    assert units.UNITS == ("moe", "attention", "decoder", "model")
    with pytest.raises(ValueError, match="unknown unit 'mlp'.*moe, attention, decoder, model"):
        units.get("mlp")


def test_inputs_are_what_each_unit_takes():
    seqs = seq_inputs(BATCH, 8, torch.float32)
    assert [s.shape[0] for s in seqs] == [5, 4, 6]
    rows = units.get("moe").global_inputs(BATCH, CONFIG, torch.float32)
    assert len(rows) == 1 and torch.equal(rows[0], torch.cat([seqs[0][3:], seqs[1], seqs[2][5:]]))
    for name in ("attention", "decoder"):
        got = units.get(name).global_inputs(BATCH, CONFIG, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(got, seqs, strict=True))
    ids = units.get("model").global_inputs(BATCH, CONFIG, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(ids, seq_token_ids(BATCH, 11), strict=True))
    # a DP rank draws only its own requests, with the values the global draw gives them
    for name in units.UNITS:
        u = units.get(name)
        glob = u.sequences(BATCH, CONFIG, torch.float32)
        mine = u.rank_inputs(BATCH, 2, CONFIG, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(mine, u.inputs(glob[2:], CONFIG, torch.float32), strict=True))
    # an idle DP rank's MLP still gets one (empty) tensor: the rank runs its collectives
    idle = units.get("moe").rank_inputs(BATCH, 1, CONFIG, torch.bfloat16)
    assert len(idle) == 1 and idle[0].shape == (0, 8) and idle[0].dtype == torch.bfloat16
    # another seed, another request or another part draws other values
    other = seq_inputs(Batch(BATCH.per_dp, seed=8), 8, torch.float32)
    assert not torch.equal(other[0], seqs[0]) and not torch.equal(seqs[0][3:5], seqs[0][0:2])


def test_outputs_layers_and_checks_per_unit():
    sparse = [True, False, True]
    dense = [not s for s in sparse]
    want = {  # name: (output key, width, layer for a drawn 2, sparse routers run at layer 1, dense MLP at 1)
        "moe": ("out", 8, 2, [], True),
        "attention": ("out", 8, 2, [], False),
        "decoder": ("out", 8, 2, [], True),
        "model": ("logits", 11, 0, [0, 2], True),
    }
    for name, (key, width, layer, routers, reaches) in want.items():
        u = units.get(name)
        assert (u.output, u.width(CONFIG), u.layer(2), u.sparse_layers_run(sparse, 1),
                u.reaches_dense_layer(dense, 1)) == (key, width, layer, routers, reaches), name
    assert units.get("moe").sparse_layers_run(sparse, 2) == [2]
    assert not units.get("decoder").reaches_dense_layer(dense, 0)


def test_a_new_unit_is_one_module(tmp_path, monkeypatch):
    (tmp_path / "shared_expert.py").write_text(
        "from dpep_parity.checks.units import Unit\n"
        "UNIT = Unit('shared_expert', 10, 'rows', lambda *a: None, lambda *a: [], dispatch=False)\n")
    monkeypatch.setattr(units, "__path__", [*units.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "dpep_parity.checks.units.shared_expert", raising=False)
    try:     # a registry read afresh, as the package's is on a process's first read
        found = dict(Registry("units", package=units.__name__, attr="UNIT", accept=units.Unit,
                              order=lambda u: (u.order, u.name)))
    finally:
        sys.modules.pop("dpep_parity.checks.units.shared_expert", None)
    assert tuple(found) == (*units.UNITS, "shared_expert")
    assert found["shared_expert"].output == "out"
