"""Core types and models: layouts and their rank groups, batches, the tolerance model, failure records."""
