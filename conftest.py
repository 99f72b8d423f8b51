"""A plain checkout's way to the suite's pytest plugin (checks/suite/pytest_plugin.py: options, hypothesis profiles,
usage errors, the `gpu` marker, the report header, reports/property-suite.json).

Installed with pip, pytest loads the plugin through its `pytest11` entry point (`dpep`) before any conftest,
and a second registration of the same module would be refused; so it is loaded from here only when nothing
has imported it yet: a checkout that was not installed, PYTEST_DISABLE_PLUGIN_AUTOLOAD=1, or `-p no:dpep`.
"""
import sys

if "dpep_parity.checks.suite.pytest_plugin" not in sys.modules:
    pytest_plugins = ["dpep_parity.checks.suite.pytest_plugin"]
