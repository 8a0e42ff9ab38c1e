"""interp: hook-instrumented attention and GPT models, for looking inside attention heads."""

from interp import teaching
from interp.teaching import (CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper, SelfAttentionV1,
                             SelfAttentionV2)
from interp.attention import GroupedQueryAttention
from interp.convert import from_hf
from interp.errors import UserError
from interp.loading import load_model
from interp.model import GPTConfig, GPTModel, next_token_loss
from interp.tokenizer import ByteTokenizer
from interp.provenance import provenance, weights_hash
from interp.tracr import from_tracr

__all__ = [
    *teaching.__all__,  # the attention chapter's modules
    "GroupedQueryAttention",
    "GPTConfig",
    "GPTModel",
    "ByteTokenizer",
    "load_model",
    "from_hf",
    "from_tracr",
    "UserError",
    "weights_hash",
    "provenance",
    "next_token_loss",
]
__version__ = "0.1.0"
