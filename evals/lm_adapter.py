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

_ENCODED: dict[tuple, tuple[int, ...]] = {}  # (tokenizer key, add_special_tokens, text) -> token ids
_ENCODED_MAX = 8192  # prompts: a sign-off's distinct MMLU contexts and continuations fit; bounded memory


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
            from dpep_parity.evals.engines.hf_local import HFForwardEngine

            engine = HFForwardEngine(pretrained, dtype)
        model_dir = pretrained or getattr(engine, "model_dir", None)
        # Which tokenizer the shared encoding memo keys on: the folder it came from, else the object itself.
        self._tokenizer_key: object = tokenizer
        if tokenizer is None or isinstance(tokenizer, str | Path):
            from transformers import AutoTokenizer

            source = str(tokenizer or model_dir)
            tokenizer = AutoTokenizer.from_pretrained(source)
            self._tokenizer_key = (type(tokenizer).__name__, str(Path(source).resolve()))
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
        """Memoized across instances of one tokenizer: lm-eval encodes a multiple-choice context once per
        choice (`_encode_pair`), and the sign-off encodes the same prompts for every configuration. Measured
        on the 2-core machine: 12.2 s of an 85 s two-configuration MMLU sign-off of 256 documents went to
        8 encodes per document, 5 of them distinct."""
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        key = (self._tokenizer_key, bool(special), string)
        ids = _ENCODED.get(key)
        if ids is None:
            if len(_ENCODED) >= _ENCODED_MAX:
                _ENCODED.clear()
            ids = _ENCODED[key] = tuple(self.tokenizer.encode(string, add_special_tokens=special))
        return list(ids)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

    # ---------------------------------------------------------------------------- engine
    @property
    def _serves(self) -> bool:
        """The engine schedules requests itself (continuous batching, KV cache): give it everything at once."""
        return callable(getattr(self.engine, "generate", None))

    def _forward(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        size = len(seqs) if self._serves else self.batch_size
        for i in range(0, len(seqs), max(size, 1)):
            chunk = seqs[i:i + size]
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

    def forced_scores(self, pairs: list[tuple[str, str]], max_tokens: int | None = None
                      ) -> list[list[tuple[float, bool]]]:
        """Teacher forcing: per (context, continuation) pair, each continuation token's log-probability and
        whether it was the greedy choice. The serving engine feeds the continuation one decode step at a
        time after a prefill of the context (its decode path, with idle DP ranks as continuations of
        different lengths end); other engines score it in one full forward. A continuation longer than
        `max_tokens` tokens (default: half the context window) keeps its whole lines that fit (its first
        `max_tokens` tokens when its first line is longer), the context its last tokens that fit."""
        limit = max_tokens or self.max_length // 2
        encoded = []
        for ctx, cont in pairs:
            c_enc, t_enc = self._encode_pair(ctx, cont)
            if len(t_enc) > limit:
                ends = [k + 1 for k in range(limit) if "\n" in self.tok_decode([t_enc[k]])]
                t_enc = t_enc[: ends[-1] if ends else limit]
            encoded.append((c_enc[-max(1, self.max_length - len(t_enc)):], t_enc))
        if callable(getattr(self.engine, "score_forced", None)):
            return self.engine.score_forced([c for c, _ in encoded], [t for _, t in encoded])
        out = []
        for (c_enc, t_enc), lg in zip(encoded, self._forward([c + t[:-1] for c, t in encoded])):
            rows = lg[len(c_enc) - 1:]
            lp = F.log_softmax(rows, dim=-1)
            out.append([(float(lp[k, tok]), int(rows[k].argmax()) == tok) for k, tok in enumerate(t_enc)])
        return out

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
        """Greedy decoding with the task's stop sequences: through the engine's own generation when it has one
        (the serving engine: batched, KV cache), else by repeated full forwards."""
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
        if self._serves:
            self._generate_served(states)
        else:
            self._generate_by_forwards(states)
        out = []
        for req, s in zip(requests, states):
            text = self.tok_decode(s["gen"])
            for u in s["until"]:
                if u:
                    text = text.split(u)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def _stops(self, until: list[str]):
        """The stop rule of one request on its generated tokens: the end-of-text token, or a stop sequence in
        the decoded text."""
        eot = self.eot_token_id
        until = [u for u in until if u]
        # A stop sequence that first appears after the newest token ends inside that token's text, and every
        # token decodes to at least one character (the end-of-text token is checked apart), so decoding the
        # last len(u) tokens sees it; a few more cover byte-level pieces. Decoding the whole generation at
        # every step cost more than the forward (quadratic in its length).
        window = max((len(u) for u in until), default=0) + 4

        def stop(gen: list[int]) -> bool:
            return gen[-1] == eot or (bool(until) and any(u in self.tok_decode(gen[-window:]) for u in until))
        return stop

    def _generate_served(self, states: list[dict]) -> None:
        todo = [s for s in states if not s["done"]]
        gens = self.engine.generate([s["ctx"] for s in todo], [s["max"] for s in todo],
                                    [self._stops(s["until"]) for s in todo])
        for s, gen in zip(todo, gens):
            s["gen"] = gen[:-1] if gen and gen[-1] == self.eot_token_id else list(gen)
            self.forward_calls += 1

    def _generate_by_forwards(self, states: list[dict]) -> None:
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
