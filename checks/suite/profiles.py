"""Hypothesis profiles: one settings layer for the whole suite.

    ci       derandomized, 12 examples, no database (the default)
    dev      30 examples, random seeds
    fuzz     500 examples, random seeds, failing examples kept in .hypothesis/fuzz-examples
    release  derandomized, 150 examples
    gpu      derandomized, 40 examples: for `--device cuda` runs (docs/gpu.md)
    kill     ci without the shrink phase: the kill table needs the first failure, not the smallest one (a
             stateful failure can take minutes of world runs to shrink)

Chosen with `--hypothesis-profile NAME` (hypothesis's own option) or `DPEP_PROFILE=NAME`. `DPEP_MAX_EXAMPLES=N`
always wins over the profile's count, whichever way the profile was chosen, and the run records the real
profile it used: `fuzz+max_examples=3`, never an anonymous override.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

# Health checks are suppressed one by one, each for a reason; the others stay on.
SUPPRESSED = {
    HealthCheck.too_slow:
        "an example starts collectives across a world of rank processes and runs a model: seconds per example "
        "is the design, not a slow strategy",
    HealthCheck.filter_too_much:
        "examples a target skips (an unsupported layout) or that hit a written-up known failure are rejected; "
        "property_tests/search.py's floor replaces this check: a property with fewer real examples than half "
        "of max_examples fails, naming the rejection reasons",
}

_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=list(SUPPRESSED))
PROFILES = {
    "ci": dict(derandomize=True, max_examples=12, database=None),
    "dev": dict(max_examples=30),
    "fuzz": dict(max_examples=500, database=DirectoryBasedExampleDatabase(".hypothesis/fuzz-examples")),
    "release": dict(derandomize=True, max_examples=150, database=None),
    # GPU runners: examples are cheap on the device once the worlds are up, so search more of them; still
    # derandomized, so a device run is reproducible. The production-size tier (test_gpu.py) takes a quarter.
    "gpu": dict(derandomize=True, max_examples=40, database=None),
    "kill": dict(derandomize=True, max_examples=12, database=None,
                 phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target]),
}
for _name, _kw in PROFILES.items():
    settings.register_profile(_name, **_COMMON, **_kw)


def problems() -> list[str]:
    """Broken profile environment variables (the pytest plugin reports them as a usage error)."""
    out = []
    name = os.environ.get("DPEP_PROFILE")
    if name and name not in PROFILES:
        out.append(f"DPEP_PROFILE: unknown profile {name!r}; known: {', '.join(PROFILES)}")
    n = os.environ.get("DPEP_MAX_EXAMPLES")
    if n is not None and not (n.strip().isdigit() and int(n) >= 1):
        out.append(f"DPEP_MAX_EXAMPLES: {n!r} is not a positive integer")
    return out


def load_default() -> None:
    """At import of the pytest plugin: DPEP_PROFILE (or ci) is the base that hypothesis's own options
    (--hypothesis-profile, --hypothesis-verbosity) then build on."""
    name = os.environ.get("DPEP_PROFILE", "ci")
    settings.load_profile(name if name in PROFILES else "ci")


def apply_max_examples() -> str:
    """After hypothesis's pytest plugin has loaded its options: DPEP_MAX_EXAMPLES on top of whatever profile
    is current, registered under a name that says both. Returns the profile name now in force."""
    name = settings.get_current_profile_name()
    n = os.environ.get("DPEP_MAX_EXAMPLES", "").strip()
    if n.isdigit() and int(n) >= 1 and settings.default.max_examples != int(n):
        name = f"{name.split('+max_examples=')[0]}+max_examples={int(n)}"
        settings.register_profile(name, parent=settings.default, max_examples=int(n))
        settings.load_profile(name)
    return name
