"""Tokenizers behind ``to_tokens`` / ``to_string``: one small protocol, two implementations.

A tokenizer here has ``encode(text) -> list[int]`` (no BOS), ``decode(ids) -> str``,
``bos_token_id`` and ``vocab_size``.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class Tokenizer(Protocol):
    bos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 as tokens, plus BOS = 256 (vocab 257). Lossless for any text."""

    bos_token_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Adapter for a Hugging Face tokenizer (GPT-2's BOS is ``<|endoftext|>``)."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        bos = hf_tokenizer.bos_token_id
        self.bos_token_id = bos if bos is not None else hf_tokenizer.eos_token_id
        self.vocab_size = len(hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids))
