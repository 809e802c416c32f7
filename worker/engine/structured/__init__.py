"""Structured outputs: grammars (JSON schema, regex, choice, EBNF) that constrain a request's tokens."""

from ferry.worker.engine.structured.manager import GrammarState, StructuredOutputManager, apply_grammars
from ferry.worker.engine.structured.params import (
    InvalidStructuredOutputError,
    SchemaTooComplexError,
    StructuredOutputs,
)

__all__ = [
    "GrammarState", "InvalidStructuredOutputError", "SchemaTooComplexError", "StructuredOutputManager",
    "StructuredOutputs", "apply_grammars",
]
