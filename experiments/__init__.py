"""Experiment drivers: Hydra entry points, workloads and benchmark result files."""
