"""Sequences of forwards on one build: state must not leak from one forward into the next.

A serving engine builds its model once and runs forward after forward on it, with batches of changing shape,
DP ranks going idle and coming back, persistent buffers reused. Faults that live between forwards (a buffer
not cleared, metadata captured for the first batch shape and replayed for the next, memory assumed zero)
pass every single-forward example. This hypothesis state machine builds a target once per run (its own
build, not shared with other tests) and runs a sequence of forwards on it, each judged against one device
like any parity example, with poisoned allocations (checks.harness.poison: fresh float memory holds NaN), so a read
of memory the target never wrote fails at once instead of when the allocator happens to return garbage.
Besides new batches, a rule rebalances the last batch: the same requests moved to other DP ranks (same
total, other offsets), where metadata captured per batch size goes stale. Hypothesis shrinks a failure to
the shortest sequence of batches that shows it.
"""
from __future__ import annotations

import uuid

from hypothesis import settings, target
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dpep_parity.checks import units
from dpep_parity.checks.core.batches import Batch
from dpep_parity.checks.core.records import expect
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.targets.protocol import UNITS, known_failure, resolve, skip_reason
from dpep_parity.fixtures.build import fixture_path
from dpep_parity.fixtures.families import fixture_config
from dpep_parity.fixtures.specs import FIXTURES
from dpep_parity.property_tests import search
from dpep_parity.property_tests.strategies import Example, batches, layouts_for

STEPS = 4      # forwards per run: enough for a shape change, an idle rank and a return to an earlier shape


class ForwardSequence(RuleBasedStateMachine):
    suite = None   # set by the test (a session fixture cannot reach a state machine directly)
    units: tuple[str, ...] = UNITS     # the units a run may draw (a subclass can narrow them)

    @initialize(data=st.data())
    def build(self, data):
        s, target = self.suite, resolve(self.suite.target)
        self.unit = data.draw(st.sampled_from([u for u in self.units if u in target.units]), label="unit")
        self.fixture = data.draw(st.sampled_from(sorted(s.fixtures)), label="fixture")
        config = fixture_config(self.fixture)
        lays = [lay for lay in layouts_for(self.fixture, s.world_sizes, with_dp_lm_head=units.get(self.unit).whole_model)
                if not skip_reason(target, self.unit, config, lay)]
        if not lays:
            search.rejected(f"skipped: target {target.name} skips every layout of {self.fixture} for {self.unit}")
        self.layout = data.draw(st.sampled_from(lays), label="layout")
        self.dtype = data.draw(st.sampled_from(list(s.dtypes)), label="dtype")
        n_layers = FIXTURES[self.fixture].num_hidden_layers
        self.layer = 0 if units.get(self.unit).whole_model else data.draw(st.integers(0, n_layers - 1), label="layer")
        self.build_id = uuid.uuid4().hex          # a build of its own: no state from other runs or tests
        self.forwards = 0
        self.worst = None
        self.last: Batch | None = None

    @rule(data=st.data())
    def forward(self, data):
        """A new batch: any shape, DP ranks extending, decoding or idle."""
        self.run(data.draw(batches(self.layout.dp, allow_all_idle=False), label=f"batch {self.forwards + 1}"))

    @precondition(lambda self: self.last is not None and self.layout.dp > 1)
    @rule(data=st.data())
    def rebalance(self, data):
        """The same work spread differently: the last batch's requests moved k DP ranks on (0 < k < dp). The
        total is unchanged, so metadata captured per batch size (as CUDA graphs are) is replayed for it."""
        per = self.last.per_dp
        k = data.draw(st.integers(1, len(per) - 1), label="shift")
        self.run(Batch(per[-k:] + per[:-k], self.last.seed))

    def run(self, batch: Batch):
        s = self.suite
        self.last = batch
        ex = Example(self.fixture, self.layout, batch, self.dtype, self.layer)
        res = run_example(s.target, self.unit, str(fixture_path(self.fixture)), self.layout, batch, self.dtype,
                          self.layer, s.device, s.deadline, poison=True, build_id=self.build_id)
        self.forwards += 1
        r = search.accept(self.unit, ex, res, known_failure(resolve(s.target), res, self.fixture, self.layer),
                          steer=False)
        if r is not None:
            self.worst = max(r, self.worst or r)
        expect(res, f"forward {self.forwards} of one build (poisoned allocations) failed:\n{res.report()}\n"
                    f"the steps hypothesis prints reproduce it; if the last forward fails alone too: "
                    f"{ex.replay(self.unit, s.target)}", ex.replay(self.unit, s.target))

    def teardown(self):
        if getattr(self, "worst", None) is not None:   # steer toward the sequence closest to failing
            target(self.worst, label=f"{self.unit}: worst error / bound over a sequence")


def test_forward_sequences_on_one_build(suite):
    """Forward after forward on one build, batches changing shape, DP ranks idling: each equals one device."""
    ForwardSequence.suite = suite
    n = max(3, settings.default.max_examples // 2)
    run_state_machine_as_test(ForwardSequence, settings=settings(settings.default, max_examples=n,
                                                                 stateful_step_count=STEPS))
