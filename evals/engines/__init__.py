"""Engines per configuration, each opened as an lm-eval ``LM`` by :func:`open_lm`."""
from __future__ import annotations

import contextlib
from pathlib import Path

from dpep_parity.evals.engines.base import EngineError, ForwardEngine

__all__ = ["EngineError", "ForwardEngine", "open_lm"]


@contextlib.contextmanager
def open_lm(config, max_gen_toks: int, log_dir: Path):
    """Yield an lm-eval LM for ``config``; the engine or server is always closed on exit."""
    if config.engine == "inproc":
        from dpep_parity.evals.engines.inproc import make_engine
        from dpep_parity.evals.lm_adapter import ForwardEngineLM

        engine = make_engine(config)
        try:
            yield ForwardEngineLM(engine=engine, tokenizer=config.tokenizer or config.model_path,
                                  max_gen_toks=max_gen_toks, batch_size=config.batch_size)
        finally:
            engine.close()
    elif config.engine == "openai":
        from dpep_parity.evals.engines.openai import make_openai_lm

        yield make_openai_lm(config.base_url, config.served_model or config.model_path,
                             config.tokenizer or config.model_path, max_gen_toks,
                             max_length=config.max_length, num_concurrent=config.num_concurrent)
    elif config.engine == "sglang":
        from dpep_parity.evals.engines.openai import make_openai_lm
        from dpep_parity.evals.engines.sglang_server import SGLANG_LAUNCH, SGLangServer, log_tail

        server = SGLangServer(config.model_path, tp=config.tp, dp=config.dp, ep=config.ep,
                              dtype=config.dtype, log_path=Path(log_dir) / f"{config.name}.server.log",
                              extra_args=tuple(config.server_args), health_timeout_s=config.health_timeout_s,
                              launch=tuple(config.launch) if config.launch else SGLANG_LAUNCH)
        with server:
            try:
                yield make_openai_lm(server.base_url, config.served_model or config.model_path,
                                     config.tokenizer or config.model_path, max_gen_toks,
                                     max_length=config.max_length, num_concurrent=config.num_concurrent)
            except Exception as e:
                if server.proc is not None and server.proc.poll() is not None:
                    raise EngineError(f"the server of {config.name!r} died during the run (exit code "
                                      f"{server.proc.returncode}); last log lines of {server.log_path}:\n"
                                      f"{log_tail(server.log_path)}") from e
                raise
    else:  # validated earlier
        raise EngineError(f"unknown engine kind {config.engine!r}")
