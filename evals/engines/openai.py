"""Any OpenAI-compatible completions server, through lm-eval's ``local-completions`` model.

Log-likelihoods need a Hugging Face tokenizer (``tokenizer``, default the model path) and a server
that echoes prompt log-probabilities (``echo=True, logprobs=1``), as SGLang and vLLM do.
"""
from __future__ import annotations

from dpep_parity.evals.engines.base import EngineError


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
