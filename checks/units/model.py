"""The whole model: token ids in, logits of every extend token out (prefix in the KV cache first)."""
from dpep_parity.checks.units import Unit

UNIT = Unit("model", 3, "tokens",
            lambda oracle, layer, batch, inputs: oracle.model(batch, inputs),
            lambda oracle, layer, batch, inputs: oracle.decoy_tokens(batch, inputs),
            whole_model=True)
