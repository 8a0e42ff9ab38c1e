"""TransformerLens ``head_detector.detect_head`` scores, batched, for cross-checks (architecture §4.1, §6).

``detect_head(model, prompts, name, exclude_bos=..., exclude_current_token=..., error_measure=...)``
runs one forward per prompt and per role; ``detect_heads`` gives the same numbers (to float
rounding) for all three of its named patterns from one chunked forward. Its conventions, kept here:

- each prompt is tokenised on its own by ``model.to_tokens(prompt)`` (on a bridge that follows the
  family's own ``default_prepend_bos``) and must be 2 .. n_ctx - 1 tokens. This is the one
  deliberate exception to ``analyses.core.tokens``' rule: it is how ``detect_head`` tokenises;
- the detection pattern D (pos, pos) covers the whole prompt, BOS row included:
  previous_token_head: D[i, i-1] = 1; duplicate_token_head: D[i, j] = 1 for j < i with the same
  token; induction_head: the duplicate pattern shifted one key to the right (D[i, j] = dup[i, j-1]),
  lower triangle only;
- "mul": with A the pattern after zeroing the BOS column (``exclude_bos``) and the diagonal
  (``exclude_current_token``), score = sum(A * D) / sum(A);
- "abs": score = 1 - round(sum(|A - D|) / pos, 3), the excluded entries of |A - D| zeroed;
- a list of prompts scores the mean over prompts.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from analyses.core.execution import executing
from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.core.checks import check_choice
from analyses.roles.classify import pattern_chunks
from analyses.core.hook_names import pattern_names
from analyses.core.tokens import model_device
from interp.errors import UserError

TL_HEAD_NAMES = ("previous_token_head", "duplicate_token_head", "induction_head")
ERROR_MEASURES = ("mul", "abs")


def detect_head_tokens(model, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts tokenised as ``detect_head`` does, one ``model.to_tokens`` each -> right-padded
    tokens (batch, pos) and real lengths (batch,), on the model's device."""
    bad = [prompt for prompt in prompts if not (isinstance(prompt, str) and prompt.strip())]
    if not prompts or bad:
        raise UserError(f"every prompt must be a non-empty string, got {bad[0] if bad else 'no prompt'!r}")
    rows = [model.to_tokens(prompt)[0].cpu() for prompt in prompts]
    lengths = torch.tensor([len(row) for row in rows])
    if not (2 <= int(lengths.min()) and int(lengths.max()) < model.cfg.n_ctx):
        raise UserError(f"prompts are {int(lengths.min())}..{int(lengths.max())} tokens; detect_head needs "
                        f"2 to {model.cfg.n_ctx - 1} (fewer than n_ctx={model.cfg.n_ctx})")
    device = model_device(model)
    return pad_sequence(rows, batch_first=True).to(device), lengths.to(device)


def detection_patterns(tokens: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """TransformerLens's detection patterns for right-padded ``tokens`` (batch, pos) of real
    lengths (batch,): name -> (batch, q, k) float, zero outside the real square."""
    n_pos = tokens.shape[1]
    pos = torch.arange(n_pos, device=tokens.device)
    real = pos[None] < lengths[:, None]
    square = real[:, :, None] & real[:, None, :]
    earlier = pos[:, None] > pos[None, :]
    duplicate = (tokens[:, :, None] == tokens[:, None, :]) & earlier & square
    induction = torch.zeros_like(duplicate)
    induction[:, :, 1:] = duplicate[:, :, :-1]
    induction &= (pos[:, None] >= pos[None, :]) & square
    previous = (pos[:, None] - 1 == pos[None, :]) & square
    return {"previous_token_head": previous.float(), "duplicate_token_head": duplicate.float(),
            "induction_head": induction.float()}


def similarity(pattern: torch.Tensor, detection: torch.Tensor, lengths: torch.Tensor, *,
               exclude_bos: bool, exclude_current_token: bool, error_measure: str) -> torch.Tensor:
    """``compute_head_attention_similarity_score`` for every prompt and head at once.

    pattern: (batch, head, q, k); detection: (batch, q, k); lengths: (batch,) -> (batch, head).
    Padded rows and columns of ``pattern`` are ignored.
    """
    n_pos = pattern.shape[-1]
    pos = torch.arange(n_pos, device=pattern.device)
    real = pos[None] < lengths[:, None]
    keep = real[:, :, None] & real[:, None, :]
    if exclude_bos:
        keep = keep & (pos != 0)[None, None, :]
    if exclude_current_token:
        keep = keep & (pos[:, None] != pos[None, :])[None]
    keep = keep[:, None].to(pattern.dtype)
    if error_measure == "mul":
        kept = pattern * keep
        return (kept * detection[:, None]).sum((-2, -1)) / kept.sum((-2, -1))
    error = ((pattern - detection[:, None]).abs() * keep).sum((-2, -1)) / lengths[:, None]
    return 1 - torch.round(error.cpu().double(), decimals=3).to(pattern)  # rounded as float64 on the CPU: mps has none


@torch.no_grad()
def detect_heads(
    model,
    prompts: str | Sequence[str],
    names: Sequence[str] = TL_HEAD_NAMES,
    *,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
    error_measure: str = "mul",
    memory_mb: float = DEFAULT_MEMORY_MB,
    progress: bool | None = None,
) -> dict[str, torch.Tensor]:
    """``detect_head`` for several named patterns from one batched forward.

    Returns name -> (n_layers, n_heads) tensor, equal to
    ``transformer_lens.head_detector.detect_head(model, prompts, name, ...)``.
    """
    unknown = [name for name in names if name not in TL_HEAD_NAMES]
    if unknown:
        raise UserError(f"unknown detection pattern(s) {unknown}; allowed: {', '.join(TL_HEAD_NAMES)}")
    check_choice("error_measure", error_measure, ERROR_MEASURES)
    tokens, lengths = detect_head_tokens(model, [prompts] if isinstance(prompts, str) else list(prompts))
    detections = detection_patterns(tokens, lengths)
    per_prompt = {name: [] for name in names}  # name -> chunks of (batch, layer, head)
    with executing(progress=progress):
        for rows, cache in pattern_chunks(model, tokens, memory_mb, "detect heads"):
            patterns = [cache[name] for name in pattern_names(model)]
            for name in names:
                scores = [similarity(pattern, detections[name][rows], lengths[rows], exclude_bos=exclude_bos,
                                     exclude_current_token=exclude_current_token, error_measure=error_measure)
                          for pattern in patterns]
                per_prompt[name].append(torch.stack(scores, dim=1))
    return {name: torch.cat(chunks).mean(0).cpu() for name, chunks in per_prompt.items()}
