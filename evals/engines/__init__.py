"""The engine kinds a configuration runs on, one module each (``ENGINE``: inproc, openai, sglang), with outside
packages' entry points of group ``dpep_parity.engines``, in one registry; :func:`open_lm` opens a
configuration's lm-eval LM through its kind."""
from __future__ import annotations

import contextlib
from pathlib import Path

from dpep_parity.evals.engines.base import Engine, EngineError, EngineOptions, ForwardEngine
from dpep_parity.registry import Registry

__all__ = ["ENGINES", "Engine", "EngineError", "EngineOptions", "ForwardEngine", "engine_of", "open_lm"]

ENGINES: Registry[Engine] = Registry("engines", package=__name__, attr="ENGINE", accept=Engine, noun="engine")


def engine_of(config) -> Engine:
    """The kind of a configuration's engine."""
    try:
        return ENGINES.lookup(config.engine)
    except KeyError as e:
        raise EngineError(e.args[0]) from None


@contextlib.contextmanager
def open_lm(config, max_gen_toks: int, log_dir: Path):
    """Yield an lm-eval LM for ``config``; the engine or server is always closed on exit."""
    with engine_of(config).open(config, max_gen_toks, log_dir) as lm:
        yield lm
