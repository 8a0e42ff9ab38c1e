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

from analyses.studies.on_ray import check_reachable  # noqa: E402  (needs ray)
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
    with pytest.raises(UserError, match=r"\[ablation\].targets: head \(5, 0\) out of range") as error:
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
