"""The program name a tool shows: `dpep SUB` while `dpep` (checks.tools.cli) runs it, else its `python -m` form."""
from __future__ import annotations

INVOKED: str | None = None      # "dpep SUB" while `dpep` (checks.tools.cli) runs a subcommand


def prog(default: str, dispatcher: bool = False) -> str:
    """The program name a tool's usage, help and errors show: `dpep SUB` when run through `dpep`, else its
    `python -m` form (`default`). `dispatcher`: the tool's parser has subcommands of its own whose first one is
    the `dpep` subcommand's name (`dpep signoff` is `python -m evals signoff`): then just "dpep"."""
    if INVOKED is None:
        return default
    return "dpep" if dispatcher else INVOKED
