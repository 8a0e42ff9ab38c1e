"""The circuit of a Tracr-compiled program, derived from the compiler's own graph (architecture §4.10).

Tracr turns every RASP operation into one craft block -- an attention head (``Aggregate``), an
MLP (``Map``, ``SequenceMap``), or an attention head then an MLP (``SelectorWidth``) -- places
the blocks in layers and copies their weights into the model. ``compile_with_graph`` runs the
same compiler passes as ``tracr.compiler.compiling.compile_rasp_to_model`` and keeps the graph;
``ground_truth`` then reads, with nothing typed in:

- the true nodes: which layer and head, or which layer's MLP, computes each operation (heads are
  matched by identity with the heads of the compiled attention layers; MLPs by the layer the
  compiler allocated them to, Tracr's ``craft_graph_to_model._allocate_modules_to_layers``);
- the true edges: component A -> component B when B's operation reads the output of A's (an
  ``Aggregate`` reads its selector's queries through its query input, the keys through its
  key input, the aggregated values through its value input; an MLP reads its inputs; a
  ``SelectorWidth``'s MLP reads its own head), and the program's output component -> "logits".
  Reads of the token and position embeddings are not edges (the circuit tools have no embedding
  senders).

Frames, as the circuit tools write them (``analyses.circuits.path_patching``): nodes ``layer, head,
kind ("head" | "mlp"), component ("L1H0" | "MLP1"), op, true`` for every component of the model
(an MLP's head is -1; ``op`` joins the operations it computes, "" for none); edges
``sender_layer, sender_head, receiver_layer, receiver_head, via`` plus ``sender_kind,
receiver_kind, op`` for the true edges only (via "q" | "k" | "v" for a head, "mlp" for an MLP,
"logits" with receiver (n_layers, -1) for the unembedding).

A checkpoint that ``interp tracr`` writes keeps its truth beside the weights, in
``ground_truth/`` (``write_truth``): ``nodes.csv``, ``edges.csv`` and ``task.json`` (the program,
its inputs, the output space, how the pairs are drawn and the metric), so that ``interp circuit``
and ``interp report`` score discovery against it (``read_truth``) without Tracr installed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd

from interp.errors import UserError
from interp.files import write_atomic
from interp.tracr import BOS, library_program, require_tracr

NODE_COLUMNS = ["layer", "head", "kind", "component", "op", "true"]
EDGE_COLUMNS = ["sender_layer", "sender_head", "receiver_layer", "receiver_head", "via", "sender_kind",
                "receiver_kind", "op"]
Component = tuple[str, int, int]  # (kind, layer, head); an MLP's head is -1


@dataclass
class Compilation:
    """A compiled program with the compiler's graph: ``assembled`` (Tracr's model), ``graph``
    (networkx, one node per RASP expression, with its craft block), ``sink`` (the output's node),
    ``sources`` (tokens and indices), ``craft_model`` (the blocks in model order)."""

    assembled: object
    graph: object
    sink: dict
    sources: list
    craft_model: object


def compile_with_graph(name: str, vocab: Sequence, max_seq_len: int, causal: bool = False) -> Compilation:
    """``interp.tracr.PROGRAMS[name]`` compiled by the passes of Tracr's ``compile_rasp_to_model``
    (same arguments, same start token), keeping what the passes build."""
    require_tracr()
    from tracr.compiler import (basis_inference, craft_graph_to_model, craft_model_to_transformer,
                                expr_to_craft_graph, rasp_to_graph)
    from tracr.compiler.compiling import COMPILER_PAD
    from tracr.craft import bases
    from tracr.rasp import rasp
    program = library_program(name, vocab, max_seq_len)
    extracted = rasp_to_graph.extract_rasp_graph(program)
    graph, sources, sink = extracted.graph, extracted.sources, extracted.sink
    basis_inference.infer_bases(graph, sink, set(vocab), max_seq_len)
    expr_to_craft_graph.add_craft_components_to_rasp_graph(graph, bos_dir=bases.BasisDirection(rasp.tokens.label, BOS),
                                                           mlp_exactness=100)
    craft_model = craft_graph_to_model.craft_graph_to_model(graph, sources)
    assembled = craft_model_to_transformer.craft_model_to_transformer(
        craft_model=craft_model, graph=graph, sink=sink, max_seq_len=max_seq_len, causal=causal,
        compiler_bos=BOS, compiler_pad=COMPILER_PAD)
    return Compilation(assembled, graph, sink, sources, craft_model)


def _component_layers(compilation: Compilation) -> dict[str, list[Component]]:
    """RASP label -> the components computing it, in model order."""
    from tracr.compiler import assemble, craft_graph_to_model, nodes
    from tracr.craft import transformers
    graph = compilation.graph
    _, module_names = assemble._get_model_config_and_module_names(compilation.craft_model)
    layer_of_block = [int(name.split("_")[1].split("/")[0]) for name in module_names]
    allocation = craft_graph_to_model._allocate_modules_to_layers(graph, compilation.sources)
    # the compiler's slots (attention even, MLP odd) that hold a block, in order, are the model's blocks
    used = sorted({slot + offset for node_id, slot in allocation.items()
                   for offset in range(_width(graph.nodes[node_id][nodes.MODEL_BLOCK]))})
    assert len(used) == len(layer_of_block), "Tracr's layer allocation no longer matches its assembly"
    slot_layer = dict(zip(used, layer_of_block))
    head_index = {}
    for block, layer in zip(compilation.craft_model.blocks, layer_of_block):
        if not isinstance(block, transformers.MLP):
            for index, head in enumerate(block.as_multi().heads()):
                head_index[id(head)] = (layer, index)
    found: dict[str, list[Component]] = {}
    for node_id, slot in allocation.items():
        block = graph.nodes[node_id][nodes.MODEL_BLOCK]
        parts = block.blocks if isinstance(block, transformers.SeriesWithResiduals) else [block]
        components = []
        for offset, part in enumerate(parts):
            if isinstance(part, transformers.MLP):
                components.append(("mlp", slot_layer[slot + offset], -1))
            else:
                components.extend(("head", *head_index[id(head)]) for head in part.as_multi().heads())
        found[node_id] = components
    return found


def _width(block) -> int:
    """How many compiler slots a block fills: 2 for a head then an MLP (SelectorWidth), else 1."""
    from tracr.craft import transformers
    return 2 if isinstance(block, transformers.SeriesWithResiduals) else 1


def _reads(expr) -> list[tuple[str, str]]:
    """The SOps an operation's block reads -> [(label, via)]: via "q"/"k"/"v" for an attention
    head's inputs, "in" for an MLP's."""
    from tracr.rasp import rasp
    if isinstance(expr, rasp.Aggregate):
        return [(expr.selector.queries.label, "q"), (expr.selector.keys.label, "k"), (expr.sop.label, "v")]
    if isinstance(expr, rasp.SelectorWidth):
        return [(expr.selector.queries.label, "q"), (expr.selector.keys.label, "k")]
    return [(child.label, "in") for child in expr.children]


def ground_truth(compilation: Compilation, model) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(nodes, edges) of the compiled program (see the module docstring), for ``model`` (its
    conversion, ``interp.from_tracr(compilation.assembled)``, which gives the component grid)."""
    from tracr.compiler import nodes
    graph = compilation.graph
    computed = _component_layers(compilation)
    ops: dict[Component, list[str]] = {}
    for label, components in computed.items():
        for component in components:
            ops.setdefault(component, []).append(label)
    node_rows = []
    for layer in range(model.cfg.n_layers):
        grid = [("head", layer, head) for head in range(model.cfg.n_heads)] + [("mlp", layer, -1)]
        for component in grid:
            labels = ops.get(component, [])
            node_rows.append((layer, component[2], component[0], _name(component), ", ".join(labels), bool(labels)))
    edge_rows = set()
    for label, components in computed.items():
        expr = graph.nodes[label][nodes.EXPR]
        readers = components
        if len(components) == 2 and components[0][0] == "head" and components[1][0] == "mlp":  # SelectorWidth
            edge_rows.add(_edge(components[0], components[1], "mlp", label))
            readers = components[:1]
        for read_label, via in _reads(expr):
            for sender in _writers(computed, read_label):
                for receiver in readers:
                    edge_rows.add(_edge(sender, receiver, "mlp" if receiver[0] == "mlp" else via, read_label))
    for sender in _writers(computed, compilation.sink[nodes.ID]):
        edge_rows.add((sender[1], sender[2], model.cfg.n_layers, -1, "logits", sender[0], "logits",
                       compilation.sink[nodes.ID]))
    node_frame = pd.DataFrame(node_rows, columns=NODE_COLUMNS)
    edge_frame = pd.DataFrame(sorted(edge_rows), columns=EDGE_COLUMNS)
    return node_frame, edge_frame


def _writers(computed: dict[str, list[Component]], label: str) -> list[Component]:
    """The components whose output is ``label``'s value: its last one (a SelectorWidth's MLP);
    none for tokens and indices (the embeddings)."""
    return computed.get(label, [])[-1:]


def _edge(sender: Component, receiver: Component, via: str, op: str) -> tuple:
    return (sender[1], sender[2], receiver[1], receiver[2], via, sender[0], receiver[0], op)


def _name(component: Component) -> str:
    kind, layer, head = component
    return f"L{layer}H{head}" if kind == "head" else f"MLP{layer}"


TRUTH_DIR = "ground_truth"
TASK_KEYS = ("program", "vocab", "max_seq_len", "causal", "inputs", "outputs", "pairs", "seed", "ig_steps", "metric")


@dataclass
class KnownTruth:
    """A model's true circuit and its task: ``nodes``/``edges`` as ``ground_truth`` returns them;
    ``task`` (``TASK_KEYS``): ``inputs`` (lists of vocabulary values, one length, without the
    start token), ``outputs`` (the output space, None for a numerical program), ``pairs``
    ("every": every ordered pair of two inputs, or "one": a seeded derangement; see
    ``analyses.circuits.circuit_eval.task_pairs``), ``seed``, ``ig_steps`` and ``metric`` (its name)."""

    nodes: pd.DataFrame
    edges: pd.DataFrame
    task: dict


def write_truth(directory: str | Path, truth: KnownTruth) -> Path:
    """Write ``truth`` into ``directory/ground_truth/`` (each file atomically) -> that folder."""
    missing = [key for key in TASK_KEYS if key not in truth.task]
    if missing:
        raise UserError(f"the task lacks {', '.join(missing)}; it needs {', '.join(TASK_KEYS)}")
    folder = Path(directory) / TRUTH_DIR
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "nodes.csv", truth.nodes.to_csv(index=False).encode())
    write_atomic(folder / "edges.csv", truth.edges.to_csv(index=False).encode())
    write_atomic(folder / "task.json", json.dumps(truth.task, indent=1).encode())
    return folder


def read_truth(model_spec: str | Path) -> KnownTruth | None:
    """The truth stored beside a checkpoint (``write_truth``), or None where ``model_spec`` is no
    directory holding one (a model without a known circuit)."""
    folder = Path(model_spec) / TRUTH_DIR
    if not folder.is_dir():
        return None
    try:
        task = json.loads((folder / "task.json").read_text())
        nodes = pd.read_csv(folder / "nodes.csv", keep_default_na=False)
        edges = pd.read_csv(folder / "edges.csv", keep_default_na=False)
    except (OSError, ValueError) as error:
        raise UserError(f"{folder}: a broken ground truth ({error}); write it again with `interp tracr`") from None
    if set(NODE_COLUMNS) - set(nodes.columns) or set(EDGE_COLUMNS) - set(edges.columns) or set(TASK_KEYS) - set(task):
        raise UserError(f"{folder}: the ground truth lacks columns or task keys; write it again with `interp tracr`")
    return KnownTruth(nodes.astype({"true": bool}), edges, task)
