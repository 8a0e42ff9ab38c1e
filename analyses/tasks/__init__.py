"""Tasks (prompts, answers, a metric) and causal tracing on them."""
