"""``pcache-rag eval quality``: cached answers vs full prefill, with selective recomputation.

Seeded and deterministic across processes. Facts (codes, names, dates, counts) are planted
in real filler text and asked about: standard-library documentation rendered once and
shipped (``pcache_rag/data/eval-filler.json.gz``, made by ``scripts/make-eval-filler.py``),
because pages rendered at run time differ from process to process (memory addresses,
live handlers, caches) and from one Python version to another. The report prints a hash of each set's questions and
documents, so two runs can be checked for identical inputs. Two disjoint draws of questions:
``tuning`` (choose settings there) and ``reporting`` (report there, never tune). Four sets:

* ``plain``: the answer document plus distractors that state no competing fact;
* ``competing``: the distractors state facts of the same form about other subjects;
* ``cross``: the answer needs two documents (who works where + where that company sits);
* ``rag``: end to end through :class:`~pcache_rag.rag.CachedRAG` on an ingested corpus of
  planted-fact files, retrieval included;
* ``lookalike``: end to end too, over a corpus where every file holds one fact of one of four
  sentence shapes (a departure time, a count, a code, a year), each shape told of many places, in
  filler of two styles (the documentation pages, and the legal prose of free-software licences:
  ``eval-filler-legal.json.gz``). A question names a place, so retrieval brings back several
  files with the same sentence about other places (issue 56): a policy manual's sections, a
  catalogue, a ticket archive.

Every mode answers the same questions in one run: full prefill of the same text (the
baseline), cached ``isolated``, cached ``preamble``, ``epic:K`` and ``blend:R`` (on the
preamble encoding). Metrics: answer-contained accuracy with a 95% Wilson interval, token F1,
agreement with the baseline's greedy answer, the fraction of context tokens recomputed, and
the median time-to-first-token with its ratio to full prefill, and an exact McNemar test of
each mode against full prefill on the same questions (paired: it separates modes whose
intervals overlap). Output: a Markdown table and a PNG plot (accuracy against speed-up)
under ``docs/``.

Diagnostic modes (synthetic sets only) tell where the cached path loses answers. Each
recomputes, on the preamble encoding, rows chosen with knowledge of the answer:

* ``oracle:fact``: the planted fact sentences the answer needs, ±2 tokens (about 1% of the
  context). This is the best a selector at that budget could do;
* ``oracle:answer``: every token of the documents that hold those facts;
* ``oracle:others``: every token of the other documents;
* ``oracle:facts``: every planted fact sentence of every document in the prompt, the answer's
  and its look-alikes' (±2 tokens).

On the end-to-end sets an oracle goes after a conditioned encoding too (``cond:learned+oracle:fact``:
the RAG default's states, with those rows recomputed instead of ``match:1``'s).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import statistics
import string
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..engine import Parts
from ..rag.prompt import fit_question
from .decode_bench import cpu_line, isa_caps

SETS = ("plain", "competing", "cross", "rag", "lookalike")
#: the sets answered end to end through CachedRAG (retrieval, stored states, its prompt layout)
RAG_SETS = ("rag", "lookalike")
#: disjoint question draws: settings are chosen on ``tuning`` and reported on ``reporting``.
#: Each split has its own generator seed, fact subjects and filler passages.
SPLITS = {"reporting": {"seed": 0, "subject": 0, "passage": 0},
          "tuning": {"seed": 104_729, "subject": 3_000, "passage": 100_000}}
DEFAULT_MODES = ("full", "full-reordered", "isolated", "preamble", "epic:2", "epic:8", "epic:16", "epic:32",
                 "blend:0.05", "blend:0.15", "blend:0.3")
SYSTEM = "Answer the question using the documents. Reply with a short answer."
#: a user's own system prompt, for the modes that measure what changing it costs: documents stay
#: encoded against SYSTEM (``own-system``) vs a full prefill with this prompt (``full-own-system``)
OWN_SYSTEM = ("You are a careful archivist. Read the documents below and reply with the exact answer "
              "only, with no explanation.")
OWN_MODES = ("own-system", "full-own-system")
#: full prefill with the documents in reverse order: its agreement with ``full`` is the noise
#: floor of greedy answers (what presentation order alone changes), reported beside every agreement
REORDERED = "full-reordered"
#: the modes that prefill everything (no states read)
FULL_MODES = ("full", REORDERED, "full-own-system")
ORACLE_MODES = ("oracle:fact", "oracle:answer", "oracle:others", "oracle:facts")
#: conditioned encoding (``cond:N``: each document encoded after the preamble and N neutral
#: passages; see :mod:`pcache_rag.docmodules`), read from the cache with nothing recomputed
#: ``cond:corpus`` conditions on one passage drawn from the eval's own filler corpus instead
#: (synthetic sets only); ``cond:learned`` on a learned prefix (``pcache-rag calibrate --learn``;
#: :func:`learn_eval_prefix`), the same one for every set
COND_MODES = ("cond:1", "cond:2", "cond:4", "cond:corpus", "cond:learned")
#: where ``cond:learned``'s prompts to learn from are drawn from the filler (indices no question's
#: documents use, in either split: the prefix is learned once and serves both)
LEARN_PASSAGE = 200_000
#: where the ``cond:corpus`` passage is drawn from the filler (an offset no question's documents use)
CORPUS_PASSAGE = 60_000
#: a cached mode with this suffix reads its documents' states quantized to int8 (KIVI-style, as
#: ``store_dtype="int8"`` keeps them), against the same mode in fp16 (synthetic sets only)
INT8 = "@int8"


def store_of(mode: str) -> tuple[str, bool]:
    """``(mode without the store suffix, whether its states are int8)``."""
    if mode.endswith(INT8):
        base = mode[: -len(INT8)]
        if base in FULL_MODES or base in ORACLE_MODES:
            raise ValueError(f"eval mode {mode!r}: {INT8} goes with a cached mode (full prefill keeps no states)")
        return base, True
    return mode, False


def split_mode(mode: str) -> tuple[str, str | None]:
    """``(base mode, calibration)`` of a mode: ``ape:T:S`` alone is the preamble encoding with
    calibrated attention (:mod:`pcache_rag.models.attention`), and ``BASE+ape:T:S`` adds it to
    a cached mode without recompute (``cond:1+ape:0.9:0.9``). ``cond:N+POLICY`` is a recompute
    policy on conditioned states (``cond:1+epic:16``); its base is returned whole. The store
    suffix (``@int8``) is not part of either."""
    mode = store_of(mode)[0]
    base, _, cal = mode.partition("+")
    if base.startswith("ape:"):
        base, cal = "preamble", base
    if cal and not cal.startswith("ape:"):
        if base not in COND_MODES:
            raise ValueError(f"eval mode {mode!r}: a recompute policy after '+' goes with {', '.join(COND_MODES)}")
        return mode, None
    if cal:
        from ..models.attention import Calibration

        Calibration.parse(cal)
        if base not in ("isolated", "preamble") + COND_MODES:
            raise ValueError(f"eval mode {mode!r}: calibrated attention goes with a cached mode without recompute "
                             f"(isolated, preamble, {', '.join(COND_MODES)}), not {base!r}")
    return base, cal or None


def encoding_of(mode: str) -> str:
    """The document encoding a mode reads: ``isolated``, ``preamble`` or a ``cond:N``, with
    ``@int8`` when its states are quantized."""
    suffix = INT8 if store_of(mode)[1] else ""
    mode = split_mode(mode)[0].partition("+")[0]
    if mode == "isolated" or mode.startswith("cond:"):
        return mode + suffix
    return "preamble" + suffix


def _cached_request_policy(mode: str) -> tuple[str, str | None]:
    """``(recompute, calibration)`` of a cached mode's request."""
    base, cal = split_mode(mode)
    if "+" in base:  # a recompute policy (or an oracle's rows) on conditioned states
        return base.partition("+")[2], cal
    return ("none" if base in ("isolated", "preamble", "own-system") + COND_MODES else base), cal


