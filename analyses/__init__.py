"""analyses: how we look inside a hooked model (classification, ablation, patching, reports)."""
