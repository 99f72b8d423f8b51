"""One decoder layer (norm, attention, residual, norm, MLP block, residual) on each request."""
from dpep_parity.checks.oracle.reference import layer_mask
from dpep_parity.checks.units import Unit


def _decoder(layer):
    return lambda model, h, pe, mask: model.model.layers[layer](
        h, attention_mask=layer_mask(model, layer, mask), position_embeddings=pe)


UNIT = Unit("decoder", 2, "sequences",
            lambda oracle, layer, batch, inputs: oracle.per_request(batch, inputs, _decoder(layer), [layer]),
            lambda oracle, layer, batch, inputs: oracle.decoy_sequences(batch, inputs, _decoder(layer)),
            dispatch=True)
