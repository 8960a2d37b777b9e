"""The `developer` role for chat templates that do not know it (torch-free).

OpenAI's newer clients send system instructions as `developer`. A template that never names
that role would render it as an unknown turn (or refuse it), so, as vLLM does, developer
messages become system messages, and the system messages then merge into one at the start
(several templates accept a system message only there). A template that names `developer`
gets the messages as they are.
"""
from __future__ import annotations


def template_knows_developer(template) -> bool:
    """Whether the template (text, or a tokenizer's dict of named templates) names the role."""
    text = str(template or "")
    return '"developer"' in text or "'developer'" in text


def developer_as_system(messages: list[dict], template: str | None) -> list[dict]:
    """`messages` (template-ready dicts) with developer turns made system turns and every
    system turn merged into the first message (contents joined by a blank line), unless there
    is no developer turn or the template names the role."""
    if not any(m.get("role") == "developer" for m in messages) or template_knows_developer(template):
        return messages
    converted = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if systems == [0]:
        return converted
    texts = [t for t in (_text(converted[i].get("content")) for i in systems) if t]
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in converted if m["role"] != "system")]


def _text(content) -> str:
    """A message's content as text: a string, or its text parts joined by newlines."""
    if isinstance(content, list):
        return "\n".join(p["text"] if isinstance(p, dict) else str(p)
                         for p in content if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
    return content or ""
