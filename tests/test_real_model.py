"""Smoke test on the embedded SmolLM2-135M-Instruct: cached answers agree with full prefill."""

import pytest
import torch

from pcache_rag.pml import escape

pytestmark = pytest.mark.real_model

DOCS = {
    "paris": "Paris is the capital and largest city of France. It lies on the river Seine.",
    "tokyo": "Tokyo is the capital of Japan and the most populous metropolitan area in the world.",
    "nile": "The Nile is a major river in northeastern Africa. It flows north into the Mediterranean Sea.",
}
QUESTIONS = [
    ("paris", "What river does Paris lie on?"),
    ("tokyo", "Which country is Tokyo the capital of?"),
    ("nile", "Into which sea does the Nile flow?"),
]


def test_cached_and_full_prefill_greedy_answers_agree(smol):
    mods = "".join(f'<module name="{k}">{escape(v)}</module>' for k, v in DOCS.items())
    smol.add_schema(f'<schema name="facts"><system>Answer in one short sentence.</system><union>{mods}</union></schema>')
    for doc, q in QUESTIONS:
        prompt = f'<prompt schema="facts"><{doc}/><user>{escape(q)}</user></prompt>'
        cached = smol.generate(prompt, max_new_tokens=16)
        res = smol.prefill(prompt)
        with torch.no_grad():
            ids = res.input_ids[None]
            full = smol.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        full_text = smol.tokenizer.decode(full[0, ids.shape[1]:], skip_special_tokens=True)
        assert cached.cached_tokens > 0 and cached.computed_tokens < 40
        # A single document after the preamble: the answers should be the same sentence.
        assert cached.text.strip()[:30] == full_text.strip()[:30], (q, cached.text, full_text)
