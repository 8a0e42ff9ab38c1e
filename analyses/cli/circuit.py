"""``interp circuit``: the edges among a model's role heads (architecture §4.6), in one directory:

    edges.csv     one row per edge (sender, receiver, via q/k/v/logits, composition score,
                  path-patching value and effect, both heads' roles)
    circuit.png   the strongest edges as a layered graph
    meta.json     the model (spec, family, impl, weights hash), the arguments, the chosen heads

The probes are split as the report splits them (one draw of ``--intervention-prompts + --prompts``
repeated-segment probes, recorded as meta.json's ``probe_split``): heads are classified on the
``--prompts`` selection rows (``analyses.roles.classify``) and given roles as the report gives them
(against their nulls, ``analyses.roles.nulls``, and the threshold); the senders and receivers are
the heads with the roles asked for (every role head by default); path patching runs on the
``--intervention-prompts`` measurement rows, which chose nothing, against their first-copy-corrupted
twins, with the loss on the predictable tokens as the metric. A model whose hooks or output projection cannot carry path
patching (the hook self-test, ``interp check``) is refused in one line before any sweep.

On a model whose true circuit is stored beside it (``interp tracr`` writes ``ground_truth/``),
the command scores every discovery method against that truth instead, on the stored task
(``analyses.circuits.circuit_eval.evaluate_known``), and writes discovery.csv,
discovery_curves.csv and faithfulness_vs_size.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from analyses.circuits.circuit import check_role, circuit_section
from analyses.circuits.circuit_eval import evaluate_known
from analyses.circuits.ground_truth import TRUTH_DIR, read_truth
from analyses.cli.tracr import write_discovery
from analyses.roles.classify import DEFAULT_THRESHOLD, ROLES, assign_roles, classify_heads
from analyses.roles.nulls import calibrate_roles
from analyses.report.intervention_figures import save_csv, save_figure
from analyses.cli.args import add_intervention_prompts_arg, add_model_args, add_probe_args, load_cli_model, whole
from analyses.report.split import probe_split
from analyses.report.meta import model_meta, write_meta
from analyses.circuits.edges import VIAS, check_vias
from analyses.circuits.path_patching import path_needs
from analyses.core.hook_check import require
from analyses.interventions.patching import DIRECTIONS
from analyses.core.probes import check_prompt_count, probes_for
from interp.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("circuit", help="edges among role heads: composition scores and path patching")
    add_model_args(parser)
    parser.add_argument("--senders", metavar="ROLE", help=f"sender heads' role, one of {', '.join(ROLES)} "
                                                          "(default: every head with a role)")
    parser.add_argument("--receivers", metavar="ROLE", help="receiver heads' role (default: every head with a role)")
    parser.add_argument("--via", default=",".join(VIAS),
                        help=f"inputs to patch, comma-separated from {', '.join(VIAS)} (default: all)")
    parser.add_argument("--direction", default="noise", choices=DIRECTIONS,
                        help="noise (default: the clean run with one edge corrupted) or denoise")
    add_probe_args(parser, prompts=16)
    add_intervention_prompts_arg(parser, "path patching")
    parser.add_argument("--top", type=whole(1), default=12, help="edges drawn in circuit.png (default 12)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.set_defaults(func=run_circuit)


def run_circuit(args: argparse.Namespace) -> int:
    check_role(args.senders, "--senders")
    check_role(args.receivers, "--receivers")
    vias = check_vias(args.via.split(","))
    check_prompt_count(args.prompts, f"--prompts {args.prompts}",
                       "the role nulls' t-test that picks the circuit's heads has prompts - 1 degrees of freedom")
    check_prompt_count(args.intervention_prompts, f"--intervention-prompts {args.intervention_prompts}",
                       "each edge's interval bootstraps over the measurement prompts")
    model = load_cli_model(args)
    truth = read_truth(args.model)
    if truth is not None:  # a model whose circuit is known (``interp tracr``): score discovery against it
        write_discovery(args.out, *evaluate_known(model, truth), f"{truth.task['program']} (ground truth)")
        print(f"scored against the true circuit in {args.model}/{TRUTH_DIR}; wrote {args.out}/discovery.csv")
        return 0
    for need in path_needs(vias):  # the hook self-test, before any sweep: without these no edge can be scored
        require(model, need, "interp circuit")
    # one draw, split as the report splits it: the selection rows choose the heads, the others measure
    probes = probes_for(model, args.intervention_prompts + args.prompts, args.seq_len, seed=args.seed)
    chosen_on, measured_on = probes.after(args.intervention_prompts), probes.first(args.intervention_prompts)
    scores = classify_heads(model, probes=chosen_on, seed=args.seed, memory_mb=args.memory_mb, progress=args.progress)
    # the report's rule: a score that beats its nulls at FDR 0.05 and reaches the threshold
    table = assign_roles(scores, DEFAULT_THRESHOLD,
                         calibration=calibrate_roles(model, chosen_on, seed=args.seed, memory_mb=args.memory_mb,
                                                     progress=args.progress))
    section = circuit_section(model, table, measured_on, sender_role=args.senders, receiver_role=args.receivers,
                              via=vias, direction=args.direction, top=args.top, seed=args.seed,
                              memory_mb=args.memory_mb, progress=args.progress)
    if section.figure is None:
        found = sorted({role for roles in table["role"] for role in roles.split(";") if role})
        raise UserError(f"no heads to connect: {len(section.senders)} sender heads (role {args.senders or 'any'}), "
                        f"{len(section.receivers)} receiver heads (role {args.receivers or 'any'}); roles found on "
                        f"this model: {', '.join(found) or 'none'}")
    csv_path = save_csv(section.edges, args.out / "edges.csv")
    png_path = save_figure(section.figure, args.out / "circuit.png")
    arguments = {key: str(value) if isinstance(value, Path) else value
                 for key, value in vars(args).items() if key not in ("func", "command")}
    write_meta(args.out, model_meta(model, args.model) | {
        "command": "circuit", "seed": args.seed, "arguments": arguments,
        "probe_split": probe_split(args.prompts, args.intervention_prompts, args.seed),
        "senders": [list(h) for h in section.senders], "receivers": [list(h) for h in section.receivers]})
    print(f"{len(section.edges)} edges among {len(set(section.senders) | set(section.receivers))} role heads; "
          f"wrote {csv_path} and {png_path}")
    return 0
