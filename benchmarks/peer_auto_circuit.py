"""auto-circuit (Miller et al.) beside interp on one Tracr program: the same compiled model, the
same pairs, the same metric, each method's edge ROC AUC against auto-circuit's official circuit.

The model is auto-circuit's own ``tracr-xproportion`` (``make_frac_prevs(tokens == "x")``,
vocabulary w, x, y, z, max_seq_len 5): auto-circuit converts it to a TransformerLens
``HookedTransformer``, interp converts the same ``AssembledTransformerModel`` with ``from_tracr``
(their outputs are checked equal first). The pairs: a seeded 128 of the 1,024 inputs of length 5,
each corrupted by another (``task_pairs``). The metric: the mean squared error of the last
position's output from the clean run's (auto-circuit's ``answer_function="mse"`` with the clean
outputs as answers). The truth: auto-circuit's ``tracr_xproportion_official_edges``, on the edges
both graphs have (auto-circuit's graph also has edges out of the embedding, "Resid Start").

auto-circuit is never a test dependency. It needs an older TransformerLens (1.x) than interp's,
so the two cannot share a process: ``--side theirs`` runs in auto-circuit's own environment
(``benchmarks/README.md`` says how it was built) and writes its pairs, outputs and scores to
``--data``; ``--side ours`` runs in interp's, compiles the same program with Tracr as auto-circuit
does, checks the outputs equal, scores the same pairs and prints the table:

    /tmp/ac/bin/python benchmarks/peer_auto_circuit.py --side theirs --data /tmp/peer.pt
    .venv/bin/python benchmarks/peer_auto_circuit.py --side ours --data /tmp/peer.pt
"""

from __future__ import annotations

import argparse
import re
import time

import torch

PROMPTS, SEED, IG_STEPS, VOCAB, MAX_SEQ_LEN = 128, 0, 5, ("w", "x", "y", "z"), 5


def our_key(name: str, n_layers: int) -> tuple | None:
    """auto-circuit's edge name ("MLP 0->A1.0.V", "A1.0->Resid End") -> ours (sender, receiver,
    via) as ``graph_edge_scores`` names them; None for an edge out of the embedding."""
    source, destination = name.split("->")
    if source == "Resid Start":
        return None
    head = re.fullmatch(r"A(\d+)\.(\d+)", source)
    sender = ("head", int(head[1]), int(head[2])) if head else ("mlp", int(source.split()[1]), -1)
    if destination == "Resid End":
        return sender, ("logits", n_layers, -1), "logits"
    into_head = re.fullmatch(r"A(\d+)\.(\d+)\.([QKV])", destination)
    if into_head:
        return sender, ("head", int(into_head[1]), int(into_head[2])), into_head[3].lower()
    return sender, ("mlp", int(destination.split()[1]), -1), "mlp"


def pairs(encode) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded ``PROMPTS`` of the inputs of length ``MAX_SEQ_LEN``, each with a seeded partner
    (as ``analyses.circuits.circuit_eval.task_pairs``), encoded by ``encode`` (list of inputs ->
    token ids with the start token)."""
    import itertools
    inputs = [list(r) for r in itertools.product(VOCAB, repeat=MAX_SEQ_LEN)]
    generator = torch.Generator().manual_seed(SEED)
    chosen = sorted(torch.randperm(len(inputs), generator=generator)[:PROMPTS].tolist())
    tokens = encode([inputs[i] for i in chosen])
    order = torch.randperm(len(tokens), generator=generator)
    partner = torch.empty_like(order)
    partner[order] = order.roll(1)
    return tokens, tokens[partner]


def theirs(path: str) -> None:
    """auto-circuit's side: its model, EAP and EAP-IG (mask gradients), the official circuit."""
    from auto_circuit.data import PromptDataLoader, PromptDataset
    from auto_circuit.metrics.official_circuits.circuits.tracr.xproportion_official import (
        tracr_xproportion_official_edges)
    from auto_circuit.model_utils.tracr_model_utils import get_tracr_model
    from auto_circuit.prune_algos.mask_gradient import mask_gradient_prune_scores
    from auto_circuit.utils.graph_utils import patchable_model
    tl_model, assembled = get_tracr_model("xproportion", "cpu")
    ids = assembled.input_encoder.encoding_map
    clean, corrupted = pairs(lambda rows: torch.tensor([[ids["BOS"]] + [ids[v] for v in row] for row in rows]))
    with torch.no_grad():
        outputs = tl_model(clean)
    answers = outputs[:, -1].detach()
    patchable = patchable_model(tl_model, factorized=True, slice_output="last_seq", separate_qkv=True)
    loader = PromptDataLoader(PromptDataset(list(clean), list(corrupted), list(answers), list(answers)),
                              seq_len=None, diverge_idx=0, batch_size=PROMPTS, shuffle=False)
    scores = {}
    for name, steps in (("EAP", None), ("EAP-IG", IG_STEPS)):
        start = time.perf_counter()
        pruned = mask_gradient_prune_scores(patchable, loader, None, grad_function="logit", answer_function="mse",
                                            mask_val=0.0 if steps is None else None, integrated_grad_samples=steps)
        scores[name] = ({edge.name: float(edge.prune_score(pruned).abs()) for edge in patchable.edges},
                        time.perf_counter() - start)
    truth = sorted(edge.name for edge in tracr_xproportion_official_edges(patchable))
    torch.save({"clean": clean, "corrupted": corrupted, "outputs": outputs, "scores": scores, "truth": truth}, path)
    print(f"wrote {path}: {len(patchable.edges)} edges, official circuit {truth}")


