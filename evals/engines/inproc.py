"""In-process engines named in the matrix (engine = "inproc").

- ``target = "hf"``: :class:`HFForwardEngine`, transformers on one device (tp = dp = ep = 1).
- ``factory = "package.module:callable"``: ``callable(config) -> ForwardEngine`` (plug-ins, tests).
- any other target (``"spec"``, ``"package.module:object"``): the parallel in-process engine
  ``checks.serve.ModelServer(model_dir, tp=, dp=, ep=, target=, dtype=)``.
"""
from __future__ import annotations

import importlib
import importlib.util

from evals.engines.base import EngineError, ForwardEngine

HF_TARGET = "hf"


def import_object(spec: str):
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise EngineError(f"{spec!r} is not of the form 'package.module:object'")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise EngineError(f"cannot import {module!r} for {spec!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EngineError(f"{module!r} has no attribute {attr!r} (from {spec!r})") from None
    return obj


def model_server_available() -> bool:
    try:
        return importlib.util.find_spec("checks.serve") is not None
    except (ImportError, ValueError):
        return False


def check_available(config) -> None:
    """Raise EngineError now (before any work) if ``make_engine(config)`` cannot work."""
    if config.factory:
        if not callable(import_object(config.factory)):
            raise EngineError(f"config {config.name!r}: factory {config.factory!r} is not callable")
    elif config.target != HF_TARGET:
        if not model_server_available():
            raise EngineError(
                f"config {config.name!r}: target {config.target!r} needs the in-process parallel engine "
                "checks.serve.ModelServer, which is not available in this checkout yet; use "
                f"target = {HF_TARGET!r} for the single-device transformers engine")
        if ":" in config.target:  # a plug-in target: importable now, not after the baseline ran
            try:
                import_object(config.target)
            except EngineError as e:
                raise EngineError(f"config {config.name!r}: target: {e}") from None


def make_engine(config) -> ForwardEngine:
    if config.factory:
        return import_object(config.factory)(config)
    if config.target == HF_TARGET:
        from evals.engines.hf_local import HFForwardEngine

        return HFForwardEngine(config.model_path, config.dtype)
    try:
        from checks.serve import ModelServer
    except ImportError as e:
        raise EngineError(
            f"config {config.name!r}: target {config.target!r} needs checks.serve.ModelServer "
            f"(the in-process parallel engine), which cannot be imported: {e}") from e
    return ModelServer(config.model_path, tp=config.tp, dp=config.dp, ep=config.ep,
                       target=config.target, dtype=config.dtype)
