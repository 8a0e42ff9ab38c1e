"""What each head does: the probes' scores, classification, null models, dormant and backup heads, the causal check, TransformerLens compatibility."""
