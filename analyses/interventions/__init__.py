"""The intervention engine (batched, suffix-only forwards) and the interventions on it: ablation, activation patching, attribution patching."""
