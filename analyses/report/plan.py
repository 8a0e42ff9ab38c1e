"""A page's plan (DESIGN 2.1): which of its parts the model can run, known before the first sweep.

Each optional part of a page (the report's circuit, a task's path patching, direct logit
attribution) names what its steps need of the model (``analyses.core.hook_check.NEEDS``: an edit
reaching the output, each head's write being z @ W_O); ``analyses.core.hook_check.left_out`` asks
the hook self-test, once, before any sweep. A part the model cannot run is left out, and the page,
report.md and meta.json (``left_out``: part -> reason) say which and why, in the very line its step
would have refused with (``HookCheck.refusal``), instead of the command stopping half-way with
nothing written.
"""

from __future__ import annotations

from analyses.core.hook_check import HEAD_CONTRIBUTIONS
from analyses.report.page import Section

# direct logit attribution splits each layer's attention output into its heads' z @ W_O, through
# the norm on it frozen where a block has one (``analyses.components.decompose``); its own check (the
# parts adding up to the final residual) refuses a model whose heads write otherwise, but only after
# the forward
DLA_NEEDS = (HEAD_CONTRIBUTIONS,)
DLA = "direct logit attribution"


def left_out_section(left: dict[str, str]) -> list[Section]:
    """The page's section naming each part left out (``left``: part -> the one-line reason), or
    none where every part ran."""
    if not left:
        return []
    lines = [f"- **{part}**: {reason}" for part, reason in left.items()]
    return [Section("Left out", "The hook self-test (`interp check`), run before any sweep, found that this model "
                    "cannot run these parts, so they were left out; every other part ran.\n\n" + "\n".join(lines))]
