"""The self-attention of one layer (QKV, RoPE, attention over prefix + extend, o_proj) on each request."""
from dpep_parity.checks.oracle.reference import layer_mask
from dpep_parity.checks.units import Unit


def _attention(layer):
    return lambda model, h, pe, mask: model.model.layers[layer].self_attn(
        hidden_states=h, position_embeddings=pe, attention_mask=layer_mask(model, layer, mask))[0]


UNIT = Unit("attention", 1, "sequences",
            lambda oracle, layer, batch, inputs: oracle.per_request(batch, inputs, _attention(layer), [layer]),
            lambda oracle, layer, batch, inputs: oracle.decoy_sequences(batch, inputs, _attention(layer)))
