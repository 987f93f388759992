"""Shared helpers for the tests."""

from __future__ import annotations

from spec.guardtable import run_check as checked  # noqa: F401  (cached model checks)