def ours(path: str) -> None:
    """interp's side on the same compiled program and pairs; prints the table."""
    from tracr.compiler import compiling, lib
    from tracr.rasp import rasp

    from analyses.circuits.circuit_eval import graph_edge_scores, roc_auc
    from interp.tracr import from_tracr
    data = torch.load(path, weights_only=True)  # tensors, lists and numbers only: nothing to unpickle
    assembled = compiling.compile_rasp_to_model(lib.make_frac_prevs(rasp.tokens == "x"), vocab=set(VOCAB),
                                                max_seq_len=MAX_SEQ_LEN, compiler_bos="BOS")
    model = from_tracr(assembled)
    clean, corrupted = data["clean"], data["corrupted"]
    with torch.no_grad():
        outputs = model(clean)
    print(f"same model: max |interp - auto-circuit| output {float((outputs - data['outputs']).abs().max()):.2e}")
    answers = outputs[:, -1]

    def metric(logits: torch.Tensor) -> torch.Tensor:  # per prompt: minus the last position's squared error
        return -(logits[:, -1] - answers).pow(2).mean(-1)

    n_layers, truth = model.cfg.n_layers, set(data["truth"])
    rows = []
    for name, (scores, seconds) in data["scores"].items():
        for label, keep in (("all its edges", lambda n: True), ("edges both have", lambda n: our_key(n, n_layers))):
            edges = [(n, s) for n, s in scores.items() if keep(n)]
            rows.append(("auto-circuit", name, label, roc_auc([s for _, s in edges], [n in truth for n, _ in edges]),
                         len(edges), seconds))
    truth_ours = {our_key(name, n_layers) for name in truth} - {None}
    for name, method in (("exact edge patching", "patch"), ("EAP", "eap"), ("EAP-IG", "eap_ig")):
        start = time.perf_counter()
        frame = graph_edge_scores(model, clean, corrupted, metric, method, steps=IG_STEPS)
        seconds = time.perf_counter() - start
        keys = [((sk, sl, sh), (rk, rl, rh), via) for sk, sl, sh, rk, rl, rh, via in
                zip(frame.sender_kind, frame.sender_layer, frame.sender_head, frame.receiver_kind,
                    frame.receiver_layer, frame.receiver_head, frame.via)]
        rows.append(("interp", name, "edges both have", roc_auc(frame.score.abs(), [k in truth_ours for k in keys]),
                     len(keys), seconds))
    print(f"official circuit: {sorted(truth)}")
    print("| tool | method | edges | AUC | n edges | seconds |\n|---|---|---|---|---|---|")
    for tool, method, label, auc, n, seconds in rows:
        print(f"| {tool} | {method} | {label} | {auc:.3f} | {n} | {seconds:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=("theirs", "ours"), required=True)
    parser.add_argument("--data", default="/tmp/peer_auto_circuit.pt")
    args = parser.parse_args()
    torch.manual_seed(SEED)
    (theirs if args.side == "theirs" else ours)(args.data)


if __name__ == "__main__":
    main()
