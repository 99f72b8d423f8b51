"""The single-device oracle: transformers' modules in float64 and the test dtype."""
