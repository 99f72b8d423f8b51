"""The judge: one example's checks (parity, routing, router weights, dispatch, ...), invariance pairs."""
