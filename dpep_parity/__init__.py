"""dpep-parity's import root: `dpep_parity.checks`, `dpep_parity.evals`, `dpep_parity.fixtures`,
`dpep_parity.property_tests`.

The repository keeps those four packages as top-level folders (the layout shows the architecture), but an
installed wheel must not put packages named `checks`, `evals` or `fixtures` on the path: PyPI has packages
of those names (`fixtures` is a widely used test library) and one would shadow the other. The wheel installs
them under this package (pyproject.toml maps `dpep_parity.checks` to `checks/` and so on), and every import
in the code names them through it. In a checkout, where the folders sit beside this one, this package's
path is the repository root, so the same imports reach the same files.
"""
from pathlib import Path as _Path

_here = _Path(__file__).resolve().parent
if not (_here / "checks").is_dir():      # a checkout: the packages are the repository's top-level folders
    __path__ = [str(_here.parent)]

PACKAGES = ("checks", "evals", "fixtures", "property_tests")


def own_module(name: str) -> str:
    """`checks.mutants` -> `dpep_parity.checks.mutants` (and so for the other three packages), so that the
    short names of targets and modules users type ('checks.mutants:B14') load this package's modules, once,
    whether it is installed or a checkout; any other name is returned as it is."""
    if name.split(".", 1)[0] in PACKAGES:
        return f"{__name__}.{name}"
    return name
