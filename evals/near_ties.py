"""How often correct layouts route a served reference token differently: the router near-tie flips that each
run resolves on its own, measured where the sign-off's tolerance test looks (GSM8K's teacher-forced reference
tokens, served by the in-process engine exactly as the sign-off serves them).

    python -m evals.near_ties --fixture qwen2-moe-shared --layouts tp1,tp4-dp4-ep4 --dtype bfloat16 \\
        --docs 100 --data-dir ../shared/data [--json out.json]

Each layout serves the documents' reference tokens in `--dtype`, and the first layout once more in float64
(the truth). Every step's routing is read from the ranks' model-unit outputs (`ServingEngine.on_step`), per
position and sparse layer. Reported per layout: the reference tokens (the positions whose logits score them)
routed to other experts than the truth in some layer, the documents with such a token, the prompt positions
routed differently (their change reaches every later token), the truth's router margin (log p_k - log p_k+1)
at those flips against all positions (a near-tie has a small one), and the reference-token errors
|log p - log p_truth| at flipped tokens against the others (where the heavy tail of the errors sits). Per pair
of layouts: reference tokens routed differently by the two.

The rates feed `evals.simulate` (`--near-tie-rate`): the share of reference tokens whose error is a flip's.
Written here rather than taken from a library: what is measured is this suite's serving engine's routing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from dpep_parity.checks.core.topology import Layout

Key = tuple   # a request: (prompt length, its last 32 prompt tokens, its first 8 forced tokens)


class RoutingRecorder:
    """`ServingEngine.on_step` hook: per request, per (position, layer), the sorted expert ids; with `logits`,
    also the router's log-probabilities at positions from `from_end` before the prompt's end on."""

    def __init__(self, logits: bool = False, from_end: int = 1):
        self.ids: dict[Key, dict[tuple[int, int], tuple[int, ...]]] = defaultdict(dict)
        self.logp: dict[Key, dict[tuple[int, int], np.ndarray]] = defaultdict(dict)
        self.prompt_len: dict[Key, int] = {}
        self.keep_logits, self.from_end = logits, from_end

    @staticmethod
    def key(req) -> Key:
        return len(req.prompt), tuple(req.prompt[-32:]), tuple((req.forced or [])[:8])

    def __call__(self, plan, by_dp: dict) -> None:
        for d, entries in enumerate(plan.per_dp):
            value = by_dp.get(d)
            if not entries or value is None:
                continue
            routing = value.get("routing") or {}
            logits = value.get("router_logits") if self.keep_logits else None
            row = 0
            for e in entries:
                k = self.key(e.req)
                self.prompt_len[k] = len(e.req.prompt)
                first = len(e.req.prompt) - self.from_end
                for li, ids in routing.items():
                    part = ids[row: row + e.extend].tolist()
                    for j, chosen in enumerate(part):
                        self.ids[k][(e.prefix + j, int(li))] = tuple(chosen)
                    lg = None if logits is None else logits.get(li, logits.get(str(li)))
                    if lg is not None:
                        lp = torch.log_softmax(lg[row: row + e.extend].to(torch.float64), -1).numpy()
                        for j in range(e.extend):
                            if e.prefix + j >= first:
                                self.logp[k][(e.prefix + j, int(li))] = lp[j]
                row += e.extend


def serve(model_dir: str, layout: Layout, dtype: str, target: str, pairs, in_flight: int, logits: bool):
    """(per-request scores, recorder) of one layout serving the pairs' reference tokens."""
    from dpep_parity.checks.serving.engine import ServingEngine
    from dpep_parity.evals.lm_adapter import ForwardEngineLM
    from dpep_parity.evals.tasks.gsm8k import GOLD_TOKENS

    engine = ServingEngine(model_dir, layout.tp, layout.dp, layout.ep, target=target, dtype=dtype,
                           in_flight=in_flight)
    rec = RoutingRecorder(logits=logits)
    engine.on_step = rec
    lm = ForwardEngineLM(engine=engine, tokenizer=model_dir, max_gen_toks=32)
    scores = lm.forced_scores(pairs, GOLD_TOKENS)
    return scores, rec


