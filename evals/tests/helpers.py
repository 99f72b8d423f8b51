"""Engines for the eval tests, named in test matrices as ``factory = "evals.tests.helpers:<name>"``."""
from __future__ import annotations

import torch

from dpep_parity.evals.engines.hf_local import HFForwardEngine

CALLS = {"sequences": 0}   # sequences forwarded by every engine made here, across engines
CRASH_AFTER: dict[str, int | None] = {"sequences": None}  # raise after this many sequences


class SimulatedCrash(RuntimeError):
    pass


INTERRUPT = {"after": None}    # raise KeyboardInterrupt (a Ctrl-C) instead, after this many sequences


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
        if INTERRUPT["after"] is not None and CALLS["sequences"] + len(requests) > INTERRUPT["after"]:
            raise KeyboardInterrupt
        CALLS["sequences"] += len(requests)
        out = self.inner.forward(requests)
        return [self.perturb(x) for x in out] if self.perturb else out

    def close(self) -> None:
        self.inner.close()


def counting_engine(config):
    return CountingEngine(HFForwardEngine(config.model_path, config.dtype))


def _last_token_id(tokenizer, text: str) -> int:
    return tokenizer.encode(text, add_special_tokens=False)[-1]


BIAS = {"logit": 12.0, "letter": None}  # "letter": the answer the bias favours (set by biased_engine)


def biased_engine(config):
    """A 'double reduction'-style bug: one answer letter's logit gets an extra bias at every position.

    The letter is the one the clean model likes least after "Answer:", so the bias must move answers.
    """
    from transformers import AutoTokenizer

    inner = HFForwardEngine(config.model_path, config.dtype)
    tok = AutoTokenizer.from_pretrained(config.model_path)
    ids = {x: _last_token_id(tok, f" {x}") for x in "ABCD"}
    last = inner.forward([tok.encode("Question: which one?\nAnswer:", add_special_tokens=False)])[0][-1]
    letter = min(ids, key=lambda x: float(last[ids[x]]))
    BIAS["letter"] = letter

    def perturb(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:, ids[letter]] += BIAS["logit"]
        return x

    return CountingEngine(inner, perturb)


def scaled_engine(config):
    """Final-layer logits scaled by 2 (a reduction summed twice): argmax kept, log-probs drift."""
    return CountingEngine(HFForwardEngine(config.model_path, config.dtype), lambda x: 2.0 * x)


def crashing_engine(config):
    """Raises on its first forward, wherever it runs (a job process of `signoff --jobs` included: no state)."""
    engine = CountingEngine(HFForwardEngine(config.model_path, config.dtype))
    engine.forward = lambda requests: (_ for _ in ()).throw(SimulatedCrash("simulated engine failure"))
    return engine


def interrupting_engine(config):
    """A Ctrl-C on its first forward, wherever it runs."""
    engine = CountingEngine(HFForwardEngine(config.model_path, config.dtype))
    engine.forward = lambda requests: (_ for _ in ()).throw(KeyboardInterrupt())
    return engine