#: ``eval quality --question-template NAME``: frameworks' own text after the documents. LlamaIndex's
#: default text-QA prompt (``DEFAULT_TEXT_QA_PROMPT_TMPL``, its part after ``{context_str}``)
QUESTION_TEMPLATES = {
    "llamaindex": ("\n---------------------\nGiven the context information and not prior knowledge, answer the "
                   "query.\nQuery: {question}\nAnswer: "),
}
#: the quality bar a cached mode must meet (issue 20): at most this many points below full
#: prefill, with a McNemar p >= 0.05, at this many times full prefill's speed or more
BAR_POINTS = 3
BAR_SPEEDUP = 15
#: ``oracle:fact``: tokens taken either side of a fact sentence (its tokenization at a cut may merge)
ORACLE_MARGIN = 2


@dataclass(slots=True)
class Question:
    docs: list[str]  # the documents in prompt order (the ones holding the answer included)
    question: str
    answer: str  # gold answer (answer-contained: every word of it must appear)
    kind: str = ""
    facts: list[str] = field(default_factory=list)  # the planted sentences the answer needs


# ---------------------------------------------------------------------------- data

_FIRST = ("Ada", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kalani",
          "Lena", "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wen",
          "Yusuf", "Zora", "Anton", "Beatriz", "Cyrus", "Dalia", "Emil")
_LAST = ("Ferrell", "Castell", "Lind", "Osei", "Vasko", "Moreau", "Holm", "Tanabe", "Duarte", "Weller", "Brooks",
         "Marsh", "Ruiz", "Petrov", "Lund", "Nair", "Blake", "Amaral", "Dahl", "Quinn", "Haddad", "Novak", "Kaya")
_CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Tbilisi", "Quito", "Dublin", "Kyoto", "Tunis",
           "Zagreb", "Perth", "Accra", "Riga", "Bergen", "Cusco", "Malmo", "Porto", "Krakow", "Leipzig",
           "Valencia", "Tallinn", "Bilbao", "Lyon", "Graz", "Turku", "Odesa", "Split", "Ghent", "Aarhus")
_PLACES = ("northern", "harbour", "granite", "copper", "willow", "summit", "amber", "cedar", "silver", "lantern",
           "meadow", "falcon", "orchard", "beacon", "quarry", "river", "thistle", "canyon", "maple", "coral")
_THINGS = ("archive", "vault", "library", "depot", "observatory", "workshop", "greenhouse", "foundry")
_COMPANIES = ("Norvik Labs", "Altamira Systems", "Brightwell Foods", "Cobalt Freight", "Dunmore Textiles",
              "Everly Robotics", "Fernhill Optics", "Galloway Mining", "Harrow Biotech", "Ironleaf Media",
              "Juniper Motors", "Kestrel Energy", "Lumen Ceramics", "Marlow Shipping", "Nettle Software",
              "Oakhurst Paper", "Pinecrest Audio", "Quillon Pharma", "Redfern Glass", "Saltmarsh Tools")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_EVENTS = ("bridge opening", "harbour festival", "chess final", "glacier survey", "lantern parade", "river census",
           "orchard auction", "comet watch", "tram launch", "choir contest")


