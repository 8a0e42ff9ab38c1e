"""How many prompt rows one forward may hold: the single memory estimate behind every chunked
analysis (classification, the TransformerLens-compatible detector, ablation and patching)."""

from __future__ import annotations

DEFAULT_MEMORY_MB = 1024


def row_bytes(model, n_pos: int, *, logits: bool, kept_patterns: int = 0) -> int:
    """Float32 bytes one row of ``n_pos`` tokens needs in a forward: a few residual-sized
    activations, the MLP hidden layer and the attention patterns in flight, plus ``kept_patterns``
    layers of cached patterns; with ``logits``, the logits and the metric's log-softmax copy of
    them (with a 150k vocabulary, these dominate). Forwards that stop before the unembedding
    (classification) pass ``logits=False``."""
    cfg = model.cfg
    d_mlp = getattr(cfg, "d_mlp", None) or 4 * cfg.d_model
    logit_floats = 2 * cfg.d_vocab if logits else 0
    pattern = cfg.n_heads * n_pos * n_pos
    return 4 * (n_pos * (logit_floats + 8 * cfg.d_model + d_mlp) + (2 + kept_patterns) * pattern)


def rows_within(model, n_pos: int, memory_mb: float, *, logits: bool, kept_patterns: int = 0) -> int:
    """How many rows fit in ``memory_mb`` (at least one)."""
    return max(1, int(memory_mb * 2**20 // row_bytes(model, n_pos, logits=logits, kept_patterns=kept_patterns)))
