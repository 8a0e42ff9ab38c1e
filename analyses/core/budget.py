"""How many prompt rows one forward may hold: the single memory estimate behind every chunked
analysis (classification, the TransformerLens-compatible detector, ablation and patching)."""

from __future__ import annotations

DEFAULT_MEMORY_MB = 1024


def row_bytes(model, n_pos: int, *, logits: bool, kept_patterns: int = 0, read: int | None = None,
              layers: int = 1, per_position: int = 0) -> int:
    """Float32 bytes one row of ``n_pos`` tokens needs in a forward: the residual-sized
    activations of a block (its norms, q, k, v, z, outputs and the edits' copies: 16), the MLP's
    hidden layers (a gated one's gate, input, activation and product: 4) and the attention patterns
    in flight, plus ``kept_patterns``
    layers of cached patterns; with ``logits``, the logits of the ``read`` positions unembedded
    (None: all ``n_pos``) and the metric's two copies of them (the rows it selects, their
    log-softmax; with a 150k vocabulary, these dominate). Forwards that stop before the
    unembedding (classification) pass ``logits=False``. A backward keeps the activations of
    ``layers`` layers, and ``per_position`` more floats per position (per-head inputs)."""
    cfg = model.cfg
    d_mlp = getattr(cfg, "d_mlp", None) or 4 * cfg.d_model
    logit_floats = 3 * cfg.d_vocab * (n_pos if read is None else read) if logits else 0
    pattern = cfg.n_heads * n_pos * n_pos
    activations = layers * (n_pos * (16 * cfg.d_model + 4 * d_mlp) + 2 * pattern) + n_pos * per_position
    return 4 * (logit_floats + activations + kept_patterns * pattern)


def rows_within(model, n_pos: int, memory_mb: float, *, logits: bool, **sizes) -> int:
    """How many rows fit in ``memory_mb`` (at least one); ``sizes``: ``row_bytes``'s keywords."""
    return max(1, int(memory_mb * 2**20 // row_bytes(model, n_pos, logits=logits, **sizes)))


def tensors_within(memory_mb: float, nbytes: int) -> int:
    """How many stored tensors of ``nbytes`` bytes each fit in ``memory_mb`` (0 where not one does)."""
    return int(memory_mb * 2**20 // nbytes)


def held_mb(tensors) -> float:
    """MB held by ``tensors`` (an iterable of tensors; each distinct storage counted once): what a
    model's parameters or a stored run keep alive while later steps run."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values()) / 2**20


def model_mb(model) -> float:
    """MB of ``model``'s parameters and buffers (a null model of its architecture costs as much)."""
    return held_mb([*model.parameters(), *model.buffers()])


def left_after(memory_mb: float, held: float) -> float:
    """The budget left to a step while ``held`` MB of the same budget stay alive (a run's store, a
    null model): ``memory_mb - held``, but never under an eighth of ``memory_mb``, so a step still
    runs (then the process holds ``held`` beyond the budget's rest; ``docs/guides/memory.md``)."""
    return max(memory_mb - held, memory_mb / 8)
