"""The chat rule: how a list of chat messages becomes the one prompt a seq2seq model reads.

An instruction-tuned T5 (flan-t5) was trained on single instructions, not on a chat template, and
its tokenizer carries none. The rule is therefore plain text, chosen so that the common case is
exactly what flan-t5 was trained on:

1. The contents of `system` (and `developer`) messages come first, in order, each its own
   paragraph.
2. A conversation of one `user` message is that message's content, as is.
3. Any other conversation is a transcript: one line per message, `User: <content>` or
   `Assistant: <content>`, then a last line `Assistant:` for the model to answer.
4. The paragraphs are joined by a blank line ("\\n\\n").

So `[{"role": "user", "content": "Translate to German: Hello"}]` is the prompt `Translate to
German: Hello`, and a system message "Answer briefly." before it makes `Answer briefly.\\n\\n
Translate to German: Hello`. A content given as a list of parts takes its text parts joined by
"\\n"; other parts (images, audio), other roles (`tool`, `function`) and empty conversations are
refused, naming the message.
"""

from __future__ import annotations

from typing import Any

from ..io.limits import short_repr
from .errors import APIError

_SYSTEM_ROLES = ("system", "developer")
_SPEAKERS = {"user": "User", "assistant": "Assistant"}


def chat_prompt(messages: Any) -> str:
    """OpenAI chat `messages` -> one prompt, by the rule above (APIError 400 naming what is wrong)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects",
                       param="messages")
    system: list[str] = []
    turns: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{where} must be an object with role and content", param=where)
        role = message.get("role")
        if role not in _SYSTEM_ROLES and role not in _SPEAKERS:
            raise APIError(400, f"{where}.role {role!r:.40} is not supported (system, developer, "
                           "user or assistant)", param=f"{where}.role")
        text = _content(message.get("content"), f"{where}.content")
        if role in _SYSTEM_ROLES:
            system.append(text)
        else:
            turns.append((role, text))
    if not any(role == "user" for role, _ in turns):
        raise APIError(400, "messages hold no user message", param="messages")
    if len(turns) == 1:
        body = turns[0][1]
    else:
        body = "\n".join([f"{_SPEAKERS[role]}: {text}" for role, text in turns] + ["Assistant:"])
    return "\n\n".join(system + [body])


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or the text parts of a list joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"{where}[{j}]: only text parts are supported, got "
                               f"{kind!r:.40}", param=f"{where}[{j}]")
            text = part.get("text")
            if not isinstance(text, str):   # a text part, but without its text
                said = "is missing" if text is None else f"must be a string, got {short_repr(text)}"
                raise APIError(400, f"{where}[{j}].text {said}", param=f"{where}[{j}].text")
            texts.append(text)
        return "\n".join(texts)
    raise APIError(400, f"{where} must be a string or a non-empty list of text parts",
                   param=where)
