"""The budget a structured_outputs spec must keep, and the errors a refused spec raises.

Every bound is here, declared once, so that no spec takes long to check or to compile: the
characters of a spec, the subschemas and properties of a JSON schema, its counts (`maxLength`,
`maxItems`, ...), the characters a regex spells out unrolled, the number of choices. A spec past
one is refused with `SpecTooComplexError` (the wire's `schema_too_complex`); any other refusal is
a `SpecError` (`invalid_structured_output`).
"""

from __future__ import annotations

MAX_CHOICES = 256
MAX_SPEC_CHARS = 64 << 10
MAX_SCHEMA_NODES = 2048
MAX_PROPERTIES = 256
MAX_COUNT = 100_000
MAX_REGEX_SIZE = 1000

# The wire's error codes for a refused spec (worker.protocol.jobs.ErrorCode, which imports this package).
INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"
SCHEMA_TOO_COMPLEX = "schema_too_complex"


class SpecError(ValueError):
    """Why a structured_outputs spec is refused; `code` is the wire's error code for it."""

    code = INVALID_STRUCTURED_OUTPUT


class SpecTooComplexError(SpecError):
    """A spec beyond the budget: too big to check or to compile in reasonable time."""

    code = SCHEMA_TOO_COMPLEX


def too_big(what: str, limit: int) -> SpecTooComplexError:
    """The refusal of a spec past one bound (`limit`) of the budget; `what` says which and by how much."""
    return SpecTooComplexError(f"{what} (at most {limit}): the grammar would take too long to compile")
