"""``ForwardEngine`` -> lm-eval ``LM``: log-likelihoods and greedy generation over full forwards.

Registered with lm-eval as ``dpep-forward``, so it works both with our resumable runner and with
``lm_eval.simple_evaluate(model=ForwardEngineLM(engine, tokenizer), ...)`` or
``simple_evaluate(model="dpep-forward", model_args="pretrained=DIR,dtype=float32")``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model


def _model_max_length(model_dir) -> int | None:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    return cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")


@register_model("dpep-forward")
class ForwardEngineLM(TemplateLM):
    backend = "causal"

    def __init__(self, engine=None, tokenizer=None, pretrained: str | None = None, dtype: str = "float32",
                 max_length: int | None = None, max_gen_toks: int = 256, batch_size: int | str = 8,
                 add_bos_token: bool = False, **_ignored) -> None:
        super().__init__()
        if engine is None:
            if pretrained is None:
                raise ValueError("dpep-forward needs an engine or pretrained=<model dir>")
            from evals.engines.hf_local import HFForwardEngine

            engine = HFForwardEngine(pretrained, dtype)
        model_dir = pretrained or getattr(engine, "model_dir", None)
        if tokenizer is None or isinstance(tokenizer, str | Path):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or model_dir))
        self.engine = engine
        self.tokenizer = tokenizer
        self.add_bos_token = bool(add_bos_token)
        self.max_gen_toks = int(max_gen_toks)
        self.batch_size = max(1, int(batch_size)) if str(batch_size).isdigit() else 8
        self.max_length = int(max_length or getattr(engine, "max_length", None)
                              or _model_max_length(model_dir) or 4096)
        self.forward_calls = 0  # sequences sent to the engine (tests count them)

    # ---------------------------------------------------------------------------- tokenizer
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_special_tokens=special)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

    # ---------------------------------------------------------------------------- engine
    def _forward(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for i in range(0, len(seqs), self.batch_size):
            chunk = seqs[i:i + self.batch_size]
            logits = self.engine.forward(chunk)
            if len(logits) != len(chunk):
                raise RuntimeError(f"engine {self.engine.name} returned {len(logits)} results for "
                                   f"{len(chunk)} requests")
            for seq, lg in zip(chunk, logits):
                if lg.shape[0] != len(seq):
                    raise RuntimeError(f"engine {self.engine.name} returned logits for {lg.shape[0]} "
                                       f"positions, expected {len(seq)}")
            self.forward_calls += len(chunk)
            out.extend(lg.float() for lg in logits)
        return out

    # ---------------------------------------------------------------------------- requests
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """One forward per distinct input; an input that is a prefix of another (MMLU's " A" next to a
        two-token " C") reads its logits from the longer one's - a causal model's logits at a position
        depend only on the tokens up to it."""
        wanted = []
        for _, ctx, cont in requests:
            if not cont:
                raise ValueError("empty continuation")
            whole = (ctx + cont)[-(self.max_length + 1):]
            wanted.append((tuple(whole[:-1]), cont))
        inputs: list[tuple[int, ...]] = []
        for inp in sorted({w for w, _ in wanted}, key=len, reverse=True):
            if not any(len(x) >= len(inp) and x[:len(inp)] == inp for x in inputs):
                inputs.append(inp)
        home = {}
        for inp, _ in wanted:
            if inp not in home:
                home[inp] = next(k for k, x in enumerate(inputs) if x[:len(inp)] == inp)
        logits = self._forward([list(x) for x in inputs])
        results = []
        for (inp, cont), req in zip(wanted, requests):
            lg = logits[home[inp]][len(inp) - len(cont):len(inp)]
            logp = F.log_softmax(lg, dim=-1)
            target = torch.tensor(cont, dtype=torch.long)
            ll = float(logp.gather(1, target[:, None]).sum())
            greedy = bool((lg.argmax(dim=-1) == target).all())
            results.append((ll, greedy))
            self.cache_hook.add_partial("loglikelihood", req[0], (ll, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (string,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            lls = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            out.append(sum(ll for ll, _ in lls))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding by repeated full forwards (tiny models, no KV cache)."""
        from lm_eval.models.utils import handle_stop_sequences

        eos_text = self.tok_decode([self.eot_token_id])
        states = []
        for req in requests:
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            if kw.get("do_sample") or float(kw.get("temperature", 0.0) or 0.0) > 0:
                raise ValueError("dpep-forward generates greedily only (do_sample=False, temperature=0)")
            until = handle_stop_sequences(kw.get("until"), eos=eos_text)
            max_new = int(kw.get("max_gen_toks", self.max_gen_toks))
            ctx = self.tok_encode(context)[-max(1, self.max_length - max_new):]
            states.append({"ctx": ctx, "gen": [], "until": until, "max": max_new, "done": max_new <= 0})
        while True:
            active = [s for s in states if not s["done"]]
            if not active:
                break
            logits = self._forward([s["ctx"] + s["gen"] for s in active])
            for s, lg in zip(active, logits):
                tok = int(lg[-1].argmax())
                if tok == self.eot_token_id:
                    s["done"] = True
                    continue
                s["gen"].append(tok)
                text = self.tok_decode(s["gen"])
                if len(s["gen"]) >= s["max"] or any(u and u in text for u in s["until"]):
                    s["done"] = True
        out = []
        for req, s in zip(requests, states):
            text = self.tok_decode(s["gen"])
            for u in s["until"]:
                if u:
                    text = text.split(u)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out
