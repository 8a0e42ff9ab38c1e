"""Scripted ablation studies: the spec, the runner and its executors (local, Ray)."""