def analyse(runs: dict[str, tuple], truth: tuple, keys: list[Key]) -> dict:
    """Flip rates per layout against the truth and per pair of layouts."""
    t_scores, t_rec = truth
    out: dict = {"layouts": {}, "pairs": {}}
    scored_of = {}
    for k, sc in zip(keys, t_scores):
        n = t_rec.prompt_len[k]
        scored_of[k] = [n - 1 + i for i in range(len(sc))]      # the position whose logits score token i
    all_margins = [_margin(v) for k in keys for v in t_rec.logp[k].values()]
    layers = sorted({li for k in keys for (_, li) in t_rec.ids[k]})
    for name, (scores, rec) in runs.items():
        flips_tok = tok = docs = prompt_flip = prompt_pos = pair_flips = 0
        margins, err_flip, err_rest = [], [], []
        for k, sc, tsc in zip(keys, scores, t_scores):
            n = t_rec.prompt_len[k]
            doc_hit = False
            for pos in range(n - 1):
                prompt_pos += 1
                prompt_flip += any(rec.ids[k].get((pos, li)) != t_rec.ids[k].get((pos, li)) for li in layers)
            for i, pos in enumerate(scored_of[k]):
                tok += 1
                flipped = [li for li in layers if rec.ids[k].get((pos, li)) != t_rec.ids[k].get((pos, li))]
                err = abs(sc[i][0] - tsc[i][0])
                (err_flip if flipped else err_rest).append(err)
                if flipped:
                    flips_tok += 1
                    doc_hit = True
                    pair_flips += len(flipped)
                    margins += [_margin(t_rec.logp[k][(pos, li)]) for li in flipped if (pos, li) in t_rec.logp[k]]
            docs += doc_hit
        out["layouts"][name] = {
            "reference_tokens": tok, "tokens_routed_otherwise": flips_tok, "rate": flips_tok / max(tok, 1),
            "token_layer_flips": pair_flips, "documents": len(keys), "documents_with_a_flip": docs,
            "prompt_positions": prompt_pos, "prompt_positions_routed_otherwise": prompt_flip,
            "prompt_rate": prompt_flip / max(prompt_pos, 1),
            "margin_at_flips_median": float(np.median(margins)) if margins else None,
            "margin_all_median": float(np.median(all_margins)) if all_margins else None,
            "margin_all_p01": float(np.quantile(all_margins, 0.01)) if all_margins else None,
            "error_at_flips_median": float(np.median(err_flip)) if err_flip else None,
            "error_at_flips_max": float(np.max(err_flip)) if err_flip else None,
            "error_elsewhere_median": float(np.median(err_rest)) if err_rest else None,
            "error_elsewhere_max": float(np.max(err_rest)) if err_rest else None,
        }
    names = list(runs)
    for a_i, a in enumerate(names):
        for b in names[a_i + 1:]:
            (_, ra), (_, rb) = runs[a], runs[b]
            diff = sum(any(ra.ids[k].get((pos, li)) != rb.ids[k].get((pos, li)) for li in layers)
                       for k in keys for pos in scored_of[k])
            total = sum(len(scored_of[k]) for k in keys)
            out["pairs"][f"{a} vs {b}"] = {"reference_tokens": total, "tokens_routed_differently": diff,
                                           "rate": diff / max(total, 1)}
    return out


def _margin(logp: np.ndarray, top_k: int | None = None) -> float:
    """The truth's log p_k - log p_(k+1) at one position and layer (k: the fixture's experts per token)."""
    k = top_k or _margin.top_k
    s = np.sort(logp)[::-1]
    return float(s[k - 1] - s[k])


