"""Shared fixtures (and the offline switch, and each pytest-xdist worker's threads): one small
randomly initialised GPT-2, as a Hugging Face model, as our ``GPTModel`` and as a TransformerLens
``TransformerBridge`` over the same weights; one small toy report for the whole run
(``shared_reports``). No network."""

from __future__ import annotations

import os

# Nothing in the suite touches the network: huggingface_hub reads this once, at import.
os.environ["HF_HUB_OFFLINE"] = "1"


def worker_threads() -> int | None:
    """Under pytest-xdist (``make test``: ``-n auto``), each worker's share of the cores this process
    may use, at least 1, so that the workers do not oversubscribe them; None in one process."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(workers))


# Set before torch starts its thread pool; the environment also reaches the commands and notebook
# kernels the tests start. A value the caller set wins.
THREADS = worker_threads()
if THREADS is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

import pytest
import torch

if THREADS is not None:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from interp import GPTModel, from_hf
from interp.bridge import boot_bridge
from interp.random_models import make_random_gpt2, save_random_model
from shared_reports import shared_toy_report


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
    return from_hf(*hf_gpt2)


@pytest.fixture(scope="session")
def bridge_gpt2(hf_gpt2):
    return boot_bridge(*hf_gpt2)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(0)


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """family -> a directory holding a tiny randomly initialised model of that family with its
    tokenizer, as save_pretrained writes it (made once per session)."""
    made = {}

    def make(family: str):
        if family not in made:
            made[family] = save_random_model(family, tmp_path_factory.mktemp(family), seed=3)
        return made[family]

    return make


@pytest.fixture(scope="session")
def toy_report(tmp_path_factory):
    """(directory, stdout) of ``interp report`` on the toy at ``shared_reports.TOY_REPORT_ARGS``,
    computed once for the whole run: under pytest-xdist in the run's directory, which every worker's
    base directory sits in (``shared_reports``). Read-only: copy it to change it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        root = root.parent
    return shared_toy_report(root)
