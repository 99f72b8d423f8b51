"""The units the suite checks, one module each (moe, attention, decoder, model), in one registry.

A unit says what it takes (per-request hidden sequences, the extend rows only, or token ids), what every rank
returns (its key and width), how the single-device oracle computes it (truth, reference and the decoy-company
variants), and which unit-specific checks apply (routing over one layer or every layer, dispatch counts, the
greedy token). The judge (checks.judge.parity), the rank job (checks.harness.unitjob), the strategies and the tools read
these fields instead of testing unit names.

Adding a unit is one module in this package defining ``UNIT = Unit(...)``, or an entry point of group
``dpep_parity.units`` in an outside package (and each target's implementation
of it: a target that does not implement a unit lists only the others in its ``units``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from dpep_parity.checks.core.batches import Batch, seq_inputs, seq_token_ids
from dpep_parity.registry import Registry

if TYPE_CHECKING:
    from dpep_parity.checks.oracle.reference import Oracle, UnitRef


@dataclass(frozen=True)
class Unit:
    name: str
    order: int                                   # position in UNITS (reports, sweeps)
    takes: Literal["sequences", "rows", "tokens"]
    # sequences: per request [prefix+extend, hidden]; rows: the extend rows of every request as one tensor
    # (an MLP sees no prefix); tokens: per request token ids (a whole model)
    reference: Callable[[Oracle, int, Batch, list[torch.Tensor]], UnitRef]   # truth and reference
    decoys: Callable[[Oracle, int, Batch, list[torch.Tensor]], list[torch.Tensor]]
    whole_model: bool = False    # every layer: the layer is always 0, DP lm-head layouts apply, a change at one
    #                              token carries to the later tokens of its request, the greedy token is checked
    dispatch: bool = False       # the rows dispatched per expert are checked (a sparse layer's MLP runs)

    @property
    def output(self) -> str:
        """The key of each rank's output."""
        return "logits" if self.whole_model else "out"

    def width(self, config: dict) -> int:
        return config["vocab_size"] if self.whole_model else config["hidden_size"]

    def layer(self, drawn: int) -> int:
        return 0 if self.whole_model else drawn

    def describe(self, layer: int) -> str:
        return "model logits" if self.whole_model else f"{self.name} layer {layer}"

    def sparse_layers_run(self, sparse: list[bool], layer: int) -> list[int]:
        """The sparse layers whose router this unit runs."""
        if self.whole_model:
            return [i for i, s in enumerate(sparse) if s]
        return [layer] if sparse[layer] else []

    def reaches_dense_layer(self, dense: list[bool], layer: int | None) -> bool:
        """Whether this unit runs a dense layer's MLP."""
        if self.whole_model:
            return any(dense)
        return self.dispatch and layer is not None and dense[layer]

    def sequences(self, batch: Batch, config: dict, dtype: torch.dtype, only=None) -> list[torch.Tensor]:
        """Per request in global order (only the global request indices in `only`, if given), rebuilt from the
        batch's seed: hidden [prefix+extend, hidden] (a unit that takes rows: the extend rows alone), or the
        token ids of a unit that takes tokens."""
        if self.takes == "tokens":
            return seq_token_ids(batch, config["vocab_size"], only)
        return seq_inputs(batch, config["hidden_size"], dtype, only=only, extend_only=self.takes == "rows")

    def global_inputs(self, batch: Batch, config: dict, dtype: torch.dtype) -> list[torch.Tensor]:
        """The unit's inputs of every request in global order."""
        return self.inputs(self.sequences(batch, config, dtype), config, dtype)

    def rank_inputs(self, batch: Batch, dp_rank: int, config: dict, dtype: torch.dtype) -> list[torch.Tensor]:
        """The unit's inputs of one DP rank's requests (only those are drawn)."""
        mine = batch.local_slice(dp_rank)
        return self.inputs(self.sequences(batch, config, dtype, range(mine.start, mine.stop)), config, dtype)

    def inputs(self, seqs: list[torch.Tensor], config: dict, dtype: torch.dtype) -> list[torch.Tensor]:
        """Inputs from the requests' sequences (`sequences`): as they are, or, for a unit that takes rows, their
        extend rows as one tensor (an MLP sees no prefix; an idle rank gets an empty one and still runs its
        collectives)."""
        if self.takes != "rows":
            return seqs
        return [torch.cat(seqs) if seqs else torch.zeros(0, config["hidden_size"], dtype=dtype)]


# the units: one module per unit here (UNIT), and outside packages' entry points (group dpep_parity.units)
REGISTRY: Registry[Unit] = Registry("units", package=__name__, attr="UNIT", accept=Unit,
                                    order=lambda u: (u.order, u.name))
UNITS: tuple[str, ...] = tuple(REGISTRY)


def get(name: str) -> Unit:
    try:
        return REGISTRY.lookup(name)
    except KeyError as e:
        raise ValueError(e.args[0]) from None
