"""A correct target that supports only layouts without DP attention (dp = 1): for tests of how the suite
accounts for skipped examples."""
from __future__ import annotations

from dpep_parity.checks.targets.spec import SpecTarget


class DpOneOnly(SpecTarget):
    name = "spec-dp1-only"

    def skip_reason(self, unit, config, layout):
        if layout is not None and layout.dp > 1:
            return "this target has no DP attention (dp > 1 unsupported)"
        return None


TARGET = DpOneOnly()
