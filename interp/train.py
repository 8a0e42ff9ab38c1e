"""``interp train``: the recipe behind the embedded "toy" model (architecture §3.3).

A 2-layer attention-only GPT learns, on one CPU thread, from two kinds of sequence mixed in
every batch (a quarter text, three quarters synthetic):

- natural text that exists offline on every machine: the Python standard library's own ``.py``
  files, read as bytes from the running interpreter's installation (sorted, so deterministic;
  every ``HELD_OUT_EVERY``-th file is held out for evaluation);
- synthetic repeats: BOS, random bytes, then a random segment of period p repeated to the end.
  p and the offset vary per sequence, so attending by a fixed positional offset cannot predict
  the repeat: only a content-based (induction) mechanism can.

Every ``eval_every`` steps the recipe records the training loss, the held-out text loss, the
in-context-learning score (Olsson et al. 2022: mean loss on late tokens minus mean loss on
early tokens of the same held-out sequences; it falls below zero as the model learns to use its
context), the loss on the predictable half of synthetic repeats, and the best head's induction
and previous-token scores. The run is seeded and deterministic on CPU for a given thread count.

The same recipe trains the embedded model's shape with other positions (``positions``: learned,
rotary or ALiBi) and grouped key/value heads (``kv_heads``); the defaults are the shipped model's.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from interp.files import write_atomic
from interp.loading import save_checkpoint
from interp.model import GPTConfig, GPTModel
from interp.tokenizer import ByteTokenizer
from interp.errors import UserError

BOS = ByteTokenizer.bos_token_id
N_BYTES = 256
HELD_OUT_EVERY = 10  # every 10th stdlib file (in sorted order) is held-out text
_SKIPPED_DIRS = {"site-packages", "test", "tests", "idle_test"}
ICL_WINDOW = 8  # ICL score: mean loss over the last 8 positions minus over positions 8..15
# Recipe.positions -> GPTConfig.positional_embedding_type
POSITIONS = {"learned": "standard", "rotary": "rotary", "alibi": "alibi"}
# Fields added after the embedded model was recorded: written into training.json only when they
# differ from these defaults, so the default recipe's metadata stays byte for byte the shipped one.
VARIANT_DEFAULTS = {"positions": "learned", "kv_heads": None, "corpus": "stdlib", "name": "toy"}
# Recipe.corpus -> which standard-library files are the text: every .py file of the running
# interpreter ("stdlib"), or the pinned list behind the embedded "code" model, each file checked by
# its SHA-256 ("pinned", ``PINNED_CORPUS``).
CORPORA = ("stdlib", "pinned")
PINNED_CORPUS = "code_model/corpus.json"  # inside the interp package: {"python", "files": [{"path", "sha256"}]}

# What was tried on the way to the shipped recipe (2 shared CPU cores); written into training.json.
TRIED = (
    "PyTorch's default initialisation started at a loss of ~38 nats (N(0, 1) embeddings through the tied "
    "unembedding): replaced by GPT-2's N(0, 0.02).",
    "2 torch threads on the shared 2-core machine ran up to 6x slower than 1 (oversubscription): threads=1.",
    "d_model 64, 4 heads, n_ctx 64, batch 16, one repeat per synthetic sequence, lr 3e-3 or 1e-2: no "
    "induction head after 1500 steps; attention stayed diffuse (best previous-token score 0.14).",
    "d_model 128, 8 heads, n_ctx 128, batch 16-32, one repeat, lr 1e-3 to 2e-3 with cosine decay: no "
    "induction or previous-token head after 800 steps, and a positive (bad) ICL score on held-out text.",
    "Repeating the segment to the end of the sequence, sinusoidal-initialised learned positions and batch "
    "128: induction phase change near step 350 (d_model 64). The batch size was the decisive change.",
    "Repeating the segment a random 2..k times instead of to the end: a clearly longer plateau.",
    "d_model 128, n_ctx 128, batch 64 with cosine decay: still no induction head at step 700 (~1 s/step); "
    "chose n_ctx 64 with batch 128 instead.",
    "Cosine decay over a 500-step run delayed the phase change past its end (induction score 0.19 against "
    "0.74 with a near-constant rate); lr 6e-3 was slower than 3e-3. Shipped: constant 3e-3 after warm-up.",
)


@dataclass(frozen=True)
class Recipe:
    """Everything that determines a training run (model shape, data mix, optimiser, schedule)."""

    seed: int = 0
    steps: int = 1200
    batch_size: int = 128
    n_ctx: int = 64
    d_model: int = 128
    n_heads: int = 8
    n_layers: int = 2
    attn_only: bool = True
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    synthetic_fraction: float = 0.75
    min_period: int = 4
    eval_every: int = 50
    eval_batch: int = 64
    threads: int = 1
    positions: str = "learned"  # "learned" (sinusoid-initialised) | "rotary" | "alibi"
    kv_heads: int | None = None  # key/value heads (None: one per head; fewer: grouped-query, 1: multi-query)
    corpus: str = "stdlib"  # "stdlib" (every stdlib .py file) | "pinned" (PINNED_CORPUS, checked by SHA-256)
    name: str = "toy"  # the model's cfg.model_name

    def __post_init__(self):
        if self.corpus not in CORPORA:
            raise UserError(f"corpus={self.corpus!r} not supported; allowed: {', '.join(CORPORA)}")
        if self.positions not in POSITIONS:
            raise UserError(f"positions={self.positions!r} not supported; allowed: {', '.join(POSITIONS)}")
        if self.n_heads <= 0 or self.d_model % self.n_heads:
            raise UserError(f"n_heads={self.n_heads} must be a positive divisor of d_model={self.d_model}")
        if self.kv_heads is not None and (not isinstance(self.kv_heads, int) or self.kv_heads <= 0
                                          or self.n_heads % self.kv_heads):
            raise UserError(f"kv_heads={self.kv_heads} must be a positive divisor of n_heads={self.n_heads}")
        for name in ("steps", "batch_size", "warmup_steps", "eval_every", "eval_batch", "threads"):
            if getattr(self, name) <= 0:
                raise UserError(f"{name}={getattr(self, name)} must be a positive integer")
        if not 0.0 <= self.synthetic_fraction <= 1.0:
            raise UserError(f"synthetic_fraction={self.synthetic_fraction} must be in [0, 1]")
        if not 2 <= self.min_period <= self.max_period:
            raise UserError(f"min_period={self.min_period} must be in [2, {self.max_period}] for n_ctx={self.n_ctx}")
        if self.n_ctx < 4 * ICL_WINDOW:
            raise UserError(f"n_ctx={self.n_ctx} must be >= {4 * ICL_WINDOW} to measure the ICL score")

    @property
    def max_period(self) -> int:
        """Longest segment that fits twice after BOS."""
        return (self.n_ctx - 1) // 2

    def model_config(self) -> GPTConfig:
        return GPTConfig(
            d_vocab=ByteTokenizer.vocab_size, n_ctx=self.n_ctx, d_model=self.d_model, n_heads=self.n_heads,
            n_layers=self.n_layers, attn_only=self.attn_only, model_name=self.name,
            positional_embedding_type=POSITIONS[self.positions], n_key_value_heads=self.kv_heads,
        )

    def record(self) -> dict:
        """The recipe as written into training.json: every field, except that the variant fields
        (``VARIANT_DEFAULTS``) appear only when set, so the default recipe records as it always did."""
        fields = dataclasses.asdict(self)
        return {key: value for key, value in fields.items()
                if key not in VARIANT_DEFAULTS or value != VARIANT_DEFAULTS[key]}


PRESETS = {
    "full": Recipe(),
    "short": Recipe(steps=600, d_model=64, n_heads=4, eval_batch=32),
    # the embedded "code" model: real text only (the pinned stdlib files), a 128-byte context
    "code": Recipe(steps=6000, batch_size=32, n_ctx=128, d_model=128, n_heads=4, lr=2e-3, warmup_steps=200,
                   synthetic_fraction=0.0, eval_every=100, eval_batch=32, corpus="pinned", name="code"),
}


# ---------------------------------------------------------------------------------- data
def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (tests and site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = (f for f in root.rglob("*.py") if not _SKIPPED_DIRS & set(f.relative_to(root).parts))
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def pinned_files() -> list[Path]:
    """The files of ``PINNED_CORPUS`` under the running interpreter's stdlib, in the listed order,
    each checked against its recorded SHA-256 (refused in one line where one differs or is missing)."""
    pinned = json.loads((resources.files("interp") / PINNED_CORPUS).read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for entry in pinned["files"]:
        path = root / entry["path"]
        found = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        if found != entry["sha256"]:
            state = "is missing" if found is None else f"has SHA-256 {found[:12]}..., not {entry['sha256'][:12]}..."
            raise UserError(f"pinned corpus file {path} {state}: the 'code' recipe needs Python {pinned['python']}'s "
                            "standard library as it ships")
        files.append(path)
    return files


def load_corpus(corpus: str = "stdlib") -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The stdlib as two byte streams: (train (n,), held-out (m,)) uint8, plus a description
    (file counts, sizes and a SHA-256 of the text) for the training metadata. ``corpus``: which
    files (``CORPORA``)."""
    files = stdlib_files() if corpus == "stdlib" else pinned_files()
    if not files:
        raise FileNotFoundError(f"no .py files under {sysconfig.get_paths()['stdlib']!r}")
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for index, path in enumerate(files):
        parts[index % HELD_OUT_EVERY == 0].append(path.read_bytes())
    train, held_out = (b"\n".join(parts[key]) for key in (False, True))
    description = {
        "source": ("python stdlib .py files (excluding tests and site-packages)" if corpus == "stdlib"
                   else f"the python stdlib .py files pinned in interp/{PINNED_CORPUS}"),
        "python": platform.python_version(),
        "files": len(files),
        "held_out_every": HELD_OUT_EVERY,
        "train_bytes": len(train),
        "held_out_bytes": len(held_out),
        "sha256": hashlib.sha256(train + held_out).hexdigest(),
    }
    return _as_tensor(train), _as_tensor(held_out), description


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def text_batch(corpus: torch.Tensor, batch: int, n_ctx: int, generator: torch.Generator) -> torch.Tensor:
    """Random windows of the byte stream ``corpus`` (n,), BOS first -> tokens (batch, n_ctx)."""
    starts = torch.randint(len(corpus) - n_ctx, (batch,), generator=generator)
    windows = corpus[starts[:, None] + torch.arange(n_ctx - 1)].long()
    return torch.cat([torch.full((batch, 1), BOS), windows], dim=1)