def _fact(r: random.Random, i: int) -> tuple[str, str, str, str]:
    """(kind, fact sentence, question, answer) for subject number ``i`` (unique subjects)."""
    kind = ("code", "birth", "date", "count")[i % 4]
    if kind == "code":
        place = f"{_PLACES[i % len(_PLACES)]} {_THINGS[(i // len(_PLACES)) % len(_THINGS)]}"
        code = f"{r.choice(string.ascii_uppercase)}{r.choice(string.ascii_uppercase)}-{r.randint(1000, 9999)}"
        return kind, f"The access code for the {place} is {code}.", f"What is the access code for the {place}?", code
    if kind == "birth":
        name = f"{_FIRST[i % len(_FIRST)]} {_LAST[(i * 7) % len(_LAST)]}"
        city = r.choice(_CITIES)
        return kind, f"{name} was born in {city}.", f"In which city was {name} born?", city
    if kind == "date":
        ev = f"{_PLACES[i % len(_PLACES)]} {_EVENTS[(i // len(_PLACES)) % len(_EVENTS)]}"
        y, m, d = r.randint(1901, 1999), r.choice(_MONTHS), r.randint(1, 28)
        return kind, f"The {ev} took place on {m} {d}, {y}.", f"In which year did the {ev} take place?", str(y)
    city = _CITIES[i % len(_CITIES)]
    item = ("crates", "barrels", "lamps", "bicycles")[(i // len(_CITIES)) % 4]
    n = r.randint(120, 9800)
    return (kind, f"The warehouse in {city} holds exactly {n} {item}.",
            f"How many {item} does the warehouse in {city} hold?", str(n))


#: the ``lookalike`` set's place names: every head with every tail (360), half to each split
_LA_HEADS = ("Ash", "Bel", "Cal", "Dun", "Eld", "Fen", "Glen", "Hal", "Ivy", "Kel", "Lor", "Mar", "Nor", "Orr",
             "Pen", "Rav", "Sel", "Tor", "Ul", "Ver", "Wyn", "Yar", "Bram", "Cor", "Dal", "Ems", "Gil", "Hol",
             "Kir", "Lin")
_LA_TAILS = ("ford", "mere", "wick", "haven", "stead", "by", "ton", "moor", "bridge", "field", "combe", "holt")
LOOKALIKE_PLACES = len(_LA_HEADS) * len(_LA_TAILS) // 2  # per split
#: the four sentence shapes, each told of many places: (kind, fact, question); {p} the place, {v} the value
_LA_TEMPLATES = (
    ("time", "The last ferry from {p} leaves at {v}.", "At what time does the last ferry from {p} leave?"),
    ("count", "The museum of {p} keeps {v} old maps in its collection.", "How many old maps does the museum of {p} keep?"),
    ("code", "The gate code of the depot in {p} is {v}.", "What is the gate code of the depot in {p}?"),
    ("year", "The lighthouse at {p} was built in {v}.", "In which year was the lighthouse at {p} built?"),
)


def lookalike_place(i: int) -> str:
    """Place name number ``i`` (0 to 359; each split takes its own half)."""
    return _LA_HEADS[i % len(_LA_HEADS)] + _LA_TAILS[(i // len(_LA_HEADS)) % len(_LA_TAILS)]


def _lookalike_fact(r: random.Random, i: int, place: int) -> tuple[str, str, str, str]:
    """(kind, fact sentence, question, answer) of file ``i``: shape ``i % 4``, place number ``place``."""
    kind, fact, question = _LA_TEMPLATES[i % len(_LA_TEMPLATES)]
    if kind == "time":
        v = f"{r.randint(5, 23):02d}:{r.choice(range(0, 60, 5)):02d}"
    elif kind == "count":
        v = str(r.randint(110, 4900))
    elif kind == "code":
        v = f"{r.choice(string.ascii_uppercase)}{r.randint(1, 9)}{r.choice(string.ascii_uppercase)}-{r.randint(10, 99)}"
    else:
        v = str(r.randint(1801, 1989))
    p = lookalike_place(place)
    return kind, fact.format(p=p, v=v), question.format(p=p), v


FILLER = Path(__file__).resolve().parents[1] / "data" / "eval-filler.json.gz"
#: the filler sources: standard-library documentation (every set), and legal prose (the licence texts
#: of ``scripts/make-eval-filler-legal.py``; the ``lookalike`` set's second style, on which nothing
#: here was tuned or learned)
FILLERS = {"docs": FILLER, "legal": FILLER.with_name("eval-filler-legal.json.gz")}


def filler_pages(source: str = "docs") -> list[str]:
    """The shipped pages of filler ``source`` (:data:`FILLERS`) the eval's documents are cut from, in a fixed order."""
    import gzip

    with gzip.open(FILLERS[source], "rt", encoding="utf-8") as f:
        pages = json.load(f)["pages"]
    return [pages[name] for name in sorted(pages)]


class Filler:
    """Passages of real text of one ``source`` (:data:`FILLERS`), ``doc_tokens`` model tokens each."""

    def __init__(self, tokenizer, doc_tokens: int, source: str = "docs"):
        from ..tokens import safe_tokenizer

        st = safe_tokenizer(tokenizer)
        ids: list[int] = []
        for text in filler_pages(source):
            ids.extend(st.text(text)[:6000])
        self.tokenizer, self.ids, self.n = tokenizer, ids, doc_tokens

    def passage(self, i: int) -> str:
        span = len(self.ids) - self.n
        start = (i * 977) % max(span, 1)
        return self.tokenizer.decode(self.ids[start : start + self.n])


def inputs_hash(questions: list[Question], files: dict[str, str] | None = None) -> str:
    """A short hash of a set's inputs: each question, its gold answer and documents (and the
    corpus ``files`` of the end-to-end set), so two runs can be checked for identical inputs."""
    h = hashlib.sha256()
    for q in questions:
        h.update(json.dumps([q.question, q.answer, q.docs], ensure_ascii=False).encode())
    for name in sorted(files or {}):
        h.update(json.dumps([name, files[name]], ensure_ascii=False).encode())
    return h.hexdigest()[:16]


def _plant(passage: str, fact: str, r: random.Random) -> str:
    lines = passage.split("\n")
    at = r.randint(max(1, len(lines) // 4), max(1, (3 * len(lines)) // 4))
    return "\n".join(lines[:at] + [fact] + lines[at:])


def build_sets(tokenizer, n: int, doc_tokens: int, k: int = 4, seed: int = 0,
               split: str = "reporting") -> dict[str, list[Question]]:
    """The three synthetic sets (``plain``, ``competing``, ``cross``); ``n`` questions each,
    from the ``split``'s own draw (see :data:`SPLITS`)."""
    sp = _split(split)
    r = random.Random(seed + sp["seed"])
    fill = Filler(tokenizer, doc_tokens)
    po = sp["passage"]
    facts = [_fact(r, sp["subject"] + i) for i in range(n)]
    fact_docs = [_plant(fill.passage(po + i), f[1], r) for i, f in enumerate(facts)]
    plain_docs = [fill.passage(po + 10_000 + i) for i in range(n + 8)]
    out: dict[str, list[Question]] = {"plain": [], "competing": [], "cross": []}
    for i, (kind, fact_s, q, a) in enumerate(facts):
        slot = r.randrange(k)
        distract = r.sample(plain_docs, k - 1)
        out["plain"].append(Question(distract[:slot] + [fact_docs[i]] + distract[slot:], q, a, kind, [fact_s]))
        same = [j for j in range(n) if j != i and facts[j][0] == kind]
        others = r.sample(same, min(k - 1, len(same)))
        rest = [j for j in range(n) if j != i and j not in others]  # a small n: other facts fill in
        others += r.sample(rest, min(k - 1 - len(others), len(rest)))
        docs = [fact_docs[j] for j in others]
        docs.insert(min(slot, len(docs)), fact_docs[i])
        out["competing"].append(Question(docs, q, a, kind, [fact_s]))
    # cross-document: person -> company, company -> city (with competing pairs as distractors)
    pairs = []
    for i in range(sp["subject"], sp["subject"] + n):
        name = f"{_FIRST[(i * 3) % len(_FIRST)]} {_LAST[(i * 5 + 1) % len(_LAST)]}"
        company = f"{_COMPANIES[i % len(_COMPANIES)]}"
        city = r.choice(_CITIES)
        d1 = _plant(fill.passage(po + 20_000 + i), f"{name} works for {company}.", r)
        d2 = _plant(fill.passage(po + 30_000 + i), f"The headquarters of {company} are in {city}.", r)
        pairs.append((name, company, city, d1, d2))
    for i, (name, company, city, d1, d2) in enumerate(pairs):
        facts_i = [f"{name} works for {company}.", f"The headquarters of {company} are in {city}."]
        j = (i + 1 + r.randrange(n - 1)) % n if n > 1 else i
        other = pairs[j]
        distract = [other[3] if other[1] != company else plain_docs[i], other[4] if other[1] != company else plain_docs[i + 1]]
        docs = [d1, d2] + distract[: max(0, k - 2)]
        r.shuffle(docs)
        q = f"{name} works for a company. In which city are that company's headquarters?"
        out["cross"].append(Question(docs, q, city, "cross", facts_i))
    return out


def _split(split: str) -> dict:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    return SPLITS[split]


# ---------------------------------------------------------------------------- metrics


def mcnemar_p(a: list[bool], b: list[bool]) -> float:
    """Two-sided exact McNemar test of paired outcomes ``a`` and ``b`` on the same questions:
    the binomial probability of a split of the discordant pairs at least this uneven under
    equal accuracy. 1.0 when they never disagree."""
    if len(a) != len(b):
        raise ValueError("McNemar needs the same questions in both")
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 0.0
    p = correct / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def _norm_tokens(s: str) -> list[str]:
    return re.sub(r"[^\w\s-]", " ", s.lower()).split()


def answer_line(text: str) -> str:
    """The answer in a model's output: its first non-empty line. A chat model stops at the first
    line break; a model without a chat template (plain ``Assistant:`` prompts) often begins
    with one, so its whole output is decoded and its first line with text is the answer."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def answer_stop(pc) -> list[str]:
    """Stop strings of the eval's answers (see :func:`answer_line`)."""
    return [] if pc.chat.source == "plain" else ["\n"]


def contains(answer_text: str, gold: str) -> bool:
    words = set(_norm_tokens(answer_text))
    text = " ".join(_norm_tokens(answer_text))
    return all(w in words or w in text for w in _norm_tokens(gold))


def token_f1(pred: str, gold: str) -> float:
    p, g = _norm_tokens(pred), _norm_tokens(gold)
    if not p or not g:
        return float(p == g)
    common = sum(min(p.count(w), g.count(w)) for w in set(g))
    if common == 0:
        return 0.0
    prec, rec = common / len(p), common / len(g)
    return 2 * prec * rec / (prec + rec)


# ---------------------------------------------------------------------------- running


@dataclass(slots=True)
class ModeResult:
    answers: list[str] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    f1: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    recomputed: list[float] = field(default_factory=list)  # fraction of context tokens recomputed
    prompt_tokens: list[int] = field(default_factory=list)


class _Synthetic:
    """Answers a synthetic question in every mode on one model: documents are encoded once
    per encoding at the canonical position right after the preamble, and placed at contiguous
    slots like the RAG path (RoPE re-rotation)."""

    def __init__(self, model, tok, query_weights: str | None = None):
        from ..engine import PromptCache
        from ..docmodules import preamble_ids

        self.pcs = {enc: PromptCache(model, tok, encoding=enc, query_weights=query_weights)
                    for enc in ("isolated", "preamble")}
        pc = self.pcs["preamble"]
        self.pre_ids = preamble_ids(pc, SYSTEM)  # the same prompt pieces as CachedRAG
        P = len(self.pre_ids)
        self.pre_kv = pc.encoder.encode(self.pre_ids, list(range(P)))
        self.own_ids = preamble_ids(pc, OWN_SYSTEM)
        self.own_kv = pc.encoder.encode(self.own_ids, list(range(len(self.own_ids))))
        self.cache: dict[tuple[str, str], object] = {}
        self.asms: dict[str, object] = {}  # conditioned encodings, through the RAG path's own Assembler
        self.encode_cost: dict[str, list[float]] = {}  # encoding -> [tokens, seconds] of documents encoded
        self.corpus_passage = ""  # ``cond:corpus``'s passage (set by run_eval, per split)
        self.prefix = None  # ``cond:learned``'s LearnedPrefix (set by run_eval)
        #: the text after the documents, around ``{question}`` (set by run_eval; None: the RAG path's own)
        self.template: str | None = None

    def doc_ids(self, doc: str) -> list[int]:
        from ..docmodules import document_ids  # the RAG path's own document tokens

        return document_ids(self.pcs["preamble"], doc)

    def q_ids(self, q: str) -> list[int]:
        from ..rag.prompt import question_ids

        return question_ids(self.pcs["preamble"], q, self.template)

    def _doc_kv(self, enc: str, doc: str):
        key = (enc, doc)
        kv = self.cache.get(key)
        if kv is None and enc.endswith(INT8):  # the same states, quantized as the int8 store keeps them
            import torch

            kv = self.cache[key] = self._doc_kv(enc[: -len(INT8)], doc).to(dtype=torch.int8)
            return kv
        t0 = time.perf_counter()
        if kv is None and enc.startswith("cond:"):
            from ..docmodules import Assembler

            asm = self.asms.get(enc)
            if asm is None:
                if enc == "cond:corpus":
                    asm = Assembler(self.pcs["preamble"], SYSTEM, conditioning_text=self.corpus_passage)
                elif enc == "cond:learned":
                    asm = Assembler(self.pcs["preamble"], SYSTEM, prefix=self.prefix)
                else:
                    asm = Assembler(self.pcs["preamble"], SYSTEM, conditioning=f"neutral:{enc[5:]}")
                self.asms[enc] = asm
            kv = self.cache[key] = asm.encode_ids(self.doc_ids(doc), store=False)
            self._count(enc, kv.length, t0)
        if kv is None:
            pc = self.pcs[enc]
            ids = self.doc_ids(doc)
            P = len(self.pre_ids)
            ctx = self.pre_kv if enc == "preamble" else None
            kv = pc.encoder.encode(ids, list(range(P, P + len(ids))), context=ctx).to(dtype=pc.store_dtype)
            self.cache[key] = kv
            self._count(enc, kv.length, t0)
        return kv

    def _count(self, enc: str, tokens: int, t0: float) -> None:
        c = self.encode_cost.setdefault(enc, [0, 0.0])
        c[0] += tokens
        c[1] += time.perf_counter() - t0

    def encode_rates(self) -> dict[str, float]:
        """Document tokens encoded per second, per encoding (the ingest cost of each)."""
        return {enc: round(n / s, 1) for enc, (n, s) in sorted(self.encode_cost.items()) if s > 0}

    def request(self, mode: str, q: Question) -> tuple:
        """``(prompt, recompute)`` of ``q`` in ``mode`` (a :class:`~pcache_rag.engine.Parts`, and its
        policy), for :meth:`~pcache_rag.engine.PromptCache.generate_batch`."""
        pc = self.pcs["preamble"]
        if mode in FULL_MODES:
            pre = self.own_ids if mode == "full-own-system" else self.pre_ids
            docs = q.docs[::-1] if mode == REORDERED else q.docs
            ids = list(pre) + [i for d in docs for i in self.doc_ids(d)] + self.q_ids(q.question)
            return Parts([], ids), None
        enc = encoding_of(mode)
        own = mode == "own-system"  # another system prompt before documents encoded against SYSTEM
        parts = [("preamble", self.own_kv if own else self.pre_kv)]
        pos = len(self.own_ids if own else self.pre_ids)
        for j, d in enumerate(q.docs):
            kv = pc.encoder.place(self._doc_kv(enc, d), pos)
            parts.append((f"d{j}", kv))
            pos += kv.length
        recompute, cal = _cached_request_policy(mode)
        if recompute in ORACLE_MODES:
            from ..recompute import Recompute

            recompute = Recompute.explicit(self.oracle_rows(recompute, q, [kv.length for _, kv in parts]))
        return Parts(parts, self.q_ids(q.question), "preamble", cal), recompute

    def oracle_rows(self, mode: str, q: Question, lengths: list[int]) -> list[int]:
        """The cache rows an oracle mode recomputes (``lengths``: the preamble's, then each document's)."""
        text = self.pcs["preamble"].safe.text
        rows: list[int] = []
        off = lengths[0]
        for d, n in zip(q.docs, lengths[1:]):
            holds = [f for f in q.facts if f in d]
            if (mode == "oracle:answer" and holds) or (mode == "oracle:others" and not holds):
                rows.extend(range(off, off + n))
            elif mode == "oracle:fact":
                for f in holds:
                    at = d.index(f)
                    t0, t1 = len(text(d[:at])), len(text(d[: at + len(f)]))
                    rows.extend(range(off + max(0, t0 - ORACLE_MARGIN), off + min(n, t1 + ORACLE_MARGIN)))
            off += n
        if mode != "oracle:others" and not rows:
            raise ValueError(f"{mode}: no document of this question holds its facts")
        return rows

    def answers(self, modes, q: Question, max_new_tokens: int) -> list:
        """One output per mode, decoded in batches; each TTFT is its request's alone (:func:`_decode_apart`)."""
        for mode in modes:  # encode missing documents first: encoding is not part of any TTFT
            if mode not in FULL_MODES:
                for d in q.docs:
                    self._doc_kv(encoding_of(mode), d)
        reqs = [self.request(m, q) for m in modes]
        return _decode_apart(self.pcs["preamble"], modes, reqs, max_new_tokens)


def rag_corpus(tok, workdir: Path, n: int, doc_tokens: int, seed: int, split: str = "reporting"):
    """The rag set's files, written to ``workdir/corpus``: one planted-fact file per question
    (``facts-NNNN.txt``) and as many plain ones. Returns ``(questions, files, corpus folder)``."""
    sp = _split(split)
    r = random.Random(seed + 1 + sp["seed"])
    fill = Filler(tok, doc_tokens)
    corpus = workdir / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    qs = []
    files: dict[str, str] = {}
    for i in range(n):
        kind, fact, q, a = _fact(r, sp["subject"] + 500 + i)
        files[f"facts-{i:04d}.txt"] = _plant(fill.passage(sp["passage"] + 40_000 + i), fact, r)
        qs.append(Question([], q, a, kind, [fact]))
    for i in range(n):
        files[f"manual-{i:04d}.txt"] = fill.passage(sp["passage"] + 50_000 + i)
    for name, text in files.items():
        (corpus / name).write_text(text)
    return qs, files, corpus


def lookalike_corpus(tok, workdir: Path, n: int, doc_tokens: int, seed: int, split: str = "reporting"):
    """The ``lookalike`` set's files, written to ``workdir/corpus``: ``n`` files (``facts-NNNN.txt``),
    each a passage of filler with one planted fact at a random line, and a question about each.
    File ``i`` states shape ``i % 4`` (:data:`_LA_TEMPLATES`) of its own place, so each shape is a
    quarter of the corpus; its filler is documentation or legal prose, by turns of four files.
    Returns ``(questions, files, corpus folder)``; every question's ``facts`` holds its sentence."""
    if n > LOOKALIKE_PLACES:
        raise ValueError(f"the lookalike set has {LOOKALIKE_PLACES} places a split, not {n}")
    sp = _split(split)
    r = random.Random(seed + 2 + sp["seed"])
    fills = {src: Filler(tok, doc_tokens, src) for src in FILLERS}
    first = 0 if split == "reporting" else LOOKALIKE_PLACES
    places = r.sample(range(first, first + LOOKALIKE_PLACES), n)
    corpus = workdir / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    qs, files = [], {}
    for i in range(n):
        kind, fact, q, a = _lookalike_fact(r, i, places[i])
        src = ("docs", "legal")[(i // 4) % 2]
        files[f"facts-{i:04d}.txt"] = _plant(fills[src].passage(sp["passage"] + 70_000 + i), fact, r)
        qs.append(Question([], q, a, kind, [fact]))
    for name, text in files.items():
        (corpus / name).write_text(text)
    return qs, files, corpus


#: each end-to-end set's corpus
RAG_CORPORA = {"rag": rag_corpus, "lookalike": lookalike_corpus}


def _rag_set(model, tok, workdir: Path, n: int, doc_tokens: int, k: int, seed: int, split: str = "reporting",
             encodings=("isolated", "preamble"), retrieval: str = "hybrid", prefix=None, set_name: str = "rag",
             query_weights: str | None = None):
    """An ingested corpus of planted-fact files (:data:`RAG_CORPORA` of ``set_name``), a
    CachedRAG per encoding over it, and the hash of the questions and files."""
    from ..models.fast_decode import installed_format
    from ..rag import CachedRAG, Index

    qs, files, corpus = RAG_CORPORA[set_name](tok, workdir, n, doc_tokens, seed, split)
    rags = {}
    for enc in sorted(set(encodings) | {"preamble"}):
        folder = workdir / f"index-{enc.replace(':', '')}"
        cond = f"neutral:{enc[5:]}" if enc.startswith("cond:") else "none"
        if enc == "cond:learned":  # the index keeps its own copy, as `calibrate --learn` leaves it
            cond = prefix
        index = Index(folder)
        # the decode weights of the whole run (run_eval's --decode-weights, else fp32), not the RAG default
        pc = index.engine(model, tok, encoding="isolated" if enc == "isolated" else "preamble",
                          decode_weights=installed_format(model) or "fp32", query_weights=query_weights or "fp32")
        rag = CachedRAG(index, pc=pc, k=k, chunk_tokens=doc_tokens + 64, system_prompt=SYSTEM, conditioning=cond,
                        retrieval=retrieval)
        rag.ingest([corpus], progress=False)
        rags[enc] = rag
    return qs, rags, inputs_hash(qs, files)


def _sentence_rows(tok, ids: list[int], text: str, sentence: str) -> range | None:
    """The token rows of ``sentence`` in a unit whose tokens ``ids`` decode to ``text``, ±
    :data:`ORACLE_MARGIN` (a token at its edge may hold a neighbour's characters too); None where
    it is not there. Found by bisecting on the length of decoded prefixes."""
    at = text.find(sentence)
    if at < 0:
        return None

    def first_past(c: int) -> int:  # the fewest tokens whose decoded text is longer than c characters
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tok.decode(ids[:mid], skip_special_tokens=True)) > c:
                hi = mid
            else:
                lo = mid + 1
        return lo

    t0, t1 = first_past(at) - 1, first_past(at + len(sentence) - 1)
    return range(max(0, t0 - ORACLE_MARGIN), min(len(ids), t1 + ORACLE_MARGIN))


def rag_oracle_rows(tok, oracle: str, parts: list, q: Question, planted: set[str]) -> list[int]:
    """The cache rows an oracle mode recomputes over a CachedRAG prompt's ``parts`` (the preamble
    first, then a retrieved chunk each): ``planted`` holds every fact sentence of the set's corpus."""
    rows: list[int] = []
    off = parts[0][1].length
    for _, kv in parts[1:]:
        ids = kv.token_ids.tolist() if hasattr(kv.token_ids, "tolist") else list(kv.token_ids)
        text = tok.decode(ids, skip_special_tokens=True)
        holds = [f for f in q.facts if f in text]
        if (oracle == "oracle:answer" and holds) or (oracle == "oracle:others" and not holds):
            rows.extend(range(off, off + kv.length))
        elif oracle in ("oracle:fact", "oracle:facts"):
            for f in (holds if oracle == "oracle:fact" else [f for f in planted if f in text]):
                span = _sentence_rows(tok, ids, text, f)
                if span is not None:
                    rows.extend(off + t for t in span)
        off += kv.length
    return rows


def _rag_answers(rags: dict, modes, q: Question, max_new_tokens: int, tok, planted: set[str] | None = None):
    """Every mode's answer to ``q`` through the CachedRAG indexes: their retrieval, their stored
    states and their prompt layout, decoded together on one engine. A cached mode's TTFT
    includes fetching its states (as :meth:`CachedRAG.answer` counts it). An oracle mode's rows
    are found among ``planted`` (every fact sentence of the corpus: :func:`rag_oracle_rows`) with ``tok``."""
    handles = {enc: rag.retrieve(q.question) for enc, rag in rags.items()}
    reqs, fetch = [], []
    for mode in modes:
        enc = encoding_of(mode)
        rag, hs = rags[enc], handles[enc]
        q_ids = fit_question(rag, q.question, hs, max_new_tokens)
        if mode == "full":
            reqs.append((Parts([], rag.full_prompt_ids(q.question, hs)), None))
            fetch.append(0.0)
            continue
        if mode == REORDERED:  # the retrieved chunks in the opposite order
            ids = list(rag.preamble_ids) + [t for h in sorted(hs, key=lambda h: -h.score)
                                             for t in rag.chunks.ids(h.text, h.source)]
            reqs.append((Parts([], ids + rag.question_ids(q.question)), None))
            fetch.append(0.0)
            continue
        t0 = time.perf_counter()
        parts = rag.chunks.parts(hs)
        fetch.append(time.perf_counter() - t0)
        recompute, cal = _cached_request_policy(mode)
        if recompute in ORACLE_MODES:
            from ..recompute import Recompute

            recompute = Recompute.explicit(rag_oracle_rows(tok, recompute, parts, q, planted or set()))
        reqs.append((Parts(parts, q_ids, "preamble", cal), recompute))
    outs = _decode_apart(rags["preamble"].pc, modes, reqs, max_new_tokens)
    return outs, [o.ttft_s + f for o, f in zip(outs, fetch)]


def _decode_apart(pc, modes, reqs, max_new_tokens: int) -> list:
    """Every request decoded greedily, full prefill's in a batch of its own: batched products
    round by batch shape, so full prefill's answers do not depend on which modes run beside it.

    TTFT is a request's alone: in a batch, every request's first token waits for all of the
    batch's rows to be assembled and for one forward over all their questions, so a batch of
    three cached modes measured 295 ms a question where one alone measured 183 ms (1,700
    tokens, 2-core CPU). Where a batch holds more than one request, each is prefilled again
    alone for its first token, and that time is the one reported (answers stay the batch's)."""
    import dataclasses

    full = [i for i, m in enumerate(modes) if m.startswith("full") and m != REORDERED]
    reordered = [i for i, m in enumerate(modes) if m == REORDERED]  # apart too: full's batch keeps its shape
    rest = [i for i in range(len(modes)) if i not in full and i not in reordered]
    outs: list = [None] * len(modes)
    for idx in (full, reordered, rest):
        if idx:
            batch = pc.generate_batch([reqs[i][0] for i in idx], [reqs[i][1] for i in idx],
                                      max_new_tokens=max_new_tokens, stop=answer_stop(pc))
            for i, o in zip(idx, batch):
                outs[i] = o
            if len(idx) > 1:
                for i in idx:
                    alone = pc.generate(reqs[i][0], recompute=reqs[i][1], max_new_tokens=1)
                    outs[i] = dataclasses.replace(outs[i], ttft_s=alone.ttft_s)
    return outs


def retrieval_recall(model_path=None, n: int = 100, doc_tokens: int = 400, ks=(1, 2, 4, 8), seed: int = 0,
                     split: str = "reporting", log=print, set_name: str = "rag") -> dict:
    """Fact-chunk recall@k of an end-to-end set's questions (``rag`` or ``lookalike``), dense against hybrid retrieval, on one
    index (text only: ``encode="lazy"``, no states are needed to retrieve). A question counts
    at ``k`` when its planted-fact file is among the ``k`` chunks retrieved."""
    import tempfile

    from ..default_model import load_model
    from ..rag import CachedRAG, Index

    model, tok = load_model(model_path)
    out: dict = {"n": n, "split": split, "doc_tokens": doc_tokens, "ks": list(ks), "modes": {}}
    with tempfile.TemporaryDirectory(prefix="pcache-recall-") as tmp:
        wd = Path(tmp)
        qs, files, corpus = RAG_CORPORA[set_name](tok, wd, n, doc_tokens, seed, split)
        out["inputs"] = inputs_hash(qs, files)
        out["set"] = set_name
        index = Index(wd / "index")
        pc = index.engine(model, tok, decode_weights="fp32")  # retrieval only: nothing is decoded
        rag = CachedRAG(index, pc=pc, k=max(ks), chunk_tokens=doc_tokens + 64, system_prompt=SYSTEM)
        rag.ingest([corpus], progress=False, encode="lazy")
        for mode in ("dense", "hybrid"):
            rag.retriever.mode = mode
            t0 = time.perf_counter()
            found = {k: [] for k in ks}
            for i, q in enumerate(qs):
                srcs = [Path(h.source).name for h in rag.retrieve(q.question, k=max(ks), prefetch=False)]
                for k in ks:
                    found[k].append(f"facts-{i:04d}.txt" in srcs[:k])
            secs = (time.perf_counter() - t0) / max(1, len(qs))
            out["modes"][mode] = {"recall": {k: sum(v) / len(v) for k, v in found.items()},
                                  "hits": {k: sum(v) for k, v in found.items()},
                                  "found": {k: v for k, v in found.items()}, "ms_per_question": secs * 1e3}
            log(f"{mode:>7}: " + "  ".join(f"recall@{k} {sum(v)}/{len(v)}" for k, v in found.items())
                + f"  ({secs * 1e3:.0f} ms per question)")
        rag.close()
    for k in ks:
        out.setdefault("mcnemar_p", {})[k] = mcnemar_p(out["modes"]["hybrid"]["found"][k],
                                                      out["modes"]["dense"]["found"][k])
    return out


def learn_eval_prefix(syn: _Synthetic, tok, doc_tokens: int = 400, k: int = 4, train: int = 48, val: int = 16,
                      steps: int = 96, seed: int = 0, log=print, progress: bool = False):
    """``cond:learned``'s prefix, learned as ``pcache-rag calibrate --learn`` learns one for an index
    (:mod:`pcache_rag.rag.learned`): label-free, from prompts of ``k`` filler passages at
    :data:`LEARN_PASSAGE` (no question's documents) and a line of one to complete, whose own
    rest is the answer (:func:`~pcache_rag.rag.calibrate.cloze_question`).
    Returns the :class:`~pcache_rag.rag.learned.LearnReport`."""
    from ..rag.calibrate import cloze_question
    from ..rag.learned import Prompt, learn_prefix

    r = random.Random(seed + 17)
    fill = Filler(tok, doc_tokens)
    safe = syn.pcs["preamble"].safe
    prompts = []
    for i in range(train + val):
        docs = [fill.passage(LEARN_PASSAGE + k * i + j) for j in range(k)]
        question, answer = cloze_question(docs[r.randrange(k)], r)
        prompts.append(Prompt([syn.doc_ids(d) for d in docs], syn.q_ids(question), safe.text(answer) if answer else []))
    rep = learn_prefix(syn.pcs["preamble"], syn.pre_ids, prompts[val:], prompts[:val], steps=steps, seed=seed,
                       progress=progress, log_fn=log, meta={"learned_on": f"eval filler passages at {LEARN_PASSAGE}"})
    log(f"cond:learned: {rep.prefix.spec}, validation KL {rep.kl_init:.4f} (neutral) -> {rep.kl_learned:.4f} in "
        f"{rep.seconds:.0f} s ({rep.steps} steps, {rep.train_prompts} prompts to learn on)")
    return rep


def install_prefix(model=None, path: str | Path | None = None, steps: int = 96, seed: int = 0, force: bool = False,
                   log=print, progress: bool = True, train: int = 48, val: int = 16):
    """Learn ``model``'s conditioning prefix by ``cond:learned``'s label-free procedure
    (:func:`learn_eval_prefix`) and install it where it becomes the model's RAG default
    (:func:`pcache_rag.conditioning.installed_dir`, ``<model name>.safetensors``; or ``path``).
    A prefix already installed for the model is kept unless ``force``. Returns
    ``(path, LearnReport or None)``: None when nothing was learned (one was installed already)."""
    import torch

    from ..conditioning import install, installed_dir, installed_prefix
    from ..default_model import load_model, model_name

    name = model_name(model)
    target = Path(path).expanduser() if path else installed_dir() / f"{name}.safetensors"
    torch.manual_seed(seed)
    m, tok = load_model(model)
    syn = _Synthetic(m, tok)
    have = installed_prefix(syn.pcs["preamble"].fingerprint)
    if have is not None and not force:
        log(f"{have.spec} is already installed for {name}: it is the RAG default (--force learns it again)")
        return target, None
    rep = learn_eval_prefix(syn, tok, train=train, val=val, steps=steps, seed=seed, log=log, progress=progress)
    if not rep.improved:
        raise RuntimeError(f"the learned prefix measured no lower than the neutral passage on {name} "
                           f"(validation KL {rep.kl_init:.4f}); nothing was installed")
    install(rep.prefix, target)
    log(f"installed {rep.prefix.spec} at {target}: the RAG default for {name} from now on (a new index, "
        "the connectors' documents, <schema conditioning=\"learned\">); existing indexes keep their conditioning")
    return target, rep


def run_eval(model_path=None, n: int = 75, doc_tokens: int = 400, k: int = 4, modes=DEFAULT_MODES,
             sets=SETS, max_new_tokens: int = 24, seed: int = 0, workdir: str | Path | None = None,
             out_dir: str | Path | None = "docs", log=print, checkpoint: str | Path | None = None,
             split: str = "reporting", prefix: str | Path | None = None, learn_steps: int = 96,
             question_template: str | None = None, decode_weights: str | None = None,
             query_weights: str | None = None) -> dict:
    """Run every mode on the same questions of ``split`` (``tuning`` to choose settings,
    ``reporting`` to report them); returns the results (also written to ``out_dir``).
    ``cond:learned`` reads the learned prefix at ``prefix`` (a file); where there is none it is
    learned first (:func:`learn_eval_prefix`, ``learn_steps`` steps) and written there (or next
    to the checkpoint), so a resumed run uses the same one. ``question_template`` replaces the
    text after the documents (``"Question: {question}"``) on the synthetic sets: a framework's own
    prompt (:data:`QUESTION_TEMPLATES` names LlamaIndex's), whose words join the question's.
    ``decode_weights`` (``"int8"``, ``"bf16"``) decodes every mode's answer with those weights
    (:mod:`pcache_rag.models.fast_decode`), to set against a run without them on the same questions;
    ``query_weights="bf16"`` (with bf16 decode weights, as the RAG default runs) computes every cached
    mode's new and recomputed rows with them too (full prefill keeps the model's own weights)."""
    import tempfile

    import torch

    from ..default_model import load_model
    from ..recompute import Recompute

    for m in modes:
        base, _ = split_mode(m)
        if "+" in base:
            if base.partition("+")[2] not in ORACLE_MODES:
                Recompute.parse(base.partition("+")[2])
        elif base not in ("full", REORDERED, "isolated", "preamble") + OWN_MODES + ORACLE_MODES + COND_MODES:
            Recompute.parse(base)
    bad = set(sets) - set(SETS)
    if bad:
        raise ValueError(f"unknown eval sets {', '.join(sorted(bad))}: the sets are {', '.join(SETS)}")
    rag_sets = [s for s in sets if s in RAG_SETS]
    synthetic_only = sorted(m for m in modes if m in OWN_MODES or encoding_of(m).startswith("cond:corpus")
                            or store_of(m)[1])
    if rag_sets and synthetic_only:
        raise ValueError(f"the modes {', '.join(synthetic_only)} run on the synthetic sets only (not "
                         f"{', '.join(rag_sets)})")
    rag_only = sorted(m for m in modes if _cached_request_policy(m)[0] == "oracle:facts" and m not in FULL_MODES)
    if rag_only and set(sets) - set(RAG_SETS):
        raise ValueError(f"the modes {', '.join(rag_only)} run on the end-to-end sets only ({', '.join(RAG_SETS)}): "
                         "a synthetic set does not know its distractors' facts")
    question_template = QUESTION_TEMPLATES.get(question_template, question_template) if question_template else None
    if question_template is not None:
        if "{question}" not in question_template:
            raise ValueError("a question template needs a {question} placeholder")
        if rag_sets:
            raise ValueError(f"a question template applies to the synthetic sets only (the end-to-end sets "
                             f"{', '.join(rag_sets)} ask through CachedRAG's own prompt)")
    _split(split)
    if query_weights not in (None, "fp32") and decode_weights != query_weights:
        raise ValueError(f"query_weights={query_weights!r} reads the decode weights: give decode_weights={query_weights!r}")
    torch.manual_seed(seed)
    model, tok = load_model(model_path)
    if decode_weights is not None:
        from ..models.fast_decode import use_decode_weights

        rep = use_decode_weights(model, decode_weights, tok)
        if rep.fmt is None:
            raise RuntimeError(rep.refused)
    t_start = time.perf_counter()
    config = {"n_per_set": n, "doc_tokens": doc_tokens, "k": k, "max_new_tokens": max_new_tokens, "seed": seed,
              "split": split, "modes": list(modes), **({"decode_weights": decode_weights} if decode_weights else {}),
              **({"query_weights": query_weights} if query_weights not in (None, "fp32") else {}),
              "model": getattr(model.config, "_name_or_path", "") or model.config.model_type}
    results: dict[str, dict[str, ModeResult]] = {}
    syn = _Synthetic(model, tok, query_weights)
    if "query_weights" in config:  # what is in force (a CPU without bf16 dot products keeps fp32), not what was asked
        config["query_weights"] = syn.pcs["preamble"].core.query_weights
    if question_template is not None:  # in the config, so a checkpoint never mixes prompts
        syn.template = config["question_template"] = question_template
    learned = None
    if any(encoding_of(m).startswith("cond:learned") for m in modes):
        from ..conditioning import LearnedPrefix

        path = Path(prefix) if prefix else (Path(str(checkpoint) + ".prefix.safetensors") if checkpoint else None)
        if path is not None and path.exists():
            syn.prefix = LearnedPrefix.load(path)
            log(f"cond:learned: {syn.prefix.spec} from {path}")
        else:
            learned = learn_eval_prefix(syn, tok, doc_tokens, k, steps=learn_steps, seed=seed, log=log)
            syn.prefix = learned.prefix
            if path is not None:
                syn.prefix.save(path)
        config["prefix"] = syn.prefix.spec
    saved: dict[str, str] = {}
    if checkpoint and Path(checkpoint).exists():
        results, saved = _resume(Path(checkpoint), config, log)
    data = build_sets(tok, n, doc_tokens, k, seed, split)
    hashes = {name: inputs_hash(qs) for name, qs in data.items() if name in sets}
    _check_inputs(hashes, saved, checkpoint)
    for name in rag_sets:  # known without building its index again (a resumed, finished set)
        if name in saved:
            hashes[name] = saved[name]
    if any(encoding_of(m).startswith("cond:corpus") for m in modes):  # tokenizing the filler again costs seconds
        syn.corpus_passage = Filler(tok, doc_tokens).passage(_split(split)["passage"] + CORPUS_PASSAGE)
    tmp = None
    resumed = 0  # questions a checkpoint already held: answered by earlier runs, not timed in this one
    for set_name in sets:
        res = results.setdefault(set_name, {m: ModeResult() for m in modes})
        done = len(res[modes[0]].correct)
        resumed += min(done, n)
        if done >= n:
            continue
        if set_name in RAG_SETS:
            if tmp is None and workdir is None:
                tmp = tempfile.TemporaryDirectory(prefix="pcache-eval-")
            wd = Path(workdir if workdir is not None else tmp.name)  # type: ignore[union-attr]
            if set_name != "rag":  # each end-to-end set in a folder of its own (the rag set where it always was)
                wd = wd / set_name
            qs, rags, hashes[set_name] = _rag_set(model, tok, wd, n, doc_tokens, k, seed, split,
                                                  {encoding_of(m) for m in modes if m not in FULL_MODES},
                                                  prefix=syn.prefix, set_name=set_name, query_weights=query_weights)
            _check_inputs({set_name: hashes[set_name]}, saved, checkpoint)
            planted = {f for qq in qs for f in qq.facts}
        else:
            qs = data[set_name]
        for qi, q in enumerate(qs):
            if qi < done:  # answered before this run (resumed from the checkpoint)
                continue
            if set_name in RAG_SETS:
                outs, ttfts = _rag_answers(rags, modes, q, max_new_tokens, tok, planted)
            else:
                outs = syn.answers(modes, q, max_new_tokens)
                ttfts = [o.ttft_s for o in outs]
            for mode, out, ttft in zip(modes, outs, ttfts):
                r = res[mode]
                answer = answer_line(out.text)
                r.answers.append(answer)
                r.correct.append(contains(answer, q.answer))
                r.f1.append(token_f1(answer, q.answer))
                r.ttft.append(ttft)
                ctx = out.cached_tokens + out.recomputed_tokens
                r.recomputed.append(out.recomputed_tokens / ctx if ctx else (1.0 if mode in FULL_MODES else 0.0))
                r.prompt_tokens.append(out.cached_tokens + out.computed_tokens)
            if (qi + 1) % 10 == 0 or qi + 1 == len(qs):
                acc = {m: sum(res[m].correct) for m in modes}
                log(f"[{set_name}] {qi + 1}/{len(qs)} questions, {time.perf_counter() - t_start:.0f}s: " +
                    " ".join(f"{m}={c}" for m, c in acc.items()))
                if checkpoint:
                    _save(Path(checkpoint), config, results, hashes)
        syn.cache.clear()  # documents are not shared across sets: free their states
        if set_name in RAG_SETS:
            for rag in rags.values():
                rag.close()
    summary = summarize({s: results[s] for s in sets if s in results}, modes)
    summary["config"] = {**config, "seconds": round(time.perf_counter() - t_start, 1)}
    summary["input_hashes"] = hashes
    summary["machine"] = {"cpu": cpu_line(), "isa_caps": isa_caps()}  # not in config: a resume may run elsewhere
    summary["encode_tokens_per_s"] = syn.encode_rates()
    if syn.prefix is not None:
        summary["prefix"] = {"spec": syn.prefix.spec, **{key: syn.prefix.meta.get(key) for key in
                             ("kl_none", "kl_init", "kl_learned", "steps", "train_prompts", "val_prompts")},
                             "learn_seconds": round(learned.seconds, 1) if learned is not None else None}
    if checkpoint:
        summary["config"]["resumed_from"] = str(checkpoint)
        summary["config"]["resumed_questions"] = resumed
    if out_dir:  # "" (--out "") writes nowhere, as the help says
        write_report(summary, Path(out_dir))
    if tmp is not None:
        tmp.cleanup()
    return summary


def _run_time(cfg: dict) -> str:
    """How long the run took, as the report says it: a run resumed from a checkpoint timed only
    the questions it answered itself, so the report says how many it took over."""
    secs = cfg.get("seconds")
    if not isinstance(secs, (int, float)):
        return f"{secs if secs is not None else '?'}. "
    held = cfg.get("resumed_questions") or 0
    if held:
        return (f"{secs} s in this run, which resumed from a checkpoint holding {held} answered "
                f"question{'' if held == 1 else 's'} (answered and timed by earlier runs of the same settings). ")
    return f"{secs} s in one run. "


def _save(path: Path, config: dict, results: dict[str, dict[str, ModeResult]], hashes: dict[str, str]) -> None:
    """The checkpoint: the config, every answered question's record and each set's input hash,
    written atomically."""
    from dataclasses import asdict

    body = {"config": config, "records": {s: {m: asdict(r) for m, r in res.items()} for s, res in results.items()},
            "input_hashes": hashes}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


def _resume(path: Path, config: dict, log) -> tuple[dict[str, dict[str, ModeResult]], dict[str, str]]:
    """The records of a checkpoint written by a run with the same ``config``, and the input
    hashes it saved (none from older checkpoints); refuses another config."""
    try:
        body = json.loads(path.read_text())
        old = body["config"]
        records = body["records"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not an eval checkpoint ({e}); move it away to start afresh") from None
    if old != config:
        diff = sorted(k for k in set(old) | set(config) if old.get(k) != config.get(k))
        raise ValueError(f"{path} was written by a run with other settings ({', '.join(diff)}); "
                         "use the same settings to resume, or another checkpoint path")
    out = {s: {m: ModeResult(**r) for m, r in res.items()} for s, res in records.items()}
    log("resuming from " + str(path) + ": " + ", ".join(f"{s} {len(next(iter(res.values())).correct)} answered"
                                                        for s, res in out.items() if res))
    return out, dict(body.get("input_hashes") or {})


def _check_inputs(hashes: dict[str, str], saved: dict[str, str], checkpoint) -> None:
    """Refuse to resume a checkpoint whose sets were built from other inputs."""
    bad = sorted(s for s, h in hashes.items() if saved.get(s) not in (None, h))
    if bad:
        raise ValueError(f"{checkpoint} holds answers to other inputs for {', '.join(bad)} (their input hashes "
                         "differ): resume it with the same data, or use another checkpoint path")


def summarize(results: dict[str, dict[str, ModeResult]], modes) -> dict:
    out: dict = {"sets": {}}
    for set_name, res in results.items():
        full = res.get("full")
        rows = {}
        for m in modes:
            r = res[m]
            n = len(r.correct)
            if n == 0:
                continue
            c = sum(r.correct)
            lo, hi = wilson(c, n)
            med = statistics.median(r.ttft)
            row = {"n": n, "correct": c, "accuracy": c / n, "ci95": [lo, hi], "f1": statistics.fmean(r.f1),
                   "recomputed_fraction": statistics.fmean(r.recomputed), "median_ttft_s": med,
                   "median_prompt_tokens": statistics.median(r.prompt_tokens)}
            if full is not None and len(full.ttft) >= n:
                row["agreement"] = sum(a == b for a, b in zip(r.answers, full.answers)) / n
                row["speedup"] = statistics.median(full.ttft[:n]) / med if med else float("nan")
                row["mcnemar_p"] = mcnemar_p(r.correct, full.correct[:n])
            rows[m] = row
        out["sets"][set_name] = rows
    return out


def _set_table(rows: dict) -> list[str]:
    """One set's Markdown table (a row per mode, ✓ where it meets the bar: :data:`BAR_POINTS` of
    full prefill and a McNemar p of at least 0.05), and the line that says which settings
    beyond the plain cached modes meet it at :data:`BAR_SPEEDUP` times full prefill's speed."""
    lines = ["| mode | accuracy | 95% CI | McNemar p vs full | token F1 | agreement | recomputed | median TTFT | "
             "speed-up | prompt tokens |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = rows.get("full")
    meets = []
    for m, r in rows.items():
        within = ""
        if base is not None and m != "full":
            close = base["accuracy"] - r["accuracy"] <= BAR_POINTS / 100 + 1e-9
            within = " ✓" if close and r.get("mcnemar_p", 1.0) >= 0.05 else ""
            if (within and r.get("speedup", 0) >= BAR_SPEEDUP and m not in ("isolated", "preamble")
                    and m not in ORACLE_MODES and m not in FULL_MODES):
                meets.append(m)
        lines.append(
            f"| {m}{within} | {r['correct']}/{r['n']} = {r['accuracy']:.1%} | {r['ci95'][0]:.1%}–{r['ci95'][1]:.1%} "
            f"| {'—' if m == 'full' or 'mcnemar_p' not in r else format(r['mcnemar_p'], '.3f')} | {r['f1']:.3f} | {r.get('agreement', 1.0):.1%} | {r['recomputed_fraction']:.1%} "
            f"| {r['median_ttft_s'] * 1e3:.0f} ms | {r.get('speedup', 1.0):.1f}x | {r['median_prompt_tokens']:.0f} |")
    lines.append("")
    floor = rows.get(REORDERED, {}).get("agreement")
    if floor is not None:
        lines += [f"Agreement floor: full prefill agrees with itself on {floor:.1%} of answers when the documents "
                  "come in the reverse order; an agreement near it is as close to full prefill as presentation "
                  "order alone allows.", ""]
    if base is not None and any(m not in ("full", "isolated", "preamble") + ORACLE_MODES for m in rows):
        lines += [(f"Settings beyond the plain cached modes (recompute or conditioned encoding) that meet the bar "
                   f"(✓) at {BAR_SPEEDUP}x full prefill's speed or more: {', '.join(meets)}."
                   if meets else "No recompute or conditioned-encoding setting meets the bar (✓) at "
                   f"{BAR_SPEEDUP}x full prefill's speed or more on this set."), ""]
    return lines


def write_report(summary: dict, out_dir: Path, notes: list[str] = (),
                 appendix: list[tuple[str, str, dict]] = ()) -> tuple[Path, Path | None]:
    """``docs/quality.md`` (a table per set, after the paragraphs in ``notes``; then each
    ``(title, text, summary)`` of ``appendix`` as a section with its own tables) and
    ``docs/quality.png`` (accuracy vs speed-up of ``summary``'s sets)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = summary.get("config", {})
    lines = ["# Answer quality: cached vs full prefill, with selective recomputation", "",
             f"`pcache-rag eval quality`: {cfg.get('n_per_set', '?')} questions per set, documents of "
             f"~{cfg.get('doc_tokens', '?')} tokens, k={cfg.get('k', '?')}, greedy answers of at most "
             f"{cfg.get('max_new_tokens', '?')} tokens (the first line with text: a chat model stops at a line break, a "
             f"model without a chat template decodes them all), seed {cfg.get('seed', '?')}, model {cfg.get('model', '?')}; "
             + _run_time(cfg) + "Accuracy is answer-contained with a 95% Wilson interval; "
             "agreement is the share of answers equal to full prefill's; recomputed is the share of context "
             "tokens computed again; TTFT is the median and its speed-up is against full prefill in the same run. "
             "Each question's prompts are decoded in batches (`PromptCache.generate_batch`): full prefill "
             "in a batch of its own, so its answers do not depend on which other modes run, and the cached modes "
             "together. TTFT is each request's alone: where a batch holds several, each is prefilled again by "
             "itself for its first token (in a batch every first token waits for the whole batch's rows and "
             "questions).", ""]
    hashes = summary.get("input_hashes", {})
    if hashes:
        lines += [f"Split `{cfg.get('split', '?')}`. Inputs (a hash of each set's questions, answers and "
                  "documents; equal hashes mean identical inputs): "
                  + ", ".join(f"{s} `{h}`" for s, h in hashes.items()) + ".", ""]
    machine = summary.get("machine")
    if machine:
        caps = " ".join(f"{k}={v}" for k, v in machine.get("isa_caps", {}).items())
        lines += [f"Machine: {machine['cpu']}; instruction sets capped by {caps}." if caps else
                  f"Machine: {machine['cpu']}; no instruction-set caps.", ""]
    rates = summary.get("encode_tokens_per_s", {})
    if rates:
        lines += ["Ingest cost (synthetic sets' documents, encoded once each in this run): "
                  + ", ".join(f"{enc} {r:,.0f} tokens/s" for enc, r in rates.items()) + ".", ""]
    pre = summary.get("prefix")
    if pre:
        learned = (f", learned in this run in {pre['learn_seconds']:,.0f} s" if pre.get("learn_seconds") else
                   ", read from a file")
        lines += [f"`cond:learned` encodes the documents after the learned prefix `{pre['spec']}` ({pre.get('steps')} "
                  f"steps on {pre.get('train_prompts')} label-free prompts of filler no question uses{learned}; "
                  f"validation KL to full prefill: none {pre.get('kl_none')}, neutral passage {pre.get('kl_init')}, "
                  f"learned {pre.get('kl_learned')}).", ""]
    for note in notes:
        lines += [note, ""]
    for set_name, rows in summary["sets"].items():
        lines += [f"## {set_name}", ""] + _set_table(rows)
    for title, text, extra in appendix:
        lines += [f"## {title}", "", text, ""]
        for set_name, rows in extra["sets"].items():
            lines += [f"### {title}: {set_name}", ""] + _set_table(rows)
    lines += [f"✓: the bar of issue 20: at most {BAR_POINTS} points below full prefill, with an exact McNemar "
              "p of 0.05 or more against it on the same questions.", ""]
    md = out_dir / "quality.md"
    md.write_text("\n".join(lines))
    png = out_dir / "quality.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return md, None
    sets = list(summary["sets"])
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 3.8), squeeze=False)
    for ax, set_name in zip(axes[0], sets):
        for m, r in summary["sets"][set_name].items():
            x, y = r.get("speedup", 1.0), r["accuracy"] * 100
            lo, hi = r["ci95"][0] * 100, r["ci95"][1] * 100
            ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=3)
            ax.annotate(m, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xscale("log")
        ax.set_title(set_name)
        ax.set_xlabel("TTFT speed-up vs full prefill (log)")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return md, png
