"""Shared fixtures: one small randomly initialised GPT-2, as a Hugging Face model, as our
``GPTModel`` and as a TransformerLens ``TransformerBridge`` over the same weights. No network."""

from __future__ import annotations

import pytest
import torch

from interp import GPTModel
from interp.gpt2 import gpt2_bridge, make_random_gpt2


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    """A local GPT-2 directory (weights + tokenizer) as written by save_pretrained."""
    model, tokenizer = make_random_gpt2(n_layers=2, d_model=64, n_heads=4, n_ctx=64, seed=1)
    directory = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def hf_gpt2():
    return make_random_gpt2(n_layers=2, d_model=64, n_heads=4, n_ctx=64, seed=2)


@pytest.fixture(scope="session")
def scratch_gpt2(hf_gpt2) -> GPTModel:
    return GPTModel.from_gpt2(*hf_gpt2)


@pytest.fixture(scope="session")
def bridge_gpt2(hf_gpt2):
    return gpt2_bridge(*hf_gpt2)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(0)