@dataclass
class Repeats:
    """Synthetic repeat sequences. tokens (batch, pos); period and start (batch,): from ``start`` on,
    a segment of ``period`` random tokens repeats to the end of the sequence."""

    tokens: torch.Tensor
    period: torch.Tensor
    start: torch.Tensor

    def second_copy(self) -> torch.Tensor:
        """(batch, pos) bool: positions i of the second copy whose token occurs exactly once before i
        (at i - p). Random bytes collide: where the token also occurs elsewhere, an induction head
        rightly splits its attention over the tokens after each occurrence."""
        n_pos = self.tokens.shape[1]
        pos = torch.arange(n_pos)[None]
        begin = (self.start + self.period)[:, None]
        in_copy = (pos >= begin) & (pos < begin + self.period[:, None])
        before = torch.ones(n_pos, n_pos, dtype=torch.bool).tril(diagonal=-1)  # (q, k): k < q
        occurrences = ((self.tokens[:, :, None] == self.tokens[:, None, :]) & before).sum(dim=-1)  # (b, q)
        return in_copy & (occurrences == 1)

    def predictable(self) -> torch.Tensor:
        """(batch, pos) bool: the repeated positions minus the first (nothing announces the repeat)."""
        pos = torch.arange(self.tokens.shape[1])[None]
        return pos > (self.start + self.period)[:, None]


