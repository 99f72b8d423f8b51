"""dpep-parity's import root: `dpep_parity.checks`, `dpep_parity.evals`, `dpep_parity.fixtures`,
`dpep_parity.property_tests`.

The repository keeps those four packages as top-level folders (the layout shows the architecture), but an
installed wheel must not put packages named `checks`, `evals` or `fixtures` on the path: PyPI has packages
of those names (`fixtures` is a widely used test library) and one would shadow the other. So every import
names them through this package: `dpep_parity/checks` (and the other three) are links to the top-level
folders, which static readers, the wheel's package finder and Python all follow; no code runs to make an
import resolve (docs/architecture.md says what else was tried).
"""
PACKAGES = ("checks", "evals", "fixtures", "property_tests")


def own_module(name: str) -> str:
    """`checks.catalog.mutants` -> `dpep_parity.checks.catalog.mutants` (and so for the other three packages), so that the
    short names of targets and modules users type ('checks.catalog.mutants:B14') load this package's modules, once,
    whether it is installed or a checkout; any other name is returned as it is."""
    if name.split(".", 1)[0] in PACKAGES:
        return f"{__name__}.{name}"
    return name
