"""The affinity key of a request: the start of its prompt, for ``cache-aware`` routing.

Requests whose prompts share their first ``prefix`` characters (text) or token ids (token
prompts) get the same key, so they land on the same prefill and decode engines, whose
prefix caches then already hold that part of the KV. Shapes read (anything else: no key,
the policy balances by load):

- ``/v1/completions``: ``prompt`` as text, token ids, or a batch of either (its first);
- ``/v1/chat/completions``: ``messages``, each as its role and its text (a string, or the
  ``text`` of its content parts), in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["affinity_key"]


def affinity_key(body: Mapping[str, Any], prefix: int) -> str | None:
    """``"t:<ids>"`` or ``"s:<text>"`` of the first ``prefix`` tokens or characters."""
    if "messages" in body:
        text = _chat_text(body["messages"])
        return None if text is None else "s:" + text[:prefix]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str) and prompt:
        return "s:" + prompt[:prefix]
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt[:prefix]):
        return "t:" + ",".join(str(t) for t in prompt[:prefix])
    return None


def _chat_text(messages: object) -> str | None:
    if not isinstance(messages, list) or not messages:
        return None
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        parts.append(str(message.get("role", "")))
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(p["text"]) for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    # NUL separates role and text, so "ab" + "c" and "a" + "bc" differ.
    return "\x00".join(parts)
