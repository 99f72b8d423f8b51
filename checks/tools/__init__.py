"""Command-line tools: dpep, the kill table, replay, bisect, calibration, benchmarks."""
