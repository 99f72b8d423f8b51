"""Multi-rank execution: worlds (local pools, torchrun), collective records, transport, the rank job."""
