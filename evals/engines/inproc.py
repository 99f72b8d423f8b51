"""In-process engines named in the matrix (engine = "inproc").

- ``target = "hf"``: :class:`HFForwardEngine`, transformers on one device (tp = dp = ep = 1).
- ``factory = "package.module:callable"``: ``callable(config) -> ForwardEngine`` (plug-ins, tests).
- any other target (``"spec"``, ``"sglang"``, ``"package.module:object"``): the in-process serving engine
  ``checks.serving.ServingEngine(model_dir, tp=, dp=, ep=, target=, dtype=, policy=, ...)``: a scheduler
  over DP ranks, continuous batching, KV caches kept across prefill and decode steps.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util

from dpep_parity import own_module
from dpep_parity.evals.engines.base import Engine, EngineError, EngineOptions, ForwardEngine, is_pos_int

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


SERVING_MODES = ("continuous", "prefill")


@dataclasses.dataclass
class InprocOptions(EngineOptions):
    target: str | None = None          # "hf", "spec", "sglang" or "package.module:object"
    factory: str | None = None         # "package.module:callable", callable(config) -> engine
    batch_size: int = 8                # requests per call of the LM adapter
    serving: str = "continuous"        # "continuous" (KV cache, decode steps) or "prefill" (every token a full
    #                                    forward, as the suite's engine before the serving engine)
    scheduler: str = "round_robin"     # the serving engine's DP controller policy (checks.serving)
    max_running: int = 32              # requests resident per DP rank
    max_prefill_tokens: int = 2048     # prompt tokens per DP rank and step
    in_flight: int = 0                 # requests the client keeps in flight (0: all)


class InprocEngine(Engine):
    """`engine = "inproc"`: a target served in this process (module docstring)."""
    name = "inproc"
    Options = InprocOptions
    deterministic = True
    forced_scores = True              # ForwardEngineLM.forced_scores
    truth = True

    def problems(self, config, label: str) -> list[str]:
        from dpep_parity.checks.serving.scheduler import POLICIES
        o, p = config.options, []
        if not o.target and not o.factory:
            p.append(f"[required] {label}: engine 'inproc' needs 'target' (\"hf\", \"spec\" or "
                     "\"package.module:object\") or 'factory' (\"package.module:callable\")")
        if o.target == HF_TARGET and not o.factory and (config.tp, config.dp, config.ep) != (1, 1, 1):
            p.append(f"[required] {label}: target 'hf' is the single-device engine; it needs tp = dp = ep = 1")
        if o.factory and ":" not in o.factory:
            p.append(f"[required] {label}: factory must look like 'package.module:callable'")
        for key in ("batch_size", "max_running", "max_prefill_tokens"):
            if not is_pos_int(getattr(o, key)):
                p.append(f"[required] {label}: {key} must be a positive integer")
        if not isinstance(o.in_flight, int) or isinstance(o.in_flight, bool) or o.in_flight < 0:
            p.append(f"[required] {label}: in_flight must be an integer >= 0 (0: every request at once)")
        if o.serving not in SERVING_MODES:
            p.append(f"[required] {label}: serving must be one of {SERVING_MODES}, got {o.serving!r}")
        if o.scheduler not in POLICIES:
            p.append(f"[required] {label}: scheduler must be one of {POLICIES}, got {o.scheduler!r}")
        return p

    def preflight(self, config) -> list[str]:
        try:
            check_available(config)
        except EngineError as e:
            return [str(e)]
        return []

    def describe(self, config) -> str:
        return config.options.target or config.options.factory

    def concurrent(self, config) -> bool:
        """The serving engine and transformers run on CPU in processes of their own; a plug-in factory's engine
        is unknown, so it runs alone."""
        return not config.options.factory

    def drift_target(self, config) -> str | None:
        o = config.options
        return None if o.factory or o.target in (None, HF_TARGET) else o.target

    @contextlib.contextmanager
    def open(self, config, max_gen_toks, log_dir):
        from dpep_parity.evals.lm_adapter import ForwardEngineLM

        engine = make_engine(config)
        try:
            yield ForwardEngineLM(engine=engine, tokenizer=config.tokenizer or config.model_path,
                                  max_gen_toks=max_gen_toks, batch_size=config.options.batch_size)
        finally:
            engine.close()


ENGINE = InprocEngine()


def check_available(config) -> None:
    """Raise EngineError now (before any work) if ``make_engine(config)`` cannot work."""
    o = config.options
    if o.factory:
        if not callable(import_object(o.factory)):
            raise EngineError(f"config {config.name!r}: factory {o.factory!r} is not callable")
    elif o.target != HF_TARGET:
        if not serving_engine_available():
            raise EngineError(
                f"config {config.name!r}: target {o.target!r} needs the in-process serving engine "
                "checks.serving.ServingEngine, which is not available in this checkout; use "
                f"target = {HF_TARGET!r} for the single-device transformers engine")
        if ":" in o.target:  # a plug-in target: importable now, not after the baseline ran
            try:
                import_object(o.target)
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

    from dpep_parity.checks.core.topology import Layout, layout_violations

    try:
        model_cfg = json.loads((Path(config.model_path) / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        return []     # no readable config.json here: the engine reports what is wrong when it loads the model
    return layout_violations(Layout(config.tp, config.dp, config.ep), model_cfg)


def make_engine(config) -> ForwardEngine:
    o = config.options
    if o.factory:
        return import_object(o.factory)(config)
    if o.target == HF_TARGET:
        from dpep_parity.evals.engines.hf_local import HFForwardEngine

        return HFForwardEngine(config.model_path, config.dtype)
    try:
        from dpep_parity.checks.serving.engine import ServingEngine
    except ImportError as e:
        raise EngineError(
            f"config {config.name!r}: target {o.target!r} needs checks.serving.ServingEngine "
            f"(the in-process serving engine), which cannot be imported: {e}") from e
    engine = ServingEngine(config.model_path, tp=config.tp, dp=config.dp, ep=config.ep, target=o.target,
                           dtype=config.dtype, policy=o.scheduler, max_running=o.max_running,
                           max_prefill_tokens=o.max_prefill_tokens, in_flight=o.in_flight)
    return PrefillOnly(engine) if o.serving == "prefill" else engine


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
