"""The RAG prompt contract, in one place: what the model reads around the documents.

``preamble`` (the system prompt and the opening of the user turn, see
:func:`pcache_rag.docmodules.preamble_ids`) + each chunk as :func:`chunk_text` (a ``[file name]``
header, then its text) + the question as :func:`question_ids`. The pipeline, the connectors
and the quality eval all build prompts from these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine import ContextOverflowError, PromptCache
from ..docmodules import DOC_SEPARATOR, DOCUMENTS_HEADER, format_documents

#: what precedes the question after the documents
QUESTION_PREFIX = "Question: "

# Room kept per chunk for its file-name header, and for the question and the answer.
HEADER_ALLOWANCE = 32
QUESTION_ALLOWANCE = 128


def chunk_text(text: str, source: str | None = None) -> str:
    """A chunk as the model reads it: a ``[file name]`` header line, then its text. Framework
    retrievers return this text, so marked documents hit the states encoded at ingest."""
    return f"[{Path(source or '').name}]\n{text}"


def question_ids(pc: PromptCache, question: str, template: str | None = None) -> list[int]:
    """The question after the documents, closing the user turn and opening the assistant's.
    ``template``: other text around ``{question}`` in place of ``"Question: "`` (a framework's
    own prompt, as ``eval quality --question-template`` measures). The question is text:
    control-token strings in it stay characters."""
    chat = pc.chat
    text = QUESTION_PREFIX + question if template is None else template.replace("{question}", question)
    return pc.safe.segments([(text, False), (chat.suffix["user"], True), (chat.generation_prompt, True)])


def user_turn(chunk_texts: list[str], question: str) -> str:
    """The user turn of a RAG prompt as message text, for a prompt built from chat messages (a
    conversation on the RAG model): the same words the preamble's end, the chunks and
    :func:`question_ids` give, with the chunks marked so their cached states are read."""
    return DOCUMENTS_HEADER + format_documents(chunk_texts) + DOC_SEPARATOR + QUESTION_PREFIX + question


def check_fits(preamble_tokens: int, k: int, chunk_tokens: int, max_positions: int) -> None:
    """Refuse ``k`` chunks of ``chunk_tokens`` that cannot fit ``max_positions`` with a question."""
    need = preamble_tokens + k * (chunk_tokens + HEADER_ALLOWANCE) + QUESTION_ALLOWANCE
    if need > max_positions:
        fit = (max_positions - preamble_tokens - QUESTION_ALLOWANCE) // k - HEADER_ALLOWANCE
        raise ValueError(
            f"k={k} chunks of up to {chunk_tokens} tokens need about {need} positions with the "
            f"question, but the model takes {max_positions}: use chunk_tokens <= {max(fit, 0)} "
            f"or a smaller k"
        )


def fit_question(rag: Any, question: str, handles: list, max_new_tokens: int) -> list[int]:
    """The question's ids for a prompt of ``rag``'s preamble and ``handles``' chunks, or
    :class:`~pcache_rag.engine.ContextOverflowError` if that prompt and ``max_new_tokens`` cannot
    fit the model."""
    q = rag.question_ids(question)
    ctx = len(rag.preamble_ids) + sum(h.n_tokens or len(rag.chunks.ids(h.text, h.source)) for h in handles)
    need = ctx + len(q) + int(max_new_tokens)
    if need > rag.asm.max_positions:
        raise ContextOverflowError(
            f"the question is {len(q)} tokens; with {len(handles)} chunks ({ctx} tokens) and "
            f"{max_new_tokens} new tokens the prompt needs {need} positions, but the model "
            f"takes {rag.asm.max_positions}: shorten the question or retrieve fewer chunks"
        )
    return q
