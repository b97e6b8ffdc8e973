"""Structured answers under the RAG default: does ``recompute="auto"`` change them more often
than full prefill changes its own when the documents are merely reordered? (issue 61, item 5)

``--prompts`` structured prompts (default 24), each four look-alike documents (a fact about one
place per document, in the same sentence shape) in a system message and a question whose answer
is a JSON object constrained by its schema (an integer, a time, a code or a year). Each prompt is
answered through LangChain's ``ChatPromptCache.with_structured_output`` by:

* ``full``: ``recompute="all"`` (every context row recomputed over the assembled prompt: the
  full prefill's attention, from the cache's token ids), the documents in order;
* ``floor``: the same, the documents in another order (what full prefill itself changes);
* ``auto``: the RAG default (``match:1``), the documents in order, taught on a first call;
* ``none``: the cache alone;
* any other policy named with ``--also`` (``each:1``...), taught and asked as ``auto`` is.

Prints how many answers of ``auto`` and ``none`` differ from ``full``, beside how many of
``floor`` do, and how many of each are right.

    .venv/bin/python scripts/measure-structured-recompute.py [--prompts 24] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "connectors" / "langchain-pcache"))

PLACES = ["Quellmoor", "Astbury", "Fernhollow", "Dunmarsh", "Kestrel Bay", "Oakridge", "Whitlow", "Brackenfield",
          "Harrowgate", "Milbrook", "Saltcombe", "Thornwick"]
TEMPLATES = [  # (fact, question, schema property, its JSON type, value maker)
    ("The night ferry from {p} departs at {v} from pier nine.", "When does the night ferry from {p} depart?",
     "time", "string", lambda r: f"{r.randint(10, 23)}:{r.choice(['05', '15', '25', '40', '55'])}"),
    ("The archive of {p} keeps {v} bound maps in its basement.", "How many bound maps does the archive of {p} keep?",
     "maps", "integer", lambda r: r.randint(120, 990)),
    ("The vault code for the {p} depot is {v}.", "What is the vault code for the {p} depot?",
     "code", "string", lambda r: f"{r.choice('KLMNPQRSTV')}{r.randint(100, 999)}"),
    ("The lighthouse at {p} was built in {v}.", "In which year was the lighthouse at {p} built?",
     "year", "integer", lambda r: r.randint(1801, 1969)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--also", nargs="*", default=[], help="more recompute policies to compare")
    a = ap.parse_args()

    from langchain_pcache import ChatPromptCache

    rng = random.Random(a.seed)
    cache = tempfile.mkdtemp(prefix="pcache-structured-")
    llms = {mode: ChatPromptCache(cache_dir=cache, max_tokens=24, recompute=mode)
            for mode in ("all", "auto", None, *a.also)}
    rows = []
    for i in range(a.prompts):
        fact, question, prop, kind, value = TEMPLATES[i % len(TEMPLATES)]
        places = rng.sample(PLACES, 4)
        values = [value(rng) for _ in places]
        docs = [fact.format(p=p, v=v) + " " + " ".join(
                    f"Visitors to {p} should note that {w}." for w in rng.sample(
                        ["the market opens early", "parking is limited", "the museum closes on Mondays",
                         "the harbour bus runs hourly", "tickets are sold at the station"], 3))
                for p, v in zip(places, values)]
        asked = rng.randrange(4)
        schema = {"title": "answer", "type": "object", "properties": {prop: {"type": kind}}, "required": [prop]}

        def ask(llm, order):
            system = "Answer from the documents.\n\n" + "\n\n".join(docs[j] for j in order)
            out = llm.with_structured_output(schema).invoke([("system", system),
                                                            ("human", question.format(p=places[asked]))])
            return json.dumps(out, sort_keys=True)

        order = list(range(4))
        shuffled = order[1:] + order[:1]
        llms["auto"].with_structured_output(schema).invoke([("system", "Answer from the documents.\n\n" +
                                                              "\n\n".join(docs)), ("human", "Teach.")])
        row = {"full": ask(llms["all"], order), "floor": ask(llms["all"], shuffled), "auto": ask(llms["auto"], order),
               "none": ask(llms[None], order), "gold": str(values[asked])}
        row.update({m: ask(llms[m], order) for m in a.also})
        rows.append(row)
        print(i, {k: v for k, v in row.items()}, flush=True)
    n = len(rows)
    modes = ["floor", "auto", "none", *a.also]
    differ = {m: sum(r[m] != r["full"] for r in rows) for m in modes}
    right = {m: sum(r["gold"] in r[m] for r in rows) for m in ["full", *modes]}
    print(f"{n} structured prompts (seed {a.seed}): answers differing from full prefill: "
          + ", ".join(f"{m} {v}" for m, v in differ.items()) + "; right: "
          + ", ".join(f"{m} {v}" for m, v in right.items()))
    if a.json:
        Path(a.json).write_text(json.dumps({"prompts": n, "seed": a.seed, "differ": differ, "right": right,
                                            "rows": rows}, indent=1)
                                + "\n")


if __name__ == "__main__":
    main()
