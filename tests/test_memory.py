"""interp.memory: freed memory is kept for the next allocation instead of going back to the
kernel, up to the limit. Counted in page faults, not seconds, so the checks hold on a busy
machine; each case runs in a fresh interpreter, whose allocator nobody has tuned yet."""

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from interp import memory
from interp.memory import MAX_LIMIT_MB, retain_freed_memory

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc's"
)

# Allocates and frees `count` blocks of `block_mb` MB, the way a dropped cache does, three times,
# and reports the minor page faults of the third round next to the pages it wrote. Rounds one and
# two let glibc's own threshold adjustment settle, so the untuned control is steady. With
# "release", interp.memory.release_freed_memory runs before the third round.
THIRD_ROUND_FAULTS = textwrap.dedent("""
    import ctypes, importlib.util, json, resource, sys
    setup, count, block_mb = json.loads(sys.argv[1])
    if isinstance(setup, str) and setup.startswith("command"):  # a command that fails at once on its argument, after the process is set up
        import analyses.cli
        budget = setup.split(":")[1:]  # "command:256": with --memory-mb 256
        assert analyses.cli.main(["check", "--model", "/nonexistent/model-dir",
                                  *(["--memory-mb", budget[0]] if budget else [])]) == 2
    elif setup == "run_with_cache":
        import torch
        from interp import GPTConfig, GPTModel
        GPTModel(GPTConfig(d_vocab=16, n_ctx=8, d_model=8, n_heads=2, n_layers=1)).run_with_cache(torch.zeros(1, 8, dtype=torch.long))
    elif setup == "load_model(transformer_lens)":
        import tempfile
        from interp import load_model
        from interp.random_models import make_random_gpt2
        directory = tempfile.mkdtemp()
        for saved in make_random_gpt2(n_layers=1, d_model=16, n_heads=2, n_ctx=16, seed=0):
            saved.save_pretrained(directory)
        load_model(directory, impl="transformer_lens")
    elif setup != "untouched":  # interp.memory alone, without importing torch and the models
        spec = importlib.util.spec_from_file_location("memory", sys.argv[2])
        memory = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(memory)
        memory.retain_freed_memory(setup["limit_mb"])
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    def cache_round():  # straight to malloc: no library's own huge-page or pooling habits
        blocks = [libc.malloc(block_mb * 2**20) for _ in range(count)]
        for block in blocks:
            libc.memset(block, 1, block_mb * 2**20)
        for block in blocks:
            libc.free(block)
    cache_round(); cache_round()
    if isinstance(setup, dict) and setup.get("release"):
        memory.release_freed_memory()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cache_round()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps(faults / (count * block_mb * 2**20 / resource.getpagesize())))
""")


def faulted_fraction(setup, count, block_mb, opt_out=False):
    """Page faults of a repeated 'cache' of count x block_mb MB, as a fraction of its pages."""
    env = dict(os.environ, OMP_NUM_THREADS="1", INTERP_RETAIN_FREED_MEMORY="0" if opt_out else "1")
    done = subprocess.run([sys.executable, "-c", THIRD_ROUND_FAULTS, json.dumps([setup, count, block_mb]), memory.__file__],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


@glibc_only
def test_untuned_glibc_faults_a_dropped_caches_pages_in_again():
    # the control: the cost the tuning removes, so the tests below can fail
    assert faulted_fraction("untouched", count=50, block_mb=4) > 0.9


@glibc_only
def test_a_command_tunes_the_allocator_so_the_next_cache_reuses_its_pages():
    assert faulted_fraction("command", count=50, block_mb=4) < 0.05


@glibc_only
@pytest.mark.parametrize("setup", ["run_with_cache", "load_model(transformer_lens)"])
def test_the_library_leaves_the_process_allocator_alone(setup):
    """Taking a cache or loading a bridge inside someone else's process (a notebook kernel, a server) retunes nothing."""
    assert faulted_fraction(setup, count=50, block_mb=4) > 0.9


@glibc_only
def test_a_command_keeps_a_quarter_of_its_budget():
    # --memory-mb 256 keeps 64 MB: of 200 MB freed, the other 136 MB (68%) come back from the kernel
    assert 0.6 < faulted_fraction("command:256", count=50, block_mb=4) < 0.75


@glibc_only
def test_the_opt_out_variable_leaves_the_allocator_alone():
    assert faulted_fraction("command", count=50, block_mb=4, opt_out=True) > 0.9


@glibc_only
def test_retention_stops_at_the_limit():
    # 200 MB freed, 64 MB kept: the other 136 MB (68%) come back from the kernel
    assert 0.6 < faulted_fraction({"limit_mb": 64}, count=50, block_mb=4) < 0.75


@glibc_only
def test_keeping_everything_reuses_blocks_glibc_would_otherwise_map_fresh():
    # blocks over 32 MB: glibc maps them fresh whatever the limit
    assert faulted_fraction({"limit_mb": 1024}, count=5, block_mb=40) > 0.9
    assert faulted_fraction({"limit_mb": None}, count=5, block_mb=40) < 0.05


@pytest.mark.parametrize("limit", [-1, MAX_LIMIT_MB + 1, 1.5, True, "512"])
def test_a_limit_that_is_not_whole_megabytes_in_range_is_refused(limit):
    with pytest.raises(ValueError, match=f"limit_mb={limit!r}: expected whole megabytes from 0 to {MAX_LIMIT_MB}"):
        retain_freed_memory(limit)


@glibc_only
def test_releasing_hands_kept_memory_back_to_the_kernel():
    assert faulted_fraction({"limit_mb": None, "release": True}, count=5, block_mb=40) > 0.9
