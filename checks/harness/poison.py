"""Poisoned allocations: a debug mode in which every uninitialised floating-point tensor a target allocates
from Python (torch.empty, empty_like, empty_strided, Tensor.new_empty) is filled with NaN.

A target that reads memory it never wrote (a buffer it assumes zeroed, rows it forgot to fill, state it
expects from an earlier forward) passes whenever fresh memory happens to hold zeros, which on CPU and on a
fresh CUDA allocation it often does. Poisoned, the read turns into NaN in the output, which every parity
check fails. Correct code never reads what it did not write, so poisoning cannot fail a correct target.

Only allocations made through torch's Python entry points are poisoned; a target that allocates in C++ or
through its own pool can honour `BuildEnv.poison` / `Step.poison` itself (docs/targets.md). No public tool
does this for torch (PYTORCH_CUDA_ALLOC_CONF has no fill option and CPU has none), hence this module.
"""
from __future__ import annotations

import contextlib
import functools

import torch

_PATCHED = (("torch", "empty"), ("torch", "empty_like"), ("torch", "empty_strided"), ("Tensor", "new_empty"))


def _fill(t):
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel():
        with torch.no_grad():
            t.fill_(float("nan"))
    return t


@contextlib.contextmanager
def poisoned(on: bool = True):
    """Within the block, fresh floating-point allocations from Python hold NaN."""
    if not on:
        yield
        return
    saved = []
    for owner_name, attr in _PATCHED:
        owner = torch if owner_name == "torch" else torch.Tensor
        orig = getattr(owner, attr)
        saved.append((owner, attr, orig))

        def make(orig):
            @functools.wraps(orig)
            def alloc(*args, **kwargs):
                return _fill(orig(*args, **kwargs))
            return alloc
        setattr(owner, attr, make(orig))
    try:
        yield
    finally:
        for owner, attr, orig in reversed(saved):
            setattr(owner, attr, orig)
