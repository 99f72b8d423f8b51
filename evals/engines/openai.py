"""Any OpenAI-compatible completions server, through lm-eval's ``local-completions`` model.

Log-likelihoods need a Hugging Face tokenizer (``tokenizer``, default the model path) and a server
that echoes prompt log-probabilities (``echo=True, logprobs=1``), as SGLang and vLLM do.
"""
from __future__ import annotations

import contextlib
import dataclasses

from dpep_parity.evals.engines.base import Engine, EngineError, EngineOptions, is_pos_int


@dataclasses.dataclass
class ServerOptions(EngineOptions):
    """Options of every engine that talks to an OpenAI-compatible server."""
    served_model: str | None = None    # the "model" field sent to the server; default: the model
    num_concurrent: int = 1
    max_length: int = 4096

    def problems(self, label: str) -> list[str]:
        return [f"[required] {label}: {key} must be a positive integer"
                for key in ("num_concurrent", "max_length") if not is_pos_int(getattr(self, key))]


@dataclasses.dataclass
class OpenAIOptions(ServerOptions):
    base_url: str | None = None        # one running server per configuration


class OpenAIEngine(Engine):
    """`engine = "openai"`: a server someone else started, at `base_url`."""
    name = "openai"
    Options = OpenAIOptions
    hub_ids = True

    def problems(self, config, label: str) -> list[str]:
        p = config.options.problems(label)
        if not config.options.base_url:
            p.append(f"[required] {label}: engine 'openai' needs 'base_url' (one server per configuration)")
        return p

    def preflight(self, config) -> list[str]:
        url = str(config.options.base_url)
        if not url.startswith(("http://", "https://")):
            return [f"config {config.name!r}: base_url must start with http:// or https://"]
        if why := unreachable(url):
            return [f"config {config.name!r}: no server at {url} ({why}); start it first, or use engine = "
                    "\"sglang\" to have the sign-off launch one"]
        return []

    def describe(self, config) -> str:
        return config.options.base_url

    @contextlib.contextmanager
    def open(self, config, max_gen_toks, log_dir):
        o = config.options
        yield make_openai_lm(o.base_url, o.served_model or config.model_path, config.tokenizer or config.model_path,
                             max_gen_toks, max_length=o.max_length, num_concurrent=o.num_concurrent)


ENGINE = OpenAIEngine()


def unreachable(base_url: str, timeout_s: float = 3.0) -> str | None:
    """Why nothing accepts a TCP connection at the server's host and port (None when something does): a
    dead server is bad input, found before the baseline runs, not an engine failure a rerun would resume."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(base_url)
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError as e:
        return str(e)
    try:
        socket.create_connection((u.hostname or "", port), timeout=timeout_s).close()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def completions_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    if url.endswith("/completions"):
        return url
    if not url.endswith("/v1"):
        url += "/v1"
    return url + "/completions"


def make_openai_lm(base_url: str, model: str, tokenizer: str | None, max_gen_toks: int,
                   max_length: int = 4096, num_concurrent: int = 1, timeout_s: int = 600):
    try:
        from lm_eval.models.openai_completions import LocalCompletionsAPI
    except ImportError as e:  # pragma: no cover - lm-eval[api] extras
        raise EngineError(f"lm-eval's local-completions model cannot be imported: {e}") from e
    try:
        return LocalCompletionsAPI(
            base_url=completions_url(base_url), model=model, tokenizer=tokenizer or model,
            tokenizer_backend="huggingface", tokenized_requests=True, max_gen_toks=int(max_gen_toks),
            max_length=int(max_length), num_concurrent=int(num_concurrent), batch_size=1,
            max_retries=3, timeout=int(timeout_s))
    except ModuleNotFoundError as e:
        raise EngineError(f"local-completions needs lm-eval's API extras: {e}") from e
