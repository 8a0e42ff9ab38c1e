"""What each component writes: the residual decomposition, DLA and logit lens, meaning (OV copying), linear probes, attention rollout and flow, MLP neurons."""
