"""The single-device baseline: Hugging Face transformers on one device."""
from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}   # float64: the sign-off's truth run


def torch_dtype(name: str) -> torch.dtype | str:
    if name == "auto":
        return "auto"
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES) + ['auto']}") from None


class HFForwardEngine:
    """``ForwardEngine`` over ``AutoModelForCausalLM``; each request is run alone (no padding), so
    results do not depend on how requests are batched or resumed."""

    def __init__(self, model_dir: str, dtype: str = "float32", device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.model_dir = str(model_dir)
        self.name = f"hf:{self.model_dir}:{dtype}"
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch_dtype(dtype))
        self.model.to(self.device).eval()
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None

    @torch.inference_mode()
    def forward(self, requests: list[list[int]]) -> list[torch.Tensor]:
        out = []
        for tokens in requests:
            ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0]
            out.append(logits.float().cpu())
        return out

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new: list[int], stop: list) -> list[list[int]]:
        """Greedy generation, one request at a time with transformers' KV cache (one prefill, then one
        forward per new token), until max_new tokens or the request's stop rule."""
        out = []
        for prompt, n, rule in zip(prompts, max_new, stop):
            gen: list[int] = []
            ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)
            past = None
            while len(gen) < n:
                res = self.model(input_ids=ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                gen.append(int(res.logits[0, -1].argmax()))
                if rule is not None and rule(gen):
                    break
                ids = torch.tensor([[gen[-1]]], dtype=torch.long, device=self.device)
            out.append(gen)
        return out

    def close(self) -> None:
        self.model = None