def repeat_batch(batch: int, n_ctx: int, min_period: int, generator: torch.Generator) -> Repeats:
    """BOS, random bytes, then from a random offset a segment of period p in
    [min_period, (n_ctx - 1) // 2] repeated to the end -> ``Repeats`` with tokens (batch, n_ctx).
    Repeating to the end (at least twice) makes many tokens per sequence predictable only by
    induction, which shortens the plateau before induction heads form."""
    max_period = (n_ctx - 1) // 2
    period = torch.randint(min_period, max_period + 1, (batch,), generator=generator)
    start = 1 + (torch.rand(batch, generator=generator) * (n_ctx - 2 * period)).long()
    tokens = torch.randint(N_BYTES, (batch, n_ctx), generator=generator)
    tokens[:, 0] = BOS
    pos = torch.arange(n_ctx)[None]
    first, p = start[:, None], period[:, None]
    source = torch.where(pos >= first + p, first + (pos - first) % p, pos)
    return Repeats(tokens.gather(1, source), period, start)


def training_batch(recipe: Recipe, corpus: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One batch (batch_size, n_ctx): ``synthetic_fraction`` of rows synthetic repeats, the rest text."""
    n_synthetic = round(recipe.synthetic_fraction * recipe.batch_size)
    synthetic = repeat_batch(n_synthetic, recipe.n_ctx, recipe.min_period, generator).tokens
    text = text_batch(corpus, recipe.batch_size - n_synthetic, recipe.n_ctx, generator)
    return torch.cat([synthetic, text])


# ---------------------------------------------------------------------------- evaluation
def icl_score(per_token_loss: torch.Tensor) -> float:
    """In-context-learning score from per-token losses (batch, pos - 1): mean loss over the last
    ``ICL_WINDOW`` positions minus mean loss over positions [ICL_WINDOW, 2 * ICL_WINDOW)."""
    late = per_token_loss[:, -ICL_WINDOW:].mean()
    early = per_token_loss[:, ICL_WINDOW:2 * ICL_WINDOW].mean()
    return float(late - early)


def head_scores(model: GPTModel, repeats: Repeats) -> dict[str, torch.Tensor]:
    """Induction and previous-token scores per head, each (n_layers, n_heads): mean attention from
    second-copy positions i to i - p + 1 (later copies, and tokens that occur more than once before
    i, are skipped: there attention may rightly split over several earlier occurrences), and from
    every position i >= 1 to i - 1."""
    _, cache = model.run_with_cache(repeats.tokens, names_filter=lambda name: name.endswith("hook_pattern"))
    pattern = torch.stack([cache["pattern", layer] for layer in range(model.cfg.n_layers)])  # (L, b, H, q, k)
    n_pos = repeats.tokens.shape[1]
    query = torch.arange(n_pos)
    previous = pattern[..., query[1:], query[1:] - 1].mean(dim=(1, 3))
    second = repeats.second_copy()  # (b, q)
    target = (query[None] - repeats.period[:, None] + 1).clamp(min=0)  # (b, q)
    to_target = pattern.gather(-1, target[None, :, None, :, None].expand(*pattern.shape[:-1], 1))[..., 0]
    induction = (to_target * second[None, :, None]).sum(dim=(1, 3)) / second.sum()
    return {"induction": induction, "previous_token": previous}


@dataclass
class EvalSet:
    """Fixed evaluation data: held-out text (batch, n_ctx) and synthetic repeats."""

    text: torch.Tensor
    repeats: Repeats

    @classmethod
    def build(cls, recipe: Recipe, held_out: torch.Tensor) -> "EvalSet":
        generator = torch.Generator().manual_seed(recipe.seed + 1_000_003)
        text = text_batch(held_out, recipe.eval_batch, recipe.n_ctx, generator)
        return cls(text, repeat_batch(recipe.eval_batch, recipe.n_ctx, recipe.min_period, generator))


@torch.no_grad()
def evaluate(model: GPTModel, data: EvalSet) -> dict[str, float]:
    """Held-out text loss, ICL score, loss on predictable repeat tokens, best head scores."""
    was_training = model.training
    model.eval()
    text_loss = model(data.text, return_type="loss", loss_per_token=True)
    repeat_loss = model(data.repeats.tokens, return_type="loss", loss_per_token=True)
    scores = head_scores(model, data.repeats)
    model.train(was_training)
    return {
        "text_loss": float(text_loss.mean()),
        "icl_score": icl_score(text_loss),
        "repeat_loss": float(repeat_loss[data.repeats.predictable()[:, 1:]].mean()),
        "induction_score": float(scores["induction"].max()),
        "previous_token_score": float(scores["previous_token"].max()),
    }


# ------------------------------------------------------------------------------ training
def initialise(model: GPTModel) -> GPTModel:
    """GPT-2's initialisation -- weights and embeddings N(0, 0.02), biases 0, each attention output
    projection scaled by 1 / sqrt(2 n_layers) -- except that learned position embeddings start as
    0.02 x the sinusoids of Vaswani et al. (still learned), so that attending to i - 1 is easy from
    the start. (PyTorch's defaults would give logits of std ~ sqrt(d_model) through the tied
    unembedding.) Rotary and ALiBi models have no position embeddings: their attention is given
    relative positions."""
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.zeros_(param)
            continue
        if param.ndim < 2:  # LayerNorm gains stay 1
            continue
        std = 0.02 / math.sqrt(2 * model.cfg.n_layers) if "out_proj" in name else 0.02
        torch.nn.init.normal_(param, std=std)
    if model.cfg.positional_embedding_type == "standard":
        with torch.no_grad():
            model.pos_embed.weight.copy_(0.02 * sinusoids(model.cfg.n_ctx, model.cfg.d_model))
    return model


def sinusoids(n_pos: int, width: int) -> torch.Tensor:
    """(n_pos, width): sin/cos of position at geometrically spaced frequencies, interleaved."""
    position = torch.arange(n_pos, dtype=torch.float32)[:, None]
    frequency = torch.exp(-math.log(n_pos) * torch.arange(0, width, 2, dtype=torch.float32) / width)
    table = torch.zeros(n_pos, width)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


@dataclass(frozen=True)
class Snapshot:
    """Checkpoints during training: after every ``every`` steps, the model as an interp checkpoint in
    ``directory / step_dirname(step)`` (the model is saved as it is; training goes on unchanged)."""

    every: int
    directory: Path

    def __post_init__(self):
        if self.every <= 0:
            raise UserError(f"--save-every {self.every} must be a positive number of steps")

    def save(self, step: int, model: GPTModel) -> Path:
        return save_checkpoint(model, self.directory / step_dirname(step))


def step_dirname(step: int) -> str:
    """The directory name of the checkpoint after ``step`` steps: zero-padded, so names sort by step."""
    return f"step_{step:06d}"


def learning_rate(recipe: Recipe, step: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then constant: a decaying rate delayed the
    induction phase change past the end of short runs."""
    return recipe.lr * min(1.0, (step + 1) / recipe.warmup_steps)


def train(recipe: Recipe, progress: bool = True, snapshot: Snapshot | None = None) -> tuple[GPTModel, list[dict], dict]:
    """Train a model by ``recipe`` -> (model in eval mode, history rows, training metadata).
    ``snapshot``, if given, sees the model every ``snapshot.every`` steps (it must not change it:
    the run is the same with or without one). The caller's thread count, global random generators
    and determinism setting are restored on exit, also when training raises."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=range(torch.accelerator.device_count())):  # _train reseeds them
            return _train(recipe, progress, snapshot)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(recipe: Recipe, progress: bool, snapshot: Snapshot | None) -> tuple[GPTModel, list[dict], dict]:
    corpus, held_out, data_description = load_corpus(recipe.corpus)
    eval_set = EvalSet.build(recipe, held_out)
    torch.manual_seed(recipe.seed)
    model = initialise(GPTModel(recipe.model_config())).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.99), weight_decay=recipe.weight_decay)
    generator = torch.Generator().manual_seed(recipe.seed)
    history = [{"step": 0, "train_loss": None, **evaluate(model, eval_set)}]  # no training loss yet
    began = time.perf_counter()
    running = []
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step)
        loss = model(training_batch(recipe, corpus, generator), return_type="loss")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running.append(loss.item())
        if snapshot is not None and (step + 1) % snapshot.every == 0:
            snapshot.save(step + 1, model)
        if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
            history.append({"step": step + 1, "train_loss": sum(running) / len(running), **evaluate(model, eval_set)})
            running = []
            if progress:
                _report_progress(history[-1], time.perf_counter() - began)
    seconds = time.perf_counter() - began
    metadata = {
        "recipe": recipe.record(),
        "data": data_description,
        "final": history[-1],
        "tried": list(TRIED),
        "environment": {"torch": torch.__version__, "threads": recipe.threads, "train_seconds": round(seconds, 1)},
    }
    return model.eval(), history, metadata


def _report_progress(row: dict, seconds: float) -> None:
    fields = " ".join(f"{key}={value:.3f}" for key, value in row.items() if key != "step")
    print(f"step {row['step']:>5} ({seconds:6.0f}s) {fields}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- outputs
def save_curves(history: list[dict], directory: Path) -> tuple[Path, Path]:
    """Write the history as ``training_curve.csv`` and a two-panel ``training_curve.png``, each
    atomically; the PNG carries no software/date metadata, so a rerun gives the same bytes."""
    import pandas as pd
    from matplotlib.figure import Figure  # no pyplot: never switches a notebook's backend

    frame = pd.DataFrame(history)
    fig = Figure(figsize=(11, 4))
    losses, scores = fig.subplots(1, 2)
    for column, label in [("train_loss", "training loss"), ("text_loss", "held-out text loss"),
                          ("repeat_loss", "loss on repeated tokens")]:
        losses.plot(frame["step"], frame[column], label=label)
    losses.set(xlabel="step", ylabel="nats per byte", title="loss")
    losses.legend()
    for column, label in [("induction_score", "best induction head"), ("previous_token_score", "best previous-token head"),
                          ("icl_score", "ICL score (late - early loss, nats)")]:
        scores.plot(frame["step"], frame[column], label=label)
    scores.axhline(0, color="grey", linewidth=0.5)
    scores.set(xlabel="step", title="head scores and in-context learning")
    scores.legend()
    fig.tight_layout()
    csv_path = write_atomic(directory / "training_curve.csv", lambda tmp: frame.to_csv(tmp, index=False, float_format="%.5f"))
    png_path = write_atomic(directory / "training_curve.png",
                            lambda tmp: fig.savefig(tmp, format="png", dpi=110, metadata={"Software": None}))
    return csv_path, png_path


def run(recipe: Recipe, out: Path, progress: bool = True, save_every: int | None = None) -> dict:
    """Train by ``recipe`` and write the checkpoint, training.json and curves into ``out``; with
    ``save_every``, also a checkpoint every that many steps under ``out/checkpoints/step_NNNNNN``."""
    snapshot = Snapshot(save_every, Path(out) / "checkpoints") if save_every is not None else None
    model, history, metadata = train(recipe, progress, snapshot)
    save_checkpoint(model, out, training={**metadata, "history": history})
    save_curves(history, out)
    return metadata


# ---------------------------------------------------------------------------------- CLI
TRAIN_HELP = "train the embedded toy model (or a variant) on CPU"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` subcommand's arguments (the ``interp`` console script's ``analyses/cli/train.py``
    and ``python -m interp train`` share them)."""
    parser.add_argument("--out", type=Path, required=True, help="directory for the checkpoint and curves")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full",
                        help="'full' is the shipped model's recipe; 'short' is a fast variant for tests")
    parser.add_argument("--steps", type=int, help="override the preset's number of steps")
    parser.add_argument("--seed", type=int, help="override the preset's seed")
    parser.add_argument("--positions", metavar="learned|rotary|alibi",
                        help="position information: learned embeddings (the shipped model's, the default), "
                             "rotary (RoPE) or ALiBi")
    parser.add_argument("--heads", dest="n_heads", type=int, metavar="H",
                        help="attention heads per layer, a divisor of d_model (default: the preset's); the same "
                             "d_model, so the same number of parameters, split into H heads of d_model / H")
    parser.add_argument("--kv-heads", dest="kv_heads", type=int, metavar="K",
                        help="key/value heads per layer, a divisor of the heads (default: one per head; "
                             "fewer: grouped-query attention, 1: multi-query)")
    parser.add_argument("--save-every", dest="save_every", type=int, metavar="N",
                        help="also save a checkpoint every N steps, as OUT/checkpoints/step_NNNNNN (for "
                             "`interp compare` and head scores over training)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="a progress line on stderr every few steps (default); --no-progress: none")
    parser.add_argument("--quiet", dest="progress", action="store_false", help="the same as --no-progress")
    parser.set_defaults(func=command)


def command(args) -> int:
    """Run the ``train`` subcommand parsed by ``add_arguments``."""
    overrides = {key: getattr(args, key) for key in ("steps", "seed", "positions", "n_heads", "kv_heads")
                 if getattr(args, key) is not None}
    recipe = dataclasses.replace(PRESETS[args.preset], **overrides)
    metadata = run(recipe, args.out, progress=args.progress, save_every=args.save_every)
    print(f"wrote {args.out} ({metadata['environment']['train_seconds']:.0f}s): {metadata['final']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m interp train ...`` (the same subcommand as the ``interp`` console script)."""
    parser = argparse.ArgumentParser(prog="python -m interp")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_arguments(subparsers.add_parser("train", help=TRAIN_HELP))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as error:
        print(f"interp {args.command}: error: {error}", file=sys.stderr)
        return 2
