"""``interp study run SPEC --out DIR [--resume] [--ray [ADDRESS]] [--workers N]``: a scripted ablation
study (``analyses/studies/``); rows go to ``DIR/results.csv`` as they are computed, the plot to
``DIR/results.png``."""

from __future__ import annotations

from pathlib import Path

from analyses.cli.args import add_progress_args, whole
from analyses.studies.runner import run_study


def register(subparsers) -> None:
    study = subparsers.add_parser("study", help="scripted ablation studies from a TOML spec")
    study_commands = study.add_subparsers(dest="study_command", required=True, metavar="SUBCOMMAND")
    run = study_commands.add_parser("run", help="run a study spec; rows go to OUT/results.csv as computed")
    run.add_argument("spec", type=Path)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--resume", action="store_true", help="finish an interrupted run in OUT")
    run.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                     help="compute rows on Ray actors (pip install 'interp[ray]'): a cluster's HOST:PORT, "
                          "or none for the spec's [run].address, else a local instance")
    run.add_argument("--workers", type=whole(1), help="with --ray: at most this many actors (default: one per GPU, "
                                                    "else as many as each node's CPUs and memory hold)")
    add_progress_args(run)
    run.set_defaults(func=run_study_command)


def run_study_command(args) -> int:
    results = run_study(args.spec, args.out, resume=args.resume, progress=args.progress,
                        executor=None if args.ray is None else "ray", address=args.ray or None, workers=args.workers)
    print(f"wrote {results} and {results.with_name('results.png')}")
    return 0
