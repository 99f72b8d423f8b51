"""Targets around the spec whose glue breaks in the three ways a harness meets a system it drives: for the
tests of harness faults (checks.targets.protocol.harness_modules)."""
from __future__ import annotations

from dpep_parity.checks.targets.spec import SpecTarget


def _renamed_api():
    """Glue calling a function the system under test renamed: an AttributeError raised in the glue."""
    import types
    system = types.SimpleNamespace(new_name=lambda: None)
    return system.old_name()


class GlueDoesNotFit(SpecTarget):
    """Its glue module (this one) does not fit the system: every run is a harness fault."""
    name = "spec-glue-does-not-fit"
    harness_modules = ("dpep_parity.checks.tests.glue_target",)

    def run(self, built, step):
        _renamed_api()


class SystemCrashes(SpecTarget):
    """The same AttributeError, raised by the system itself (no harness module declared): a crash of the
    system, which the no-crash property must report."""
    name = "spec-system-crashes"

    def run(self, built, step):
        _renamed_api()


class SystemCrashesUnderGlue(SpecTarget):
    """Glue declared, but the error is raised inside the system it calls (the spec's code here, outside the
    glue module): still the system's crash."""
    name = "spec-crash-under-glue"
    harness_modules = ("dpep_parity.checks.tests.glue_target",)

    def run(self, built, step):
        return super().run(None, step)     # the spec's run on a build it cannot use: raises inside the spec


GLUE = GlueDoesNotFit()
CRASH = SystemCrashes()
CRASH_UNDER_GLUE = SystemCrashesUnderGlue()
