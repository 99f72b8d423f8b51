"""Engines for the eval tests, named in test matrices as ``factory = "evals.tests.helpers:<name>"``."""
from __future__ import annotations

import torch

from evals.engines.hf_local import HFForwardEngine

CALLS = {"sequences": 0}   # sequences forwarded by every engine made here, across engines
CRASH_AFTER: dict[str, int | None] = {"sequences": None}  # raise after this many sequences


class SimulatedCrash(RuntimeError):
    pass


class CountingEngine:
    """Wraps an engine: counts forwarded sequences, optionally crashes, optionally perturbs logits."""

    def __init__(self, inner, perturb=None) -> None:
        self.inner, self.perturb = inner, perturb
        self.name = f"counting({inner.name})"
        self.model_dir = getattr(inner, "model_dir", None)
        self.max_length = getattr(inner, "max_length", None)

    def forward(self, requests: list[list[int]]) -> list[torch.Tensor]:
        limit = CRASH_AFTER["sequences"]
        if limit is not None and CALLS["sequences"] + len(requests) > limit:
            raise SimulatedCrash(f"simulated kill after {CALLS['sequences']} sequences")
        CALLS["sequences"] += len(requests)
        out = self.inner.forward(requests)
        return [self.perturb(x) for x in out] if self.perturb else out

    def close(self) -> None:
        self.inner.close()


def counting_engine(config):
    return CountingEngine(HFForwardEngine(config.model_path, config.dtype))


def _token_id(model_dir: str, text: str) -> int:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is not one token: {ids}"
    return ids[0]


BIAS = {"text": " B", "logit": 8.0}


def biased_engine(config):
    """A 'double reduction'-style bug: one answer token's logit gets an extra bias at every position."""
    tok = _token_id(config.model_path, BIAS["text"])

    def perturb(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:, tok] += BIAS["logit"]
        return x

    return CountingEngine(HFForwardEngine(config.model_path, config.dtype), perturb)


def scaled_engine(config):
    """Final-layer logits scaled by 2 (a reduction summed twice): argmax kept, log-probs drift."""
    return CountingEngine(HFForwardEngine(config.model_path, config.dtype), lambda x: 2.0 * x)
