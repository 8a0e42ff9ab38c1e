"""IOI head classes (analyses.circuits.ioi_classes): positions found from the tokens, every criterion
against a hand-written computation (the Hugging Face model's own attentions and weights, or
hand-written hooks on GPTModel), and the classification rule on synthetic criteria."""

import re

import pandas as pd
import pytest
import torch

from analyses.circuits.ioi_classes import (ATTENTION_MIN, CLASS_RULES, CRITERIA_COLUMNS, DLA_MIN, UNCLASSIFIED,
                                        classify_ioi, ioi_classes, ioi_classes_figure, ioi_positions)
from analyses.tasks.task import Task, ioi_task, task_batch
from interp import UserError
from interp.convert import from_hf
from interp.random_models import random_hf_model

MOVERS = [(2, 1), (2, 3), (1, 3)]  # given, so every criterion is measured on a random model
S_INHIBITION = [(1, 0), (2, 2)]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def hf():
    """A 3-layer random GPT-2 (byte tokenizer) with weights of std 0.3, so attention is far from uniform,
    and random LayerNorm weights and biases (initialised to 1 and 0, they would hide a norm left out)."""
    model, tokenizer = random_hf_model("gpt2", seed=5, n_ctx=128, d_vocab=257, n_layer=3, n_embd=64, n_head=4,
                                       initializer_range=0.3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return model, tokenizer


@pytest.fixture(scope="module")
def model(hf):
    return from_hf(*hf)


@pytest.fixture(scope="module")
def task(model):
    return ioi_task(model, n=10, seed=0)


@pytest.fixture(scope="module")
def result(model, task):
    return ioi_classes(model, task, movers=MOVERS, s_inhibition=S_INHIBITION, n_boot=200)


@pytest.fixture(scope="module")
def batch(model, task):
    return task_batch(model, task)


def criterion(result, name: str) -> torch.Tensor:
    """A criterion's values as a (layer, head) grid."""
    rows = result.criteria[result.criteria["criterion"] == name]
    return torch.tensor(rows.pivot(index="layer", columns="head", values="value").to_numpy(), dtype=torch.float32)


def word_positions(text: str, word: str, offset: int) -> list[int]:
    """Token positions of ``word`` as a whole word in ``text``, for a byte tokenizer (one token per
    byte) whose prompts start ``offset`` tokens in."""
    return [offset + match.start() for match in re.finditer(rf"(?<![A-Za-z]){word}(?![A-Za-z])", text)]


def test_positions_are_the_names_in_the_text(model, task, batch):
    at = ioi_positions(task, batch)
    tokenizer = model.tokenizer
    assert "single capital letters" in task.note and at.kept.all()
    for i, text in enumerate(task.clean):
        offset = int(batch.last[i]) + 1 - len(text.encode())  # the start token, where the model puts one
        io, s = (tokenizer.decode([ids[0]]) for ids in (task.answers[i], task.distractors[i]))
        assert word_positions(text, io, offset) == [int(at.io[i])]
        assert word_positions(text, s, offset) == [int(at.s1[i]), int(at.s2[i])]
        assert int(at.end[i]) == int(batch.last[i]) == offset + len(text) - 1


@pytest.fixture(scope="module")
def both_orders(model):
    """20 prompts (one pass of the 15 templates in ABBA order, then 5 in BABA), as the prompts kept
    (a letter name that also starts a word of the template is left out), and their classes."""
    task = ioi_task(model, n=20, seed=1)
    kept = ioi_positions(task, task_batch(model, task)).kept.nonzero()[:, 0].tolist()
    return task.subset(kept), ioi_classes(model, task, movers=MOVERS, s_inhibition=S_INHIBITION, n_boot=200)


def test_order_is_abba_where_the_indirect_object_is_named_first(model, both_orders):
    task, result = both_orders
    tokenizer = model.tokenizer
    expected = []
    for text, (io,), (s,) in zip(task.clean, task.answers, task.distractors):
        first_io, first_s = (word_positions(text, tokenizer.decode([i]), 0)[0] for i in (io, s))
        expected.append("ABBA" if first_io < first_s else "BABA")
    assert result.order.tolist() == expected and {"ABBA", "BABA"} <= set(expected)


def test_criteria_on_some_prompts_equal_a_run_on_those_prompts_alone(model, both_orders):
    """``on`` re-aggregates the per-prompt values; a run on the subset measures them again from scratch
    (dla by ``dla_effects`` there, by the per-prompt attribution here). Two differ by design: the
    subset's own run takes ``backup_rise``'s ABC means and ``ov_copy``'s other names from the subset."""
    task, result = both_orders
    rows = [i for i, order in enumerate(result.order) if order == "BABA"]
    alone = ioi_classes(model, task.subset(rows), movers=MOVERS, s_inhibition=S_INHIBITION, n_boot=200)
    kept = lambda frame: frame[~frame["criterion"].isin(["backup_rise", "ov_copy"])].reset_index(drop=True)
    ours = result.on(result.order == "BABA", n_boot=200)
    pd.testing.assert_frame_equal(kept(ours.criteria), kept(alone.criteria), atol=TOLERANCE, rtol=TOLERANCE)
    assert (ours.order == "BABA").all() and (ours.criteria["n_prompts"] == len(rows)).all()
    with pytest.raises(UserError, match="rows"):
        result.on([], n_boot=10)


def test_prompts_whose_names_are_ambiguous_are_left_out(model, task):
    """"When W and ..." with W a name: the letter is also the first of "When", so IO is not once."""
    ambiguous = "When W and N went to the store, N gave a drink to "
    w, n = (model.tokenizer.encode(letter)[0] for letter in "WN")
    mixed = Task("ioi", (ambiguous, task.clean[0]), ("When B and C went to the store, D gave a drink to ", task.corrupted[0]),
                 ((w,), task.answers[0]), ((n,), task.distractors[0]), templates=(0, task.templates[0]))
    at = ioi_positions(mixed, task_batch(model, mixed))
    assert at.kept.tolist() == [False, True]
    only = mixed.subset([0])
    with pytest.raises(UserError, match="no prompt has its IO name once"):
        ioi_classes(model, only, n_boot=10)
    with pytest.raises(UserError, match="one answer id"):
        ioi_positions(Task("ioi", task.clean[:1], task.corrupted[:1], ((1, 2),), task.distractors[:1]),
                      task_batch(model, task.take(1)))


def test_attention_criteria_equal_the_hugging_face_attentions(hf, task, batch, result):
    at = ioi_positions(task, batch)
    with torch.no_grad():
        attentions = torch.stack(hf[0](batch.clean, output_attentions=True).attentions)  # (layer, batch, head, q, k)
    rows = torch.arange(len(task))
    read = lambda q, k: attentions.movedim(1, 0)[rows, :, :, q, k].mean(0)  # (layer, head): the mean over prompts
    expected = {"attn_end_io": read(at.end, at.io), "attn_end_s1": read(at.end, at.s1), "attn_end_s2": read(at.end, at.s2),
                "attn_s2_s1": read(at.s2, at.s1), "attn_s2_s1_next": read(at.s2, at.s1 + 1),
                "attn_io_minus_s": read(at.end, at.io) - read(at.end, at.s1) - read(at.end, at.s2)}
    for name, value in expected.items():
        torch.testing.assert_close(criterion(result, name), value, atol=TOLERANCE, rtol=0, msg=name)
    assert expected["attn_end_io"].std() > 0.02  # the heads differ: not a vacuous comparison


def test_ov_copy_is_the_explicit_ov_matmul_of_the_name_after_block_0(hf, task, batch, result):
    """Hugging Face's own weights: ln_1, c_attn's value columns, c_proj's rows, ln_f, the tied unembedding."""
    model = hf[0]
    at = ioi_positions(task, batch)
    names = sorted({ids[0] for ids in (*task.answers, *task.distractors)})
    d_model, n_heads = model.config.n_embd, model.config.n_head
    d_head = d_model // n_heads
    with torch.no_grad():
        after_block_0 = model(batch.clean, output_hidden_states=True).hidden_states[1]
        x = after_block_0[torch.arange(len(task)), at.io]  # (batch, d_model)
        ln_f, W_U = model.transformer.ln_f, model.lm_head.weight
        grid = torch.zeros(3, n_heads)
        for layer, block in enumerate(model.transformer.h):
            normed = block.ln_1(x)
            for head in range(n_heads):
                columns = slice(2 * d_model + head * d_head, 2 * d_model + (head + 1) * d_head)
                value = normed @ block.attn.c_attn.weight[:, columns] + block.attn.c_attn.bias[columns]
                out = value @ block.attn.c_proj.weight[head * d_head:(head + 1) * d_head]
                logits = (ln_f(out) - ln_f(torch.zeros(d_model))) @ W_U.T
                scores = []
                for b, (io,) in enumerate(task.answers):
                    others = [logits[b, t] for t in names if t != io]
                    scores.append(logits[b, io] - sum(others) / len(others))
                grid[layer, head] = torch.stack(scores).mean()
    torch.testing.assert_close(criterion(result, "ov_copy"), grid, atol=TOLERANCE, rtol=TOLERANCE)
    assert grid.abs().max() > 0.1


def hf_dla(hf_model, tokens: torch.Tensor, task, last: torch.Tensor, z_edit=None) -> torch.Tensor:
    """Each head's DLA onto logit(IO) - logit(S) per prompt (batch, layer, head), by hand from Hugging
    Face's hooks: each head's z (c_proj's input) through its c_proj rows, centred and divided by the
    final residual's LayerNorm scale, dotted with ln_f's weight times W_U[IO] - W_U[S]. ``z_edit``:
    {layer: function(z) -> z} applied to c_proj's input (an ablation)."""
    seen, handles = {}, []
    blocks = hf_model.transformer.h
    for layer, block in enumerate(blocks):
        def keep(module, args, layer=layer):
            z = args[0] if z_edit is None or layer not in z_edit else z_edit[layer](args[0])
            seen[layer] = z
            return (z,)
        handles.append(block.attn.c_proj.register_forward_pre_hook(keep))
    handles.append(hf_model.transformer.ln_f.register_forward_pre_hook(lambda m, args: seen.__setitem__("final", args[0])))
    try:
        with torch.no_grad():
            hf_model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    rows = torch.arange(len(tokens))
    ln_f, W_U = hf_model.transformer.ln_f, hf_model.lm_head.weight
    final = seen["final"][rows, last]
    scale = (final.var(-1, unbiased=False) + ln_f.eps).sqrt()  # (batch,)
    direction = ln_f.weight * (W_U[[a[0] for a in task.answers]] - W_U[[d[0] for d in task.distractors]])
    d_model, n_heads = hf_model.config.n_embd, hf_model.config.n_head
    d_head = d_model // n_heads
    out = torch.zeros(len(tokens), len(blocks), n_heads)
    for layer, block in enumerate(blocks):
        for head in range(n_heads):
            span = slice(head * d_head, (head + 1) * d_head)
            write = seen[layer][rows, last][:, span] @ block.attn.c_proj.weight[span]
            write = write - write.mean(-1, keepdim=True)
            out[:, layer, head] = (write * direction).sum(-1) / scale
    return out


def test_dla_is_the_hand_written_direct_logit_attribution(hf, task, batch, result):
    expected = hf_dla(hf[0], batch.clean, task, batch.last)
    torch.testing.assert_close(criterion(result, "dla"), expected.mean(0), atol=TOLERANCE, rtol=TOLERANCE)
    assert expected.mean(0).abs().max() > 0.1


def preference(pattern: torch.Tensor, at, heads) -> torch.Tensor:
    """pattern (batch, head, q, k) -> (batch, len(heads)): END->IO - END->S1 - END->S2."""
    rows = torch.arange(len(pattern))
    read = lambda key: pattern[rows][:, heads][rows, :, at.end, key]
    return read(at.io) - read(at.s1) - read(at.s2)


def head_write(model, z_from: dict, z_to: dict, sender) -> torch.Tensor:
    layer, head = sender
    return (z_to[layer][:, :, head] - z_from[layer][:, :, head]) @ model.W_O[layer, head].detach()


def z_caches(model, batch) -> tuple[dict, dict]:
    names = [f"blocks.{layer}.attn.hook_z" for layer in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, clean = model.run_with_cache(batch.clean, names_filter=names)
        _, corrupted = model.run_with_cache(batch.corrupted, names_filter=names)
    return ({l: clean[n] for l, n in enumerate(names)}, {l: corrupted[n] for l, n in enumerate(names)})


def test_s_inhibition_is_the_query_path_patch_of_the_movers_attention(model, task, batch, result):
    """By hand: the sender's ABC-minus-clean write added to each head's own query input
    (``hook_q_input``) of a mover's layer in a clean run, the movers' IO-minus-S attention read."""
    at = ioi_positions(task, batch)
    clean_z, corrupted_z = z_caches(model, batch)
    expected = torch.full((3, 4), float("nan"))
    model.set_use_split_qkv_input(True)
    try:
        with torch.no_grad():
            base = {}
            for layer in (1, 2):
                _, cache = model.run_with_cache(batch.clean, names_filter=[f"blocks.{layer}.attn.hook_pattern"])
                base[layer] = cache[f"blocks.{layer}.attn.hook_pattern"]
            for sender in [(l, h) for l in (0, 1) for h in range(4)]:
                changes = []
                write = head_write(model, clean_z, corrupted_z, sender)
                for layer, head in MOVERS:
                    if layer <= sender[0]:
                        continue
                    add = lambda q, hook, write=write: q + write[:, :, None]
                    pattern = _patterns_with(model, batch.clean, layer, add)
                    changes.append(preference(pattern, at, [head]) - preference(base[layer], at, [head]))
                expected[sender] = torch.cat(changes, dim=1).mean(1).mean(0)
    finally:
        model.set_use_split_qkv_input(False)
    measured = criterion(result, "s_inhibition")
    torch.testing.assert_close(measured[:2], expected[:2], atol=TOLERANCE, rtol=TOLERANCE)
    assert measured[2].isnan().all()  # no mover after layer 2
    assert expected[:2].abs().max() > 1e-3


def _patterns_with(model, tokens, layer: int, hook) -> torch.Tensor:
    """Layer ``layer``'s pattern (batch, head, q, k) of a run with ``hook`` on its ``hook_q_input``."""
    kept = {}
    with model.hooks(fwd_hooks=[(f"blocks.{layer}.hook_q_input", hook),
                                (f"blocks.{layer}.attn.hook_pattern", lambda p, hook: kept.setdefault("p", p))]):
        model(tokens)
    return kept["p"]


def logit_diffs(logits: torch.Tensor, task, last: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(len(last))
    final = logits[rows, last]
    return final[rows, [a[0] for a in task.answers]] - final[rows, [d[0] for d in task.distractors]]


def test_v_path_is_the_value_path_patch_into_every_s_inhibition_head(model, task, batch, result):
    """By hand, two passes: (1) per receiver layer, a clean run with the sender's ABC-minus-clean write
    added to the receivers' own value inputs (``hook_v_input``), their z kept; (2) a clean run with every
    receiver's z replaced by it; the change of the logit difference."""
    clean_z, corrupted_z = z_caches(model, batch)
    with torch.no_grad():
        clean = logit_diffs(model(batch.clean), task, batch.last)
        expected = torch.full((3, 4), float("nan"))
        for sender in [(l, h) for l in (0, 1) for h in range(4)]:
            write = head_write(model, clean_z, corrupted_z, sender)
            moved = {}
            model.set_use_split_qkv_input(True)
            try:
                for layer, head in S_INHIBITION:
                    if layer <= sender[0]:
                        continue
                    def add(v, hook, head=head):
                        v = v.clone()
                        v[:, :, head] += write
                        return v
                    kept = {}
                    with model.hooks(fwd_hooks=[(f"blocks.{layer}.hook_v_input", add),
                                                (f"blocks.{layer}.attn.hook_z", lambda z, hook: kept.setdefault("z", z))]):
                        model(batch.clean)
                    moved[layer, head] = kept["z"][:, :, head]
            finally:
                model.set_use_split_qkv_input(False)

            def replace(z, hook):
                layer = int(hook.name.split(".")[1])
                z = z.clone()
                for (l, h), value in moved.items():
                    if l == layer:
                        z[:, :, h] = value
                return z
            hooks = [(f"blocks.{l}.attn.hook_z", replace) for l in {l for l, _ in moved}]
            with model.hooks(fwd_hooks=hooks):
                expected[sender] = (logit_diffs(model(batch.clean), task, batch.last) - clean).mean()
    measured = criterion(result, "v_path")
    torch.testing.assert_close(measured[:2], expected[:2], atol=TOLERANCE, rtol=TOLERANCE)
    assert measured[2].isnan().all() and expected[:2].abs().max() > 1e-3


def test_backup_rise_is_the_dla_change_under_abc_mean_ablation_of_the_movers(hf, model, task, batch, result):
    """By hand: each mover's z (c_proj's input) replaced by the mean over the corrupted prompts of
    its template, position by position; each head's hand-written DLA in that run minus in the clean one."""
    d_head = hf[0].config.n_embd // hf[0].config.n_head
    _, corrupted_z = z_caches(model, batch)
    templates = torch.tensor(task.templates)
    means = {}
    for layer, head in MOVERS:
        z = corrupted_z[layer][:, :, head]
        means[layer, head] = torch.stack([z[templates == t].mean(0) for t in task.templates])

    def ablate(layer):
        def edit(z):
            z = z.clone()
            for (l, h), mean in means.items():
                if l == layer:
                    z[:, :, h * d_head:(h + 1) * d_head] = mean
            return z
        return edit

    edits = {layer: ablate(layer) for layer, _ in MOVERS}
    rise = (hf_dla(hf[0], batch.clean, task, batch.last, edits) - hf_dla(hf[0], batch.clean, task, batch.last)).mean(0)
    for mover in MOVERS:
        rise[mover] = float("nan")
    torch.testing.assert_close(criterion(result, "backup_rise"), rise, atol=TOLERANCE, rtol=TOLERANCE, equal_nan=True)
    assert rise.nan_to_num().abs().max() > 1e-3


def test_frames_are_tidy_with_intervals_and_the_figure_draws(result, task):
    frame = result.criteria
    assert list(frame.columns) == CRITERIA_COLUMNS and (frame["n_prompts"] == len(task)).all()
    measured = frame.dropna(subset=["value"])
    assert (measured["ci_low"] <= measured["value"] + 1e-9).all() and (measured["value"] <= measured["ci_high"] + 1e-9).all()
    assert result.movers == MOVERS and result.movers_are == "given" and result.left_out == 0
    assert set(result.classes.columns) == {"layer", "head", "class", "evidence"}
    assert len(result.classes.drop_duplicates(["layer", "head"])) == 12
    ioi_classes_figure(result.classes)


def synthetic(rows: dict) -> pd.DataFrame:
    """{(layer, head, criterion): (value, ci_low, ci_high)} -> a criteria frame."""
    return pd.DataFrame([(l, h, c, v, lo, hi, 20, "") for (l, h, c), (v, lo, hi) in rows.items()],
                        columns=CRITERIA_COLUMNS)


NAME_MOVER = {"attn_end_io": (0.5, 0.4, 0.6), "attn_io_minus_s": (0.3, 0.2, 0.4), "ov_copy": (2.0, 1.0, 3.0),
              "dla": (1.0, 0.5, 1.5)}


def test_a_class_needs_every_criterion_to_hold_with_its_interval():
    rows = {(0, 0, c): v for c, v in NAME_MOVER.items()}
    # head 1: its attention's interval crosses the threshold -> unclassified
    rows |= {(0, 1, c): v for c, v in NAME_MOVER.items()} | {(0, 1, "attn_end_io"): (0.3, ATTENTION_MIN - 0.01, 0.5)}
    # head 2: its DLA's interval contains DLA_MIN -> unclassified
    rows |= {(0, 2, c): v for c, v in NAME_MOVER.items()} | {(0, 2, "dla"): (0.5, DLA_MIN / 2, 0.9)}
    # head 3: copy suppression with a negative DLA -> a negative name mover
    rows |= {(0, 3, c): v for c, v in NAME_MOVER.items()} | {(0, 3, "ov_copy"): (-2.0, -3.0, -1.0),
                                                               (0, 3, "dla"): (-1.0, -1.5, -0.5)}
    # head 4: S-inhibition with a missing (NaN) interval elsewhere; head 5: a shift whose interval covers 0
    rows |= {(1, 0, "s_inhibition"): (-0.1, -0.15, -0.05), (1, 0, "backup_rise"): (float("nan"),) * 3,
             (1, 1, "s_inhibition"): (-0.1, -0.2, 0.01)}
    # head 6: a v path with both attentions -> duplicate-token and induction; head 7: the path only
    rows |= {(1, 2, "v_path"): (-0.5, -0.8, -0.2), (1, 2, "attn_s2_s1"): (0.4, 0.3, 0.5),
             (1, 2, "attn_s2_s1_next"): (0.4, 0.3, 0.5), (1, 3, "v_path"): (-0.5, -0.8, -0.2),
             (1, 3, "attn_s2_s1"): (0.05, 0.0, 0.08)}
    classes = classify_ioi(synthetic(rows))
    got = classes.groupby(["layer", "head"])["class"].apply(list).to_dict()
    assert got == {(0, 0): ["name mover"], (0, 1): [UNCLASSIFIED], (0, 2): [UNCLASSIFIED],
                   (0, 3): ["negative name mover"], (1, 0): ["s-inhibition"], (1, 1): [UNCLASSIFIED],
                   (1, 2): ["duplicate-token", "induction"], (1, 3): [UNCLASSIFIED]}
    evidence = classes.set_index(["layer", "head"]).loc[(0, 0), "evidence"]
    assert evidence == "attention: attn_end_io, attn_io_minus_s; weights: ov_copy; dla: dla"
    assert classes.set_index(["layer", "head"]).loc[(0, 1), "evidence"] == ""
    assert set(CLASS_RULES) == {"name mover", "negative name mover", "s-inhibition", "duplicate-token", "induction",
                                "backup name mover"}


def test_a_bridge_and_gptmodel_of_one_grouped_query_llama_give_the_same_criteria():
    """RMSNorm, rotary positions, 4 query heads over 2 key/value heads, no value bias: the two
    backends agree on every criterion."""
    from interp.bridge import boot_bridge

    hf_model, tokenizer = random_hf_model("llama", seed=7, n_ctx=128, num_hidden_layers=3, initializer_range=0.3)
    scratch, bridge = from_hf(hf_model, tokenizer), boot_bridge(hf_model, tokenizer)
    assert scratch.cfg.n_key_value_heads < scratch.cfg.n_heads
    task = ioi_task(scratch, n=6)
    ours, theirs = (ioi_classes(m, task, movers=MOVERS, s_inhibition=S_INHIBITION, n_boot=50).criteria
                    for m in (scratch, bridge))
    assert ours[["layer", "head", "criterion"]].equals(theirs[["layer", "head", "criterion"]])
    gap = (ours["value"] - theirs["value"]).abs()
    assert gap.max() < 1e-4 and ours["value"].isna().equals(theirs["value"].isna())
    assert ours.groupby("criterion")["value"].apply(lambda v: v.abs().max()).min() > 1e-4  # every criterion moves


def planted_name_mover(template: str, sign: float = 1.0):
    """(GPTModel, IOI task) of a 2-layer GPT-2 whose one live head, L0H0, is a name mover by
    construction: the names' embeddings live in dims 0-15 (d_head), the first name's position has a
    spike in dim 63 that every query of L0H0 attends to (a constant query, a key reading dim 63), and
    its OV circuit is ``sign`` times the identity on dims 0-15, so it copies (sign -1: suppresses) the
    name it attends to; every other
    head, MLP and bias writes nothing. The task: the template's ABBA prompts, whose IO is the first name."""
    hf_model, tokenizer = random_hf_model("gpt2", seed=1, n_ctx=128, d_vocab=257, n_layer=2, n_embd=64, n_head=4)
    names = "BCDEGHJKLMNPRS"
    task = ioi_task(from_hf(hf_model, tokenizer), n=16, names=tuple(names), templates=(template,))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            if not name.startswith(("transformer.ln_", "transformer.h.0.ln_", "transformer.h.1.ln_")) and ".ln_" not in name:
                parameter.zero_()
        wte, wpe = hf_model.transformer.wte.weight, hf_model.transformer.wpe.weight
        wte[:, 16:63] = 0.3 * torch.randn(wte.shape[0], 47, generator=generator)
        for letter in names:
            wte[tokenizer.encode(letter)[-1], :16] = 3 * torch.nn.functional.normalize(torch.randn(16, generator=generator), dim=0)
        batch = task_batch(from_hf(hf_model, tokenizer), task)
        at = ioi_positions(task, batch)
        first = int(at.io.min())  # ABBA: IO is the first name
        wpe[first, 63] = 10.0
        attn = hf_model.transformer.h[0].attn
        u = torch.nn.functional.normalize(torch.ones(16), dim=0)
        attn.c_attn.bias[:16] = 10 * u  # the query: a constant
        attn.c_attn.weight[63, 64:80] = u  # the key: the spike
        attn.c_attn.weight[:16, 128:144] = torch.eye(16)  # the value: the name's dims
        attn.c_proj.weight[:16, :16] = sign * torch.eye(16)  # the output: back onto them
    kept = [i for i in range(len(task)) if bool(at.kept[i]) and int(at.io[i]) == first]
    return from_hf(hf_model, tokenizer), task.subset(kept)


@pytest.mark.parametrize("sign, planted_class", [(1.0, "name mover"), (-1.0, "negative name mover")])
def test_a_planted_name_mover_is_the_one_head_classified(sign, planted_class):
    model, task = planted_name_mover("When [A] and [B] went to the store, [B] gave a drink to", sign)
    assert len(task) >= 5
    result = ioi_classes(model, task, n_boot=200)
    got = result.classes.set_index(["layer", "head"])["class"]
    assert got.loc[(0, 0)] == planted_class
    assert (got.drop(index=(0, 0)) == UNCLASSIFIED).all()
    planted = result.criteria[(result.criteria["layer"] == 0) & (result.criteria["head"] == 0)].set_index("criterion")
    assert planted.loc["attn_end_io", "value"] > 0.9 and sign * planted.loc["dla", "value"] > 1.0
    if sign > 0:
        assert result.movers == [(0, 0)] and result.movers_are == "name movers"
    else:  # no name mover, and no head of positive DLA to stand in: nothing downstream is measured
        assert result.movers == [] and len(result.notes) == 3
