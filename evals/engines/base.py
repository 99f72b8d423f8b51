"""The interface every in-process engine implements, and the errors engines raise."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ForwardEngine(Protocol):
    """One full forward pass per request, no cache: what the eval adapter needs from an engine."""

    name: str

    def forward(self, requests: list[list[int]]) -> list[torch.Tensor]:
        """Per request: float32 logits ``[len(tokens), vocab]`` for every position."""
        ...

    def close(self) -> None: ...


class EngineError(RuntimeError):
    """An engine could not be built, started or reached."""
