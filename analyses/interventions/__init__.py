"""The intervention engine (batched, suffix-only forwards) and the interventions on it: ablation and its random-head controls, activation patching, attribution patching."""
