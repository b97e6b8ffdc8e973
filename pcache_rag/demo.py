"""The main job: answer questions over a sample corpus, cached vs full prefill.

The corpus is built at run time from the plain-text documentation of Python
standard-library modules on this machine. Each page (cut to ~450 tokens)
becomes a document module in a union-free schema with a system preamble; each
question imports the pages it is about. Every answer is printed with its
time-to-first-token from the cache and from a full prefill of the same tokens
in the same process.
"""

from __future__ import annotations

import time

from .bench import stdlib_docs
from .pml import escape

QUESTIONS = [
    (("json",), "Which function of the json module reads JSON from a file object?"),
    (("textwrap",), "What does textwrap.dedent do?"),
    (("heapq", "bisect"), "Which module keeps a list sorted while inserting, heapq or bisect?"),
]


def build(pc, chunk_tokens: int = 450):
    tok = pc.tokenizer
    names = sorted({n for q in QUESTIONS for n in q[0]} | {"shutil", "csv"})
    mods = []
    for name, text in stdlib_docs(modules=names):
        ids = tok(text, add_special_tokens=False)["input_ids"][:chunk_tokens]
        mods.append(f'<module name="{name}">Documentation of {name}:\n{escape(tok.decode(ids))}</module>')
    schema = (
        '<schema name="stdlib-docs"><system>You are a helpful assistant. Answer briefly using the '
        f"documentation provided.</system>{''.join(mods)}</schema>"
    )
    return schema


def run_demo(a) -> int:
    from .engine import PromptCache

    t = time.perf_counter()
    pc = PromptCache.from_pretrained(a.model)
    print(f"loaded {pc.model.config.model_type} in {time.perf_counter() - t:.1f}s; encoding={pc.encoding}")
    t = time.perf_counter()
    layout = pc.add_schema(build(pc), progress=True)
    n = sum(len(u.token_ids) for u in layout.units.values())
    print(f"encoded {len(layout.units)} modules ({n} tokens) once in {time.perf_counter() - t:.1f}s\n")
    for names, q in QUESTIONS:
        prompt = f'<prompt schema="stdlib-docs">{"".join(f"<{n}/>" for n in names)}<user>{escape(q)}</user></prompt>'
        out = pc.generate(prompt, max_new_tokens=a.max_new_tokens)
        res = pc.prefill(prompt)
        t = time.perf_counter()
        pc.full_prefill(res.input_ids)
        full = time.perf_counter() - t
        print(f"Q: {q}\nA: {out.text.strip()}")
        print(
            f"   ttft cached {out.ttft_s * 1000:.0f} ms vs full prefill {full * 1000:.0f} ms "
            f"(x{full / out.ttft_s:.1f}); cached {out.cached_tokens} tokens, computed {out.computed_tokens}\n"
        )
    return 0