_margin.top_k = 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals.near_ties", description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", default="qwen2-moe-shared")
    ap.add_argument("--layouts", default="tp1,tp4-dp4-ep4", help="comma-separated, e.g. tp1,tp2-dp2,tp4-dp4-ep4")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--target", default="spec")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--in-flight", type=int, default=0, help="the serving engine's in_flight (0: all at once)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from dpep_parity.checks.core.topology import validate
    from dpep_parity.evals import tasks
    from dpep_parity.evals.data import load_data
    from dpep_parity.evals.samples import prepare
    from dpep_parity.fixtures.build import fixture_path
    from dpep_parity.fixtures.specs import FIXTURES

    if a.fixture not in FIXTURES:
        raise SystemExit(f"--fixture {a.fixture!r} is unknown; known: {sorted(FIXTURES)}")
    spec = FIXTURES[a.fixture]
    _margin.top_k = spec.num_experts_per_tok
    model = str(fixture_path(a.fixture))
    cfg = json.loads((Path(model) / "config.json").read_text())
    try:
        layouts = [validate(Layout.parse(x), cfg) for x in a.layouts.split(",")]
    except ValueError as e:
        raise SystemExit(f"--layouts: {e}") from None
    data = load_data(a.data_dir, ("gsm8k",))
    taskset = tasks.TaskSet(data, max_gen_toks=32)
    samples = prepare(taskset, "gsm8k", a.docs, a.seed)
    task = tasks.get("gsm8k")
    pairs = [task.gold_pair(taskset, s) for s in samples]

    t0 = time.monotonic()
    print(f"truth: {layouts[0]} float64, {len(pairs)} documents", file=sys.stderr, flush=True)
    truth = serve(model, layouts[0], "float64", a.target, pairs, a.in_flight, logits=True)
    runs = {}
    for lay in layouts:
        print(f"{lay} {a.dtype} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        runs[str(lay)] = serve(model, lay, a.dtype, a.target, pairs, a.in_flight, logits=False)
    keys = _keys_in_order(truth[1], pairs, model)
    res = analyse(runs, truth, keys)
    res["settings"] = {"fixture": a.fixture, "layers": spec.num_hidden_layers, "dtype": a.dtype,
                       "target": a.target, "docs": len(pairs), "in_flight": a.in_flight,
                       "seconds": round(time.monotonic() - t0, 1)}
    print(report(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


def _keys_in_order(rec: RoutingRecorder, pairs, model_dir: str) -> list[Key]:
    """The recorder's request keys in the order of `pairs` (as the LM adapter encoded them)."""
    from dpep_parity.evals.lm_adapter import ForwardEngineLM

    class _Null:
        model_dir = None
    lm = ForwardEngineLM(engine=_Null(), tokenizer=model_dir, max_gen_toks=32)
    out = []
    for ctx, cont in pairs:
        c, t = lm._encode_pair(ctx, cont)
        matches = [k for k in rec.prompt_len if k[1] == tuple(c[-32:])]
        if len(matches) != 1:
            raise RuntimeError(f"near_ties: {len(matches)} served requests match a document's prompt")
        out.append(matches[0])
    return out


def report(res: dict) -> str:
    s = res["settings"]
    L = [f"Reference tokens routed otherwise than the float64 truth ({s['fixture']}, {s['layers']} layers, "
         f"{s['dtype']}, {s['docs']} documents, {s['seconds']} s):", "",
         "| layout | reference tokens | routed otherwise (rate) | documents with one | prompt positions routed "
         "otherwise | truth margin at flips / all (median; all 1 %) | error at flips (median / max) | error "
         "elsewhere (median / max) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in res["layouts"].items():
        L.append(f"| {name} | {r['reference_tokens']} | {r['tokens_routed_otherwise']} ({100 * r['rate']:.2f} %) "
                 f"| {r['documents_with_a_flip']} of {r['documents']} | {r['prompt_positions_routed_otherwise']} "
                 f"({100 * r['prompt_rate']:.2f} %) | {_f(r['margin_at_flips_median'])} / "
                 f"{_f(r['margin_all_median'])}; {_f(r['margin_all_p01'])} | {_f(r['error_at_flips_median'])} / "
                 f"{_f(r['error_at_flips_max'])} | {_f(r['error_elsewhere_median'])} / "
                 f"{_f(r['error_elsewhere_max'])} |")
    for name, r in res["pairs"].items():
        L.append(f"\n{name}: {r['tokens_routed_differently']} of {r['reference_tokens']} reference tokens routed "
                 f"differently ({100 * r['rate']:.2f} %)")
    return "\n".join(L)


def _f(x) -> str:
    return "-" if x is None else f"{x:.3g}"


if __name__ == "__main__":
    sys.exit(main())
