"""Process helpers for the harness's own tests."""
from __future__ import annotations


def running(pid: int) -> bool:
    """A live process (not a zombie) with this pid, whoever its parent (a torchrun worker is its agent's child,
    a forked rank the forkserver's)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False
