"""In-process engines named in the matrix (engine = "inproc").

- ``target = "hf"``: :class:`HFForwardEngine`, transformers on one device (tp = dp = ep = 1).
- ``factory = "package.module:callable"``: ``callable(config) -> ForwardEngine`` (plug-ins, tests).
- any other target (``"spec"``, ``"sglang"``, ``"package.module:object"``): the in-process serving engine
  ``checks.serving.ServingEngine(model_dir, tp=, dp=, ep=, target=, dtype=, policy=, ...)``: a scheduler
  over DP ranks, continuous batching, KV caches kept across prefill and decode steps.
"""
from __future__ import annotations

import importlib
import importlib.util

from dpep_parity import own_module
from dpep_parity.evals.engines.base import EngineError, ForwardEngine

HF_TARGET = "hf"


def import_object(spec: str):
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise EngineError(f"{spec!r} is not of the form 'package.module:object'")
    try:
        obj = importlib.import_module(own_module(module))
    except ImportError as e:
        raise EngineError(f"cannot import {module!r} for {spec!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EngineError(f"{module!r} has no attribute {attr!r} (from {spec!r})") from None
    return obj


def serving_engine_available() -> bool:
    try:
        return importlib.util.find_spec("dpep_parity.checks.serving") is not None
    except (ImportError, ValueError):
        return False


def check_available(config) -> None:
    """Raise EngineError now (before any work) if ``make_engine(config)`` cannot work."""
    if config.factory:
        if not callable(import_object(config.factory)):
            raise EngineError(f"config {config.name!r}: factory {config.factory!r} is not callable")
    elif config.target != HF_TARGET:
        if not serving_engine_available():
            raise EngineError(
                f"config {config.name!r}: target {config.target!r} needs the in-process serving engine "
                "checks.serving.ServingEngine, which is not available in this checkout; use "
                f"target = {HF_TARGET!r} for the single-device transformers engine")
        if ":" in config.target:  # a plug-in target: importable now, not after the baseline ran
            try:
                import_object(config.target)
            except EngineError as e:
                raise EngineError(f"config {config.name!r}: target: {e}") from None
        bad = layout_problems(config)
        if bad:
            raise EngineError(f"config {config.name!r}: layout {config.layout} cannot serve {config.model}: "
                              + "; ".join(bad))


def layout_problems(config) -> list[str]:
    """The layout's violations of the model's own config (experts, heads, KV heads, sizes), checked before any
    configuration runs: the serving engine would refuse it only when its turn came, after the baseline ran."""
    import json
    from pathlib import Path

    from dpep_parity.checks.topology import Layout, layout_violations

    try:
        model_cfg = json.loads((Path(config.model_path) / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        return []     # no readable config.json here: the engine reports what is wrong when it loads the model
    return layout_violations(Layout(config.tp, config.dp, config.ep), model_cfg)


def make_engine(config) -> ForwardEngine:
    if config.factory:
        return import_object(config.factory)(config)
    if config.target == HF_TARGET:
        from dpep_parity.evals.engines.hf_local import HFForwardEngine

        return HFForwardEngine(config.model_path, config.dtype)
    try:
        from dpep_parity.checks.serving.engine import ServingEngine
    except ImportError as e:
        raise EngineError(
            f"config {config.name!r}: target {config.target!r} needs checks.serving.ServingEngine "
            f"(the in-process serving engine), which cannot be imported: {e}") from e
    engine = ServingEngine(config.model_path, tp=config.tp, dp=config.dp, ep=config.ep, target=config.target,
                           dtype=config.dtype, policy=config.scheduler, max_running=config.max_running,
                           max_prefill_tokens=config.max_prefill_tokens, in_flight=config.in_flight)
    return PrefillOnly(engine) if config.serving == "prefill" else engine


class PrefillOnly:
    """The serving engine seen through `forward` alone: every request one prefill, so the LM adapter generates
    by repeated full forwards and scores continuations in one forward (no KV cache reuse, no decode step,
    no idle DP rank while others decode): how the suite's evals ran before the serving engine, kept to show
    what a prefill-only engine cannot see."""

    def __init__(self, engine):
        self.engine = engine
        self.name = f"{engine.name}:prefill-only"
        self.model_dir = engine.model_dir    # the LM adapter's context window comes from the model's config:
        #                                      without it, prompts were cut at 4096 tokens instead of the model's

    @property
    def stats(self):
        return self.engine.stats

    def forward(self, requests):
        return self.engine.forward(requests)

    def close(self) -> None:
        self.engine.close()
