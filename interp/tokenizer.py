"""Tokenizers behind ``to_tokens`` / ``to_string``, and the one rule for turning texts into tokens.

A tokenizer here has ``encode(text) -> list[int]`` (no special tokens), ``decode(ids) -> str``,
``bos_token_id`` (the token that starts every sequence: the model's BOS, else its EOS, as
GPT-2's ``<|endoftext|>`` does both jobs), ``vocab_size`` and ``ordinary_ids()``. ``as_tokenizer``
wraps a Hugging Face tokenizer in that protocol.

The rule (``encode_texts``), used by every analysis and by ``GPTModel.to_tokens``: each text is
encoded without special tokens, the start token is prepended where the model's input format has
one (``cfg.default_prepend_bos``), and a batch of unequal lengths is padded on the right, with the
real lengths returned, so the padding can be masked out of every score. Causal attention keeps the
padding invisible to the real positions.

The start token (architecture §4.11): a model's tokenizer says whether its text begins with one
(``add_bos_token`` in a Hugging Face tokenizer's files, ``tokenizer.ggml.add_bos_token`` in a GGUF
file); where it says nothing, the family's default holds. The setting is stored once on the model,
as ``cfg.default_prepend_bos`` (our ``GPTConfig`` and the TransformerLens bridge's cfg alike), with
where it came from as ``model.start_token_source`` (``START_TOKEN_SOURCES``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from interp.errors import UserError


class Tokenizer(Protocol):
    bos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def ordinary_ids(self) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 as tokens, plus BOS = 256 (vocab 257). Lossless for any text."""

    bos_token_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def ordinary_ids(self) -> list[int]:
        return list(range(256))


class VocabTokenizer:
    """A small fixed vocabulary (Tracr's compiled programs): ``tokens[i]`` is id i's value (a JSON
    value: a string, number or bool), ``bos_token_id`` the start token's id, ``special_ids`` the
    ids that are not ordinary tokens (the start and padding tokens). ``outputs`` (optional) names
    the model's output space: ``outputs[j]`` is the value of logit j.

    Text is split on whitespace (``"1 3 2"``), or into characters where it has none and every
    token is one character (``"abc"``); each piece must be a token's ``str``."""

    def __init__(self, tokens, bos_token_id: int, special_ids=(), outputs=None):
        self.tokens = list(tokens)
        self.bos_token_id = int(bos_token_id)
        self.special_ids = sorted({self.bos_token_id, *map(int, special_ids)})
        self.outputs = None if outputs is None else list(outputs)
        self.vocab_size = len(self.tokens)
        self._ids = {str(token): i for i, token in enumerate(self.tokens)}
        if len(self._ids) != self.vocab_size or not 0 <= self.bos_token_id < self.vocab_size:
            raise UserError(f"vocabulary {self.tokens} must have distinct names and hold the start token id {bos_token_id}")

    def encode(self, text: str) -> list[int]:
        pieces = text.split()
        if len(pieces) == 1 and pieces[0] not in self._ids:
            pieces = list(pieces[0])
        unknown = sorted({piece for piece in pieces if piece not in self._ids})
        if unknown:
            raise UserError(f"{text!r} has pieces {unknown} outside the vocabulary {[str(t) for t in self.tokens]}")
        return [self._ids[piece] for piece in pieces]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(self.tokens[i]) for i in ids)

    def ordinary_ids(self) -> list[int]:
        return [i for i in range(self.vocab_size) if i not in self.special_ids]

    def to_dict(self) -> dict:
        """What a checkpoint's config.json stores (``from_dict`` reads it back)."""
        return {"kind": "vocab", "tokens": self.tokens, "bos_token_id": self.bos_token_id,
                "special_ids": self.special_ids, "outputs": self.outputs}

    @classmethod
    def from_dict(cls, fields: dict) -> "VocabTokenizer":
        return cls(fields["tokens"], fields["bos_token_id"], fields["special_ids"], fields.get("outputs"))


