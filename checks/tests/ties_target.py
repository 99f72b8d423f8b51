"""A correct target of another padding policy: at a cost tie (sum * 2 == max * dp) it pads SUM_LEN, as sglang
0.5.8 / 0.5.9 do, and says so (`padding_ties`); UNDECLARED pads the same without saying it. For the tests of
the padding-rule property's tie policy (test_parity_checks)."""
from __future__ import annotations

from dpep_parity.checks.core.batches import SUM_LEN, padding_mode
from dpep_parity.checks.targets.spec import SpecModel, SpecTarget


class SumLenTiesModel(SpecModel):
    def padding_mode(self, step):
        return padding_mode(step.batch, ties=SUM_LEN)


class SumLenTies(SpecTarget):
    name = "spec-sum-len-ties"
    model_class = SumLenTiesModel
    padding_ties = SUM_LEN


class Undeclared(SpecTarget):
    name = "spec-sum-len-ties-undeclared"
    model_class = SumLenTiesModel


TARGET = SumLenTies()
UNDECLARED = Undeclared()
DECLARED_ONLY = type("DeclaredOnly", (SpecTarget,), {"name": "spec-declares-sum-len-ties", "padding_ties": SUM_LEN})()
