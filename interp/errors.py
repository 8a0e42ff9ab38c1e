"""The one exception type for user mistakes (architecture §5).

Bad input (an empty text, a layer out of range, a malformed study spec, a checkpoint with missing
tensors, an intervention the model's hooks cannot carry out...) raises ``UserError`` with a one-line
message naming the bad value and what is allowed. The CLI prints exactly these as one line; any
other exception is a bug and keeps its traceback. ``UserError`` subclasses ``ValueError`` so code
that already catches ``ValueError`` keeps working.
"""


class UserError(ValueError):
    """A user mistake, reported in one line."""


def first_line(error: Exception) -> str:
    """The first line of another library's error (its type's name where it has no text): what a
    ``UserError`` quotes of it, so the message stays one line."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
