"""Tokens for analyses: the one tokenization rule of ``interp.tokenizer``, on a hooked model.

Every analysis turns texts and ids into tokens through here, so both backends (our ``GPTModel``
and a TransformerLens bridge of any family) get the same treatment: texts are encoded without
special tokens, the model's start token (its BOS, else its EOS) is prepended where the model's own
input format has one (``starts_with_start_token``: ``cfg.default_prepend_bos``, which loading sets
from the tokenizer, the GGUF file or the family, and ``--prepend-bos/--no-prepend-bos`` overrides),
and a batch of unequal lengths is right-padded with its real lengths kept, so the padding can be
masked out of every score. Ids are checked against the model's vocabulary and context.

The one deliberate exception is ``analyses.roles.tl_compat.detect_heads``, which tokenises as
TransformerLens's ``detect_head`` does (``model.to_tokens`` per prompt), to reproduce its numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from interp.errors import UserError
from interp.tokenizer import TokenBatch, Tokenizer, as_tokenizer, chat_text, check_token_ids, encode_texts


def model_device(model) -> torch.device:
    """Where the model's weights are."""
    return next(model.parameters()).device


def accumulator_dtype(device: torch.device) -> torch.dtype:
    """The widest float ``device`` has, which accumulators there use: float64, float32 on mps (no float64)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def accumulator(model, *shape: int) -> torch.Tensor:
    """Zeros ``shape`` to sum an analysis's values into, by the one rule of where accumulators and
    results live (architecture §4.0, §4.11): on the model's device (a metric there cannot be added into a
    CPU tensor), in ``accumulator_dtype``, until a frame is made on the CPU. A value is added as
    ``value.to(acc)``: cast to its dtype there, never widened on the device first."""
    device = model_device(model)
    return torch.zeros(shape, dtype=accumulator_dtype(device), device=device)


def model_tokenizer(model) -> Tokenizer:
    """The model's tokenizer in ``interp.tokenizer``'s protocol (ours, or a Hugging Face one wrapped)."""
    return as_tokenizer(model.tokenizer)


def start_token_id(model) -> int:
    """The token every sequence starts with: the model's BOS, else its EOS."""
    return model_tokenizer(model).bos_token_id


def starts_with_start_token(model) -> bool:
    """Whether the model's texts (and probes) begin with its start token: ``cfg.default_prepend_bos``."""
    return bool(model.cfg.default_prepend_bos)


def start_ids(model) -> list[int]:
    """What every text and probe of the model begins with: ``[start token id]``, or ``[]`` where its
    input format has no start token."""
    return [start_token_id(model)] if starts_with_start_token(model) else []


def chat_texts(model, texts: Sequence[str]) -> list[str]:
    """Each text as the user's message in the model's chat template (``interp.tokenizer.chat_text``);
    a one-line refusal where the model has none. The template writes its own markers, so the
    texts are encoded with no start token added (``--chat`` sets that, unless the command line
    says otherwise)."""
    return [chat_text(model.tokenizer, text) for text in texts]


def token_differences(model_a, model_b) -> list[str]:
    """How the two models' tokens differ, as phrases; none when every id is the same token in both:
    the start token, the tokenizer's size, and the first id that decodes differently."""
    a, b = model_tokenizer(model_a), model_tokenizer(model_b)
    found = [] if a.bos_token_id == b.bos_token_id else [f"start token {a.bos_token_id} vs {b.bos_token_id}"]
    if a.vocab_size != b.vocab_size:
        return found + [f"tokenizer size {a.vocab_size} vs {b.vocab_size}"]
    differ = next((i for i in range(a.vocab_size) if a.decode([i]) != b.decode([i])), None)
    return found + ([] if differ is None else [f"token {differ} is {a.decode([differ])!r} vs {b.decode([differ])!r}"])


def ordinary_token_ids(model) -> list[int]:
    """Ids of ordinary tokens, ascending: neither special nor added, within the tokenizer and the
    model's vocabulary (a padded vocabulary's extra ids are no real tokens)."""
    return [i for i in model_tokenizer(model).ordinary_ids() if i < model.cfg.d_vocab]


def is_text(value) -> bool:
    """A string, or a non-empty list/tuple of strings."""
    if isinstance(value, str):
        return True
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(v, str) for v in value)


def encode(model, texts: str | Sequence[str], *, equal_lengths: bool = False) -> TokenBatch:
    """Texts -> a right-padded ``TokenBatch`` (tokens (batch, pos), lengths (batch,)) on the
    model's device; ``equal_lengths`` refuses texts of different token lengths."""
    batch = encode_texts(model_tokenizer(model), texts, model.cfg.n_ctx, prepend_bos=starts_with_start_token(model),
                         equal_lengths=equal_lengths)
    return batch.to(model_device(model))


def as_batch(model, tokens) -> TokenBatch:
    """Texts (of any lengths) or ids (pos,) / (batch, pos) -> a checked ``TokenBatch`` on the
    model's device (ids count as real throughout)."""
    if is_text(tokens):
        return encode(model, tokens)
    ids = as_tokens(model, tokens)
    return TokenBatch(ids, torch.full((ids.shape[0],), ids.shape[1], device=ids.device))


def as_tokens(model, tokens) -> torch.Tensor:
    """Texts of equal token length, or ids (pos,) / (batch, pos) -> checked ids (batch, pos) on the
    model's device."""
    if is_text(tokens):
        return encode(model, tokens, equal_lengths=True).tokens
    ids = check_token_ids(tokens, model.cfg.d_vocab, model.cfg.n_ctx)
    return ids.to(model_device(model))


def single_token_id(model, text: str) -> int:
    """The id of ``text`` when it is exactly one token (no start token); else a one-line error."""
    ids = model_tokenizer(model).encode(text)
    if len(ids) != 1:
        raise UserError(f"{text!r} is {len(ids)} tokens; it must be exactly one token")
    return int(ids[0])


def read_text(path, what: str) -> str:
    """The text of the UTF-8 file ``path`` that a user wrote, without a byte-order mark (a
    spreadsheet's "CSV UTF-8" and Notepad write one); ``what`` names the file in a one-line
    refusal (missing, not UTF-8 text)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {str(path)!r} does not exist")
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise UserError(f"{what} {str(path)!r} is not UTF-8 text ({error.reason} at byte {error.start})") from None


def read_text_lines(path, what: str) -> list[str]:
    """The non-empty lines of the UTF-8 text file ``path`` (``read_text``), one text each; ``what``
    names the file in a one-line refusal (missing, not UTF-8 text, no non-empty line)."""
    lines = [line for line in read_text(path, what).splitlines() if line.strip()]
    if not lines:
        raise UserError(f"{what} {str(path)!r} has no non-empty line")
    return lines


def leading_tokens(model, text: str, n_tokens: int) -> torch.Tensor:
    """The start token (where the model's texts have one) and the first tokens of ``text`` -> ids
    (pos,), at most ``n_tokens`` and the context long: for displaying a text that may be longer than
    the model can read."""
    ids = [*start_ids(model), *model_tokenizer(model).encode(text)][: min(n_tokens, model.cfg.n_ctx)]
    return torch.tensor(ids, device=model_device(model))
