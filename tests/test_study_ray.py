"""Studies sharded over Ray actors: the same bytes as a local run, with a worker killed mid-block,
with the driver killed and resumed, and for a grid; the one-line errors. One local Ray instance
(2 CPUs, no dashboard) for the module."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import analyses.studies.runner
from analyses.studies.runner import run_study
from interp import UserError

ray = pytest.importorskip("ray")

from analyses.studies.on_ray import (  # noqa: E402  (needs ray)
    MB, RUNTIME_MB, RayCells, actor_plan, check_reachable, loaded_bytes, worker_need)
from analyses.studies.spec import load_spec  # noqa: E402
from test_study import kill_at_rows  # noqa: E402  (pytest puts tests/ on sys.path)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    """The GCS address of a local Ray instance this process is connected to."""
    context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    yield context.address_info["gcs_address"]
    ray.shutdown()


def write_spec(path: Path, model='"toy"', method='"zero"', n=16, seq_len=32, targets='"each_head"') -> Path:
    path.write_text(f'[model]\nspec = {model}\n[prompts]\nn = {n}\nseq_len = {seq_len}\n'
                    f'[ablation]\nmethod = {method}\ntargets = {targets}\n')
    return path


def local_bytes(spec: Path, out: Path) -> bytes:
    return run_study(spec, out, progress=False).read_bytes()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: Ray's workers are children of the raylet this
    process started)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def busy_study_workers() -> list[int]:
    """Our study actors in the middle of a block of rows (Ray titles a process by the method it runs)."""
    busy = []
    for pid in descendants(os.getpid()):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::StudyWorker.rows"):
                busy.append(pid)
        except OSError:
            continue
    return busy


def test_a_grid_on_ray_is_byte_identical_to_the_local_run(tmp_path, cluster, gpt2_dir, monkeypatch):
    """A 2 x 2 grid (two models, two methods) with ``[run] executor = "ray"`` in the spec: every row
    computed by the actors (the driver's own ``StudyCells`` is disabled), the very bytes of the
    local run, and the same records ([run] is not part of the study's identity)."""
    spec = write_spec(tmp_path / "grid.toml", model=f'["toy", "{gpt2_dir}"]', method='["zero", "mean"]',
                      targets='"each_layer"')
    local = local_bytes(spec, tmp_path / "local")
    on_ray = tmp_path / "grid_on_ray.toml"
    on_ray.write_text('[run]\nexecutor = "ray"\nworkers = 2\n' + spec.read_text())

    def in_the_driver(*args):
        raise AssertionError("a row was computed in the driver")

    monkeypatch.setattr(analyses.studies.cells.StudyCells, "rows", in_the_driver)
    monkeypatch.setattr(analyses.studies.cells.StudyCells, "plan", in_the_driver)
    assert run_study(on_ray, tmp_path / "ray", progress=False).read_bytes() == local
    for record in ("spec.json", "provenance.json"):
        assert (tmp_path / "ray" / record).read_bytes() == (tmp_path / "local" / record).read_bytes()
    assert local.count(b"\n") == 1 + 4 * 2  # header, 4 cells of 2 layers


def test_a_killed_driver_resumes_and_a_killed_worker_costs_a_retry(tmp_path, cluster):
    """The driver killed (SIGKILL, in a subprocess) after some rows, then ``--resume`` on Ray, during
    which a worker is killed in the middle of a block: no row lost, none twice, the local bytes."""
    spec = write_spec(tmp_path / "spec.toml", method='"mean"', n=64, seq_len=64)  # rows slow enough to catch
    out = tmp_path / "killed"
    results = out / "results.csv"
    code = ("import sys, time; from analyses.studies.runner import run_study; "
            "run_study(sys.argv[1], sys.argv[2], progress=False, executor='ray', address=sys.argv[3], "
            "on_row=lambda i: time.sleep(0.3))")
    lines = kill_at_rows([sys.executable, "-c", code, str(spec), str(out), cluster], results, 3)
    assert 4 <= lines < 17  # killed mid-run: some of the 16 rows, not all
    killed = []

    def kill_a_busy_worker(index):
        deadline = time.monotonic() + 10
        while not killed and time.monotonic() < deadline:
            for pid in busy_study_workers()[:1]:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    resumed = run_study(spec, out, resume=True, progress=False, executor="ray", on_row=kill_a_busy_worker)
    assert killed, "no study worker was caught mid-block"
    assert not Path(f"/proc/{killed[0]}").exists()
    assert resumed.read_bytes() == local_bytes(spec, tmp_path / "local")


def test_a_user_error_on_a_worker_reaches_the_caller_as_one_line(tmp_path, cluster):
    spec = write_spec(tmp_path / "spec.toml", targets="[[5, 0]]")  # the toy model has 2 layers
    with pytest.raises(UserError, match=r"\[ablation\].targets: head L5H0 out of range") as error:
        run_study(spec, tmp_path / "out", progress=False, executor="ray", workers=1)
    assert type(error.value) is UserError and "\n" not in str(error.value)
    assert not (tmp_path / "out" / "results.csv").exists()


def test_an_unreachable_address_is_one_line_at_once(tmp_path, cluster):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(UserError) as error:
        run_study(write_spec(tmp_path / "spec.toml"), tmp_path / "out", progress=False, executor="ray",
                  address=f"127.0.0.1:{port}")
    assert time.monotonic() - start < 10  # Ray itself would retry for minutes
    assert str(error.value) == (f"--ray '127.0.0.1:{port}': no Ray cluster answers there (Connection refused); "
                                "start one with `ray start --head`, or pass --ray alone for a local one")
    with socket.create_server(("127.0.0.1", 0)) as other:  # something answers, but not our cluster
        with pytest.raises(UserError, match=f"already connected to the Ray cluster at '{cluster}'"):
            run_study(write_spec(tmp_path / "spec.toml"), tmp_path / "out", progress=False, executor="ray",
                      address=f"127.0.0.1:{other.getsockname()[1]}")


@pytest.mark.parametrize("address", ["nonsense", "host:port", "ray://:10001"])
def test_a_malformed_address_is_refused(address):
    with pytest.raises(UserError, match=f"--ray '{address}': expected HOST:PORT"):
        check_reachable(address)


def test_without_ray_a_local_run_works_and_ray_is_one_line(tmp_path):
    """With ``import ray`` failing (as where the extra is not installed): a local run never imports
    it, and ``--ray`` is refused in one line."""
    spec = write_spec(tmp_path / "spec.toml", targets='"each_layer"')
    code = ("import sys; sys.modules['ray'] = None  # import ray now fails, as without the extra\n"
            "from analyses.cli import main\n"
            "assert main(['study', 'run', sys.argv[1], '--out', sys.argv[2], '--quiet']) == 0\n"
            "sys.exit(main(['study', 'run', sys.argv[1], '--out', sys.argv[3], '--ray']))")
    done = subprocess.run([sys.executable, "-c", code, str(spec), str(tmp_path / "local"), str(tmp_path / "ray")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stderr
    assert (tmp_path / "local" / "results.csv").read_bytes().count(b"\n") == 3
    assert done.stderr.strip() == ("interp study: error: --ray needs Ray, an optional extra that is not installed: "
                                   "pip install 'interp[ray]'")


# ------------------------------------------------------------------ how many actors (made-up clusters)
GiB = 2**30


def test_on_cpus_as_many_actors_as_memory_holds_each_asking_for_its_memory():
    """8 CPUs and room for 3 models -> 3 actors, each asking Ray for one CPU and its memory."""
    plan = actor_plan([{"CPU": 8.0, "memory": 3.5 * GiB}], need_bytes=GiB)
    assert plan.count == 3 and plan.options == {"num_cpus": 1, "memory": GiB}
    assert actor_plan([{"CPU": 2.0, "memory": 100 * GiB}], GiB).count == 2  # then the CPUs bound it
    assert actor_plan([{"CPU": 8.0, "memory": 3.5 * GiB}], GiB, workers=2).count == 2  # --workers caps it
    # per node: an actor cannot span nodes (4 CPUs and no room + no CPU and room: none on either)
    two_nodes = [{"CPU": 4.0, "memory": 0.5 * GiB}, {"CPU": 1.0, "memory": 5 * GiB}]
    assert actor_plan(two_nodes, GiB).count == 1


def test_on_gpus_one_actor_per_gpu():
    plan = actor_plan([{"CPU": 16.0, "GPU": 2.0, "memory": 0.1 * GiB}], need_bytes=40 * GiB)
    assert plan == (2, {"num_gpus": 1})
    assert actor_plan([{"CPU": 4.0, "GPU": 1.0, "memory": GiB}, {"CPU": 4.0, "GPU": 3.0}], GiB).count == 4


def test_too_little_memory_for_one_actor_is_one_line_naming_the_sizes():
    with pytest.raises(UserError) as error:
        actor_plan([{"CPU": 8.0, "memory": 1.5 * GiB}, {"CPU": 2.0, "memory": 0.5 * GiB}], 3 * GiB,
                   what="a study worker: model 'big' in float32 (1.00 GiB) + ...")
    assert str(error.value) == ("Ray: no node has room for a study worker: model 'big' in float32 (1.00 GiB) + ... "
                                "(3.00 GiB); the most memory a node gives Ray is 1.50 GiB (CPUs on a node: at most 8)")
    with pytest.raises(UserError, match="--workers 0: must be >= 1"):
        actor_plan([{"CPU": 8.0, "memory": 8 * GiB}], GiB, workers=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_is_sized_from_its_files_as_loading_it_would_take(dtype, gpt2_dir):
    from interp import load_model

    toy = load_model("toy", dtype=dtype)
    assert loaded_bytes("toy", dtype) == sum(t.numel() * t.element_size() for t in toy.state_dict().values())
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gpt2_dir, dtype=dtype)  # its parameters (tied ones once) and buffers
    stored = {name: t for name, t in hf.state_dict().items() if name != "lm_head.weight"}  # tied: not saved
    assert loaded_bytes(str(gpt2_dir), dtype) == sum(t.numel() * t.element_size() for t in stored.values())
    with pytest.raises(UserError, match="cannot size model 'nobody/no-such-model'.*local Hugging Face cache"):
        loaded_bytes("nobody/no-such-model", dtype)
    with pytest.raises(UserError, match="cannot size model '/no/such/dir'"):
        loaded_bytes("/no/such/dir", dtype)


def test_each_actor_asks_ray_for_the_model_the_budget_and_the_runtime(tmp_path, cluster):
    """On the local instance (2 CPUs, room for both): 2 actors, and Ray's available memory falls by
    what they asked for while they live."""
    study = load_spec(write_spec(tmp_path / "spec.toml"))
    need, _ = worker_need(study.cells, 256)
    assert need == loaded_bytes("toy", "float32") + (256 + RUNTIME_MB) * MB
    before = ray.available_resources()["memory"]
    with RayCells(study.cells, memory_mb=256) as cells:
        cells.plan(0)  # every actor has started and loaded the model
        assert len(cells.actors) == 2
        assert before - ray.available_resources()["memory"] == pytest.approx(2 * need, rel=1e-6)
