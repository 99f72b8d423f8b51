"""A plain checkout's way to the suite's pytest plugin (checks/suite/pytest_plugin.py: options, hypothesis profiles,
usage errors, the `gpu` marker, the report header, reports/property-suite.json).

Installed with pip, pytest loads the plugin through its `pytest11` entry point (`dpep`) before any conftest,
and a second registration of the same module would be refused; so it is loaded from here only when nothing
has imported it yet: a checkout that was not installed, PYTEST_DISABLE_PLUGIN_AUTOLOAD=1, or `-p no:dpep`.

It also loads this repository's test tiers (checks/suite/tiers.py: `--tier quick|slow|all`, quick by default) and
pytester (checks/tests/test_tiers.py runs pytest in-process).
"""
import sys

# The repository's own test tiers (--tier quick|slow|all): this checkout's tests only, so not in the plugin.
pytest_plugins = ["dpep_parity.checks.suite.tiers", "pytester"]   # pytester: test_tiers.py runs pytest in-process
if "dpep_parity.checks.suite.pytest_plugin" not in sys.modules:
    pytest_plugins.insert(0, "dpep_parity.checks.suite.pytest_plugin")
