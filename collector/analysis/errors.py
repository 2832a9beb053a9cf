"""The analysis' one error type (kept apart so every analysis module can raise it without importing the others)."""

from __future__ import annotations


class AnalyzerError(Exception):
    """A configuration or database problem, said in one sentence."""
