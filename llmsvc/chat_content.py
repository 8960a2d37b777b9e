"""OpenAI's chat content parts as the one string a chat template and llmsvc.v1's ChatMessage take,
shared by the offline LLM.chat and the Python client (dependency-free, as the client is)."""
from __future__ import annotations


def joined_text(content) -> str:
    """`content` as a string: a string as it is, None as "", and a list of OpenAI content parts
    ([{"type": "text", "text": ...}, ...]) as its texts joined by newlines (vLLM's "string"
    content format). Only text parts are supported: anything else is a ValueError naming it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"chat content must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"chat content parts must be text parts ({{'type': 'text', 'text': ...}}), got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)
