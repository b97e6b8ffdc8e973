"""Turn PML role tags into a model's own chat markup.

The markup is derived from the tokenizer's chat template by rendering small
conversations whose contents are unique sentinels and reading off what the
template put around them. Templates are append-only for a growing
conversation (each turn's text is a prefix of the next rendering), which is
what lets one turn's wrapper be read as a difference of two renderings.

A tokenizer without a chat template, or one whose template cannot be read this
way, gets :data:`PLAIN`: ``"System: ...\\n\\n"``, ``"User: ...\\n\\n"``,
``"Assistant: ...\\n\\n"`` and the generation prompt ``"Assistant:"``.

A tool's result (the ``tool`` role, :mod:`pcache_rag.tools`) is the template's own ``tool``
turn where it renders one after an assistant turn; otherwise it is a user turn whose content
is wrapped in ``<tool_response>`` tags.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

_S = ("\u2063PCACHE-A\u2063", "\u2063PCACHE-B\u2063", "\u2063PCACHE-C\u2063", "\u2063PCACHE-D\u2063")
#: a tool's result where the template has no ``tool`` turn: inside a user turn
TOOL_OPEN, TOOL_CLOSE = "<tool_response>\n", "\n</tool_response>"


@dataclass(slots=True, frozen=True)
class ChatFormat:
    """Text placed around each role's content, and the generation prompt."""

    prefix: dict[str, str]  # role -> text before the content
    suffix: dict[str, str]  # role -> text after the content
    generation_prompt: str  # opens the assistant's turn before generating
    source: str = "template"  # "template" or "plain"

    def wrap(self, role: str, content: str, close: bool = True) -> str:
        return self.prefix[role] + content + (self.suffix[role] if close else "")


PLAIN = ChatFormat(
    prefix={"system": "System: ", "user": "User: ", "assistant": "Assistant: ", "tool": "Tool: "},
    suffix={"system": "\n\n", "user": "\n\n", "assistant": "\n\n", "tool": "\n\n"},
    generation_prompt="Assistant:",
    source="plain",
)


def _split(rendered: str, sentinel: str) -> tuple[str, str]:
    i = rendered.find(sentinel)
    if i < 0 or rendered.find(sentinel, i + 1) >= 0:
        raise ValueError("sentinel not found exactly once")
    return rendered[:i], rendered[i + len(sentinel) :]


def chat_format_for(tokenizer) -> ChatFormat:
    """Derive the :class:`ChatFormat` of ``tokenizer`` (or :data:`PLAIN`)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return PLAIN

    def render(msgs, gen=False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    a, b, c, d = _S
    try:
        r1 = render([{"role": "system", "content": a}])
        r2 = render([{"role": "system", "content": a}, {"role": "user", "content": b}])
        r3 = render(
            [{"role": "system", "content": a}, {"role": "user", "content": b}, {"role": "assistant", "content": c}]
        )
        r2g = render([{"role": "system", "content": a}, {"role": "user", "content": b}], gen=True)
        if not (r2.startswith(r1) and r3.startswith(r2) and r2g.startswith(r2)):
            raise ValueError("template is not append-only")
        sp, ss = _split(r1, a)
        up, us = _split(r2[len(r1) :], b)
        ap, as_ = _split(r3[len(r2) :], c)
        gen = r2g[len(r2) :]
        # Tokenizers add BOS themselves (we handle it in the layout); a template
        # that writes it too would double it.
        bos = getattr(tokenizer, "bos_token", None)
        if bos and sp.startswith(bos) and _adds_bos(tokenizer):
            sp = sp[len(bos) :]
        tp, ts = _tool_turn(render, r3, up + TOOL_OPEN, TOOL_CLOSE + us)
        return ChatFormat(
            prefix={"system": sp, "user": up, "assistant": ap, "tool": tp},
            suffix={"system": ss, "user": us, "assistant": as_, "tool": ts},
            generation_prompt=gen or ap,
        )
    except Exception as e:  # noqa: BLE001 - any template failure means: fall back
        log.warning("chat template could not be read (%s); using the plain role format", e)
        return PLAIN


def _tool_turn(render, r3: str, user_prefix: str, user_suffix: str) -> tuple[str, str]:
    """The template's ``tool`` turn after an assistant turn, or a user turn around ``<tool_response>``
    (a template that refuses the role, drops its content or is not append-only with it)."""
    a, b, c, d = _S
    try:
        r4 = render([{"role": "system", "content": a}, {"role": "user", "content": b},
                     {"role": "assistant", "content": c}, {"role": "tool", "content": d, "tool_call_id": "call_0"}])
        if r4.startswith(r3):
            return _split(r4[len(r3):], d)
    except Exception:  # noqa: BLE001 - templates raise for roles they do not know: the user-turn form
        pass
    return user_prefix, user_suffix


def _adds_bos(tokenizer) -> bool:
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos_id
