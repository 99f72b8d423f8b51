"""A tiny eval task in one file (the registry's tests: evals/tests/test_task_registry.py, and an outside
package's entry point: checks/tests/test_entry_points.py)."""
from __future__ import annotations

import numpy as np

from dpep_parity.evals.data import DataError
from dpep_parity.evals.tasks.base import EvalTask, Measure, Sample, prefix_of_permutation, request_hash


def _outcomes(p, gate):
    return (np.array([r["metrics"]["acc"] for r in p.base]), np.array([r["metrics"]["acc"] for r in p.cfg]),
            np.array([r["doc_id"] for r in p.base]))


def _agreement(p):
    return float(np.mean([b["ll"] == c["ll"] for b, c in zip(p.base, p.cfg)])), "same log-likelihood"


class EchoTask(EvalTask):
    """A tiny task: is " <word>" the model's greedy continuation of "Say <word>:"? (log-likelihood requests)"""

    name = "echo"
    splits = ("test",)
    measures = (Measure("echo", margin=30.0, unit="item", cluster=None, outcomes=_outcomes,
                        agreement=_agreement),)

    def check_row(self, row, where):
        if not isinstance(row, dict) or not isinstance(row.get("word"), str):
            raise DataError(f"{where}: echo rows need a string 'word'")

    def select(self, taskset, limit, seed=1234):
        n = len(taskset.data.rows(self.name, "test"))
        return prefix_of_permutation(n, n if limit is None else min(limit, n), f"{seed}:echo")

    def build(self, taskset, selection):
        from lm_eval.api.instance import Instance

        out = []
        for i in selection:
            doc = taskset.data.rows(self.name, "test")[i]
            prompt = f"Say {doc['word']}:"
            inst = [Instance("loglikelihood", doc, (prompt, f" {doc['word']}"), idx=0, metadata=("echo", i, 1))]
            out.append(Sample(self.name, f"echo/{i}", i, None, doc, prompt, inst,
                              request_hash("echo", inst, doc["word"])))
        return out

    def run(self, lm, taskset, chunk):
        res = lm.loglikelihood([s.instances[0] for s in chunk], disable_tqdm=True)
        return [{"task": self.name, "doc_id": s.doc_id, "prompt_hash": s.prompt_hash, "ll": float(ll),
                 "metrics": {"acc": float(greedy)}} for s, (ll, greedy) in zip(chunk, res)]
