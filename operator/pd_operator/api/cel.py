"""Building CEL source text for the CRD's `x-kubernetes-validations` (rules and messages).

Pure string functions: a CEL string literal's quoting, a map literal, a concatenation and
the strings library's ``format``. Numbers enter a message through ``format``, never
``'...' + string(n)`` (see ``cel_format``).
"""

from __future__ import annotations

__all__ = ["cel_concat", "cel_format", "cel_map"]


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def cel_map(values: dict[str, str]) -> str:
    """A CEL map literal of strings."""
    return "{" + ", ".join(f"'{k}': '{v}'" for k, v in values.items()) + "}"


def cel_concat(*parts: str) -> str:
    """A CEL string concatenation: plain text parts become double-quoted literals, parts in
    `{...}` are CEL expressions (`{self.metadata.name}`)."""
    return " + ".join(part[1:-1] if part.startswith("{") and part.endswith("}")
                      else _literal(part) for part in parts)


def cel_format(template: str, *args: str) -> str:
    """``'<template>'.format([args...])`` of the CEL strings library (Kubernetes 1.29+).

    Numbers enter a message through ``format`` (``%d``), never ``'...' + string(n)``: the
    API server estimates the cost of every message expression when the CRD is created, and
    refuses the whole CRD when a concatenation with ``string(int)`` makes the estimate
    unbounded (seen on a v1.36 apiextensions-apiserver)."""
    return f"{_literal(template)}.format([{', '.join(args)}])"
