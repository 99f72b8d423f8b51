"""Targets for the protocol's `sessions` flag (checks/tests/test_serving.py): the spec without KV caches kept
across steps, which refuses a step that names a serving session, and the same code claiming sessions."""
from __future__ import annotations

from dpep_parity.checks.targets.spec import SpecTarget


class Sessionless(SpecTarget):
    """Correct, and keeps nothing between steps: every step must carry each request's tokens from its start."""
    name = "spec-sessionless"
    sessions = False

    def run(self, m, step):
        if step.serving is not None:
            raise RuntimeError("spec-sessionless keeps no KV cache, yet the step names a serving session")
        return super().run(m, step)


class ClaimsSessions(Sessionless):
    """The same target declaring `sessions = True`: the engine sends sessions, which it refuses."""
    name = "spec-claims-sessions"
    sessions = True


TARGET = Sessionless()
CLAIMS = ClaimsSessions()