class HFTokenizer:
    """Adapter for a Hugging Face tokenizer. Its start token is its BOS, else its EOS (GPT-2's
    and Qwen's ``<|endoftext|>``, Pythia's ``<|endoftext|>``); one with neither is refused."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        start = hf_tokenizer.bos_token_id if hf_tokenizer.bos_token_id is not None else hf_tokenizer.eos_token_id
        if start is None:
            raise UserError(f"tokenizer {hf_tokenizer.name_or_path!r} has neither a BOS nor an EOS token to start a sequence")
        self.bos_token_id = int(start)
        self.vocab_size = len(hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids))

    def ordinary_ids(self) -> list[int]:
        """Ids of ordinary vocabulary tokens: neither special (BOS, EOS, PAD, UNK, ...) nor added
        afterwards (chat markers and the like), below ``len(tokenizer)``."""
        excluded = set(self.hf.all_special_ids) | set(self.hf.get_added_vocab().values())
        return [i for i in range(self.vocab_size) if i not in excluded]


# where a model's start-token setting came from (``set_start_token``)
START_TOKEN_SOURCES = ("tokenizer", "gguf", "family default", "model config", "chat template", "command line",
                       "study spec")


def tokenizer_adds_bos(hf_tokenizer) -> bool | None:
    """Whether a Hugging Face tokenizer begins a text with its BOS when it adds its special tokens,
    as ``tokenizer(text)`` does: its ``add_bos_token``, wherever its files keep it
    (tokenizer_config.json, or only tokenizer.json's post-processor, where transformers 5 saves it;
    the ``add_bos_token`` attribute is False there even when the BOS is added), read by encoding one
    character. None where it cannot say: a tokenizer of ours, or one without a BOS (Qwen2's)."""
    bos = getattr(hf_tokenizer, "bos_token_id", None)
    if not hasattr(hf_tokenizer, "init_kwargs") or bos is None:
        return None
    ids = hf_tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def set_start_token(model, prepend: bool, source: str) -> None:
    """Store whether ``model``'s texts begin with its start token: ``cfg.default_prepend_bos``
    (which ``to_tokens`` and every analysis read), and ``source``, one of ``START_TOKEN_SOURCES``,
    as ``model.start_token_source``."""
    if source not in START_TOKEN_SOURCES:
        raise UserError(f"start token source {source!r} unknown; allowed: {', '.join(START_TOKEN_SOURCES)}")
    model.cfg.default_prepend_bos = bool(prepend)
    model.start_token_source = source


def follow_tokenizer(model, declared: bool | None) -> None:
    """``set_start_token`` from what the model's tokenizer does (``declared``: ``tokenizer_adds_bos``
    of it, read before anything edits it), else (None) the family's default, which
    ``model.cfg.default_prepend_bos`` holds when this is called."""
    if declared is None:
        set_start_token(model, model.cfg.default_prepend_bos, "family default")
    else:
        set_start_token(model, declared, "tokenizer")


def start_token_setting(model) -> tuple[bool, str]:
    """``(prepend, source)``: whether ``model``'s texts begin with its start token, and where that
    came from (``"model config"`` for a model nothing set it on: one built from a ``GPTConfig``)."""
    return bool(model.cfg.default_prepend_bos), getattr(model, "start_token_source", "model config")


def chat_text(tokenizer, text: str) -> str:
    """``text`` as the user's one message in the tokenizer's chat template, with the prompt for the
    assistant's reply after it (Hugging Face's ``apply_chat_template``; a GGUF file's
    ``tokenizer.chat_template``, which transformers reads into the tokenizer); a one-line refusal
    where the tokenizer has no template."""
    hf = getattr(tokenizer, "hf", tokenizer)
    if not getattr(hf, "chat_template", None):
        name = getattr(hf, "name_or_path", "") or type(hf).__name__
        raise UserError(f"the model's tokenizer ({name}) has no chat template; drop --chat")
    return hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def as_tokenizer(tokenizer) -> Tokenizer:
    """Our tokenizer protocol for ``tokenizer`` (ours as it is; a Hugging Face one wrapped)."""
    return tokenizer if hasattr(tokenizer, "ordinary_ids") else HFTokenizer(tokenizer)


@dataclass
class TokenBatch:
    """tokens: (batch, pos) ids, the start token first where the texts have one, right-padded with the start token;
    lengths: (batch,) how many of each row's tokens are real."""

    tokens: torch.Tensor
    lengths: torch.Tensor

    @property
    def real(self) -> torch.Tensor:
        """(batch, pos) bool: True on real tokens, False on padding."""
        return torch.arange(self.tokens.shape[1], device=self.tokens.device)[None] < self.lengths[:, None]

    def to(self, device) -> "TokenBatch":
        return TokenBatch(self.tokens.to(device), self.lengths.to(device))


def encode_texts(tokenizer: Tokenizer, texts: str | Sequence[str], n_ctx: int, *, prepend_bos: bool = True,
                 equal_lengths: bool = False) -> TokenBatch:
    """Texts -> a right-padded ``TokenBatch`` (the rule in the module docstring).

    Every text must be a non-empty string of at most ``n_ctx`` tokens (a start token included);
    with ``equal_lengths`` all must tokenise to the same length (patching pairs need that).
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise UserError("got an empty list of texts; pass at least one")
    rows = []
    for text in texts:
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"text must be a non-empty string, got {text!r}")
        ids = ([tokenizer.bos_token_id] if prepend_bos else []) + list(tokenizer.encode(text))
        if not ids:
            raise UserError(f"text {text!r} encodes to no token")
        if len(ids) > n_ctx:
            raise UserError(f"text {_clip(text)!r} is {len(ids)} tokens, longer than the context n_ctx={n_ctx}")
        rows.append(ids)
    lengths = torch.tensor([len(ids) for ids in rows])
    if equal_lengths and len(set(lengths.tolist())) > 1:
        raise UserError(f"texts tokenise to different lengths {sorted(set(lengths.tolist()))}; pass texts of equal token length")
    tokens = torch.full((len(rows), int(lengths.max())), tokenizer.bos_token_id, dtype=torch.long)
    for row, ids in enumerate(rows):
        tokens[row, : len(ids)] = torch.tensor(ids)
    return TokenBatch(tokens, lengths)


def check_token_ids(tokens, d_vocab: int, n_ctx: int) -> torch.Tensor:
    """Token ids (pos,) or (batch, pos) -> a checked long tensor (batch, pos): integer ids in
    [0, d_vocab), 1 <= pos <= n_ctx. Anything that is not an array of ids (an object holding them as
    ``.tokens``, such as probes; ragged lists) is refused in one line."""
    try:
        tokens = torch.as_tensor(tokens)
    except (TypeError, ValueError, RuntimeError):
        held = "; its .tokens holds them" if isinstance(getattr(tokens, "tokens", None), torch.Tensor) else ""
        raise UserError(f"tokens must be integer ids of shape (batch, pos), got a {type(tokens).__name__}{held}") \
            from None
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise UserError(f"tokens must be integer ids of shape (batch, pos), got {tuple(tokens.shape)} {tokens.dtype}")
    if tokens.shape[1] == 0 or tokens.shape[0] == 0:
        raise UserError(f"tokens are empty: shape {tuple(tokens.shape)}")
    if tokens.shape[1] > n_ctx:
        raise UserError(f"tokens are {tokens.shape[1]} long, longer than the context n_ctx={n_ctx}")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= d_vocab:
        raise UserError(f"token id {high if high >= d_vocab else low} out of range [0, {d_vocab})")
    return tokens.long()


def _clip(text: str, width: int = 30) -> str:
    return text if len(text) <= width else text[:width] + "..."
