"""The serving engine's invariance: the same prompts served under other arrival orders, DP dispatch policies and
concurrency limits give the same prompt logits and the same teacher-forced log-probabilities (decode steps), bit
for bit, for a target that promises batch and placement invariance (checks/judge/invariance.py); for one that does not,
the drift is measured.

    python -m checks.serving.invariance --target checks.catalog.variants:BATCH_INVARIANT --layout tp2-dp2-ep2
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

# Each variant against the default serving (every request at once, round-robin dispatch, up to 32 running per
# DP rank): what a request shares its steps with, and where it runs, change; the request does not.
VARIANTS: dict[str, dict] = {
    "reversed arrival": {"reverse": True},
    "shortest-queue dispatch": {"policy": "shortest_queue"},
    "one running request per DP rank": {"max_running": 1},
    "two requests in flight": {"in_flight": 2},
}


@dataclass
class ServedDrift:
    variant: str
    requests: int
    changed: int            # requests with any prompt logit or forced log-probability not bitwise equal
    max_abs: float          # the largest difference, in logits / log-probabilities

    def line(self) -> str:
        return (f"{self.variant}: " + ("identical" if not self.changed else
                                       f"{self.changed}/{self.requests} requests differ, max |diff| {self.max_abs:.3g}"))


def prompts_for(vocab: int, n: int = 6, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """n prompts of 3-9 tokens and 3-token continuations, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 10, (n,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]
    conts = [torch.randint(0, vocab, (3,), generator=g).tolist() for _ in range(n)]
    return prompts, conts


def _serve(model_dir, layout, target, dtype, prompts, conts, reverse=False, **engine_kw):
    from dpep_parity.checks.serving.engine import ServingEngine
    order = list(range(len(prompts)))[::-1] if reverse else list(range(len(prompts)))
    eng = ServingEngine(model_dir, layout.tp, layout.dp, layout.ep, target=target, dtype=dtype, **engine_kw)
    logits = eng.forward([prompts[i] for i in order])
    scores = eng.score_forced([prompts[i] for i in order], [conts[i] for i in order])
    back = {i: k for k, i in enumerate(order)}
    return ([logits[back[i]] for i in range(len(prompts))],
            [torch.tensor([s for s, _ in scores[back[i]]], dtype=torch.float64) for i in range(len(prompts))])


def served_drift(model_dir: str, layout, target: str, dtype: str = "float32", n: int = 6,
                 seed: int = 0) -> list[ServedDrift]:
    """The drift of each VARIANTS schedule against the default one. `layout`: anything with tp, dp and ep (a
    Layout, a sign-off configuration)."""
    from dpep_parity.checks.harness.unitjob import load_weights
    config, _ = load_weights(model_dir)
    prompts, conts = prompts_for(config["vocab_size"], n, seed)
    ref = _serve(model_dir, layout, target, dtype, prompts, conts)
    out = []
    for name, kw in VARIANTS.items():
        got = _serve(model_dir, layout, target, dtype, prompts, conts, **kw)
        changed, worst = 0, 0.0
        for i in range(n):
            pairs = [(ref[0][i], got[0][i]), (ref[1][i], got[1][i])]
            if any(not torch.equal(a, b) for a, b in pairs):
                changed += 1
                worst = max(worst, *((a.double() - b.double()).abs().max().item() for a, b in pairs))
        out.append(ServedDrift(name, n, changed, worst))
    return out


def main(argv=None) -> int:
    from dpep_parity.checks.core.topology import Layout
    from dpep_parity.checks.judge.invariance import claims
    from dpep_parity.checks.targets.protocol import resolve
    from dpep_parity.fixtures.build import fixture_path
    from dpep_parity.progname import prog
    ap = argparse.ArgumentParser(prog=prog("python -m checks.serving.invariance"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="spec")
    ap.add_argument("--fixture", default="qwen2-moe-noshared")
    ap.add_argument("--layout", default="tp2-dp2-ep2", type=Layout.parse)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=6)
    a = ap.parse_args(argv)
    promised = claims(resolve(a.target)) >= {"batch", "placement"}
    drifts = served_drift(str(fixture_path(a.fixture)), a.layout, a.target, a.dtype, a.requests)
    print(f"{a.target} on {a.fixture} at {a.layout}, {a.dtype} "
          f"({'promises batch and placement invariance' if promised else 'promises no serving invariance'}):")
    for d in drifts:
        print("  " + d.line())
    broken = promised and any(d.changed for d in drifts)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
