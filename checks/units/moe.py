"""The MLP block of one layer (sparse MoE, or the dense MLP of a dense layer) on the extend rows."""
from dpep_parity.checks.units import Unit


def reference(oracle, layer, batch, inputs):
    uref = oracle.mlp(layer, inputs[0])
    sizes = [r.extend for _, _, r in batch.requests_flat()]   # router rows split back into requests
    uref.router = [(list(p.split(sizes)), list(q.split(sizes))) for p, q in uref.router]
    return uref


UNIT = Unit("moe", 0, "rows", reference, lambda oracle, layer, batch, inputs: oracle.decoy_rows(layer, batch, inputs[0]),
            dispatch=True)
