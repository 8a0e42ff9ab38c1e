"""The one exception type for user mistakes (DESIGN 5).

Bad input (an empty text, a layer out of range, a malformed study spec, a checkpoint with missing
tensors, an intervention the model's hooks cannot carry out...) raises ``UserError`` with a one-line
message naming the bad value and what is allowed. The CLI prints exactly these as one line; any
other exception is a bug and keeps its traceback. ``UserError`` subclasses ``ValueError`` so code
that already catches ``ValueError`` keeps working.
"""


class UserError(ValueError):
    """A user mistake, reported in one line."""
