"""The pytest plugin and the suite's options and hypothesis profiles."""
