"""``pcache-rag eval compare``: two or more models' eval runs side by side, on the questions they share.

Each run is an eval checkpoint (``eval quality --checkpoint FILE``): its config and every
answered question's record, in question order. The checkpoint does not hold the questions'
text, so they are drawn again from its config (split, seed, number of questions, document
length), with that model's own tokenizer, exactly as the run drew them. Two runs' questions
are paired by their text and gold answer. How many a set shares depends on the set:

* ``plain`` and ``competing`` draw every fact before they cut any document, so two runs on
  the same split and seed share every question (the documents around each fact are cut to
  ``doc_tokens`` by each model's tokenizer, so they differ at the edges);
* ``cross`` and ``rag`` interleave their draws with the cutting, so their questions part
  after the first few; they are reported on each run's own questions and marked so.

For every model and mode, the eval's own rows (:func:`~.quality.summarize`) on the shared
questions: accuracy with a 95% Wilson interval, the exact McNemar p against that model's own
full prefill on the same questions, agreement with its full prefill's answers, and the median
TTFT's speed-up over that full prefill.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: a set is compared one-to-one when the runs share at least this share of its questions
MIN_SHARED = 0.9


@dataclass(slots=True)
class Run:
    """One checkpoint: its name, config, records and each set's (question, gold answer) keys."""

    name: str
    path: Path
    config: dict
    records: dict  # set -> mode -> {"answers": [...], "correct": [...], ...}
    keys: dict  # set -> [(question, answer), ...] in record order


def question_keys(config: dict, sets) -> dict[str, list[tuple[str, str]]]:
    """Each set's ``(question, gold answer)`` in the order a run with ``config`` asked them,
    drawn again with the model's own tokenizer (named by ``config["model"]``)."""
    from transformers import AutoTokenizer

    from .quality import build_sets, rag_corpus

    model = config.get("model")
    try:
        tok = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"the questions of a run on {model!r} are drawn again with its tokenizer, which cannot be "
                         f"loaded here ({e})") from None
    n, doc, k, seed = config["n_per_set"], config["doc_tokens"], config["k"], config["seed"]
    split = config.get("split", "reporting")
    out: dict[str, list[tuple[str, str]]] = {}
    if set(sets) - {"rag"}:
        for name, qs in build_sets(tok, n, doc, k, seed, split).items():
            if name in sets:
                out[name] = [(q.question, q.answer) for q in qs]
    if "rag" in sets:
        with tempfile.TemporaryDirectory(prefix="pcache-compare-") as wd:
            qs, _, _ = rag_corpus(tok, Path(wd), n, doc, seed, split)
        out["rag"] = [(q.question, q.answer) for q in qs]
    return out


def load_run(path: str | Path) -> Run:
    """A checkpoint written by ``eval quality --checkpoint``, with its questions drawn again."""
    from ..default_model import model_name

    path = Path(path)
    try:
        body = json.loads(path.read_text())
        config, records = body["config"], body["records"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not an eval checkpoint ({e})") from None
    keys = question_keys(config, [s for s, res in records.items() if res])
    for s, res in records.items():
        for m, r in res.items():
            if len(r["correct"]) > len(keys.get(s, [])):
                raise ValueError(f"{path}: {s}/{m} holds {len(r['correct'])} answers but its config draws "
                                 f"{len(keys.get(s, []))} questions")
    return Run(model_name(config.get("model")), path, config, records, keys)


def compare_runs(runs: list[Run], modes=None) -> dict:
    """Every set the runs all hold: which questions they share, and each run's rows on them
    (on its own questions where they share fewer than :data:`MIN_SHARED` of them).
    ``modes``: the modes to report (default: every mode any run holds; a run without one
    shows it as not run)."""
    from .quality import ModeResult, summarize

    if len(runs) < 2:
        raise ValueError("compare needs two runs or more")
    sets = [s for s in runs[0].records if all(runs_i.records.get(s) for runs_i in runs)]
    held_anywhere = {m for r in runs for s in sets for m in r.records[s]}
    if missing := [m for m in (modes or ()) if m not in held_anywhere]:
        raise ValueError(f"no run holds the mode(s) {', '.join(missing)} (they hold {', '.join(sorted(held_anywhere))})")
    labels = [r.name if [x.name for x in runs].count(r.name) == 1 else f"{r.name} ({i + 1})" for i, r in enumerate(runs)]
    out: dict = {"runs": [{"name": label, "path": str(r.path), "config": r.config} for label, r in zip(labels, runs)],
                 "sets": {}, "not_in_every_run": sorted({s for r in runs for s, res in r.records.items() if res} - set(sets))}
    for s in sets:
        use = modes or list(dict.fromkeys(m for r in runs for m in r.records[s]))
        answered = [len(next(iter(r.records[s].values()))["correct"]) for r in runs]
        maps = [{key: i for i, key in enumerate(r.keys[s][:a])} for r, a in zip(runs, answered)]
        shared = [key for key in runs[0].keys[s][:answered[0]] if all(key in mp for mp in maps[1:])]
        one_to_one = len(shared) >= MIN_SHARED * min(answered)
        entry: dict = {"shared": len(shared), "answered": answered, "one_to_one": one_to_one, "rows": {}}
        for label, r, mp, a in zip(labels, runs, maps, answered):
            idx = [mp[key] for key in shared] if one_to_one else list(range(a))
            rec = r.records[s]
            pick = {m: ModeResult(**{f: [rec[m][f][i] for i in idx] for f in rec[m]}) for m in use if m in rec}
            entry["rows"][label] = summarize({s: pick}, list(pick))["sets"][s]  # the eval's own rows, on these questions
        out["sets"][s] = entry
    return out


def _cell(mode: str, row: dict) -> str:
    acc = f"{row['correct']}/{row['n']} = {row['accuracy']:.0%} ({row['ci95'][0]:.0%}–{row['ci95'][1]:.0%})"
    if mode == "full" or "mcnemar_p" not in row:
        return acc
    return (f"{acc}, p {row['mcnemar_p']:.3f}, agrees {row['agreement']:.0%}, {row['speedup']:.1f}x")


def markdown(result: dict) -> str:
    """The comparison as Markdown: one table per set, a column per run."""
    names = [r["name"] for r in result["runs"]]
    lines = ["# Answer quality, model by model, on the questions the runs share", "",
             "`pcache-rag eval compare` over the eval checkpoints "
             + ", ".join(f"`{r['path']}` ({r['name']}: {r['config'].get('n_per_set')} questions a set, split "
                         f"`{r['config'].get('split', 'reporting')}`, seed {r['config'].get('seed')})"
                         for r in result["runs"])
             + ". Each cell: accuracy (answer-contained) with its 95% Wilson interval; for a cached mode, the "
               "exact McNemar p against the same model's full prefill on the same questions, the share of "
               "answers equal to full prefill's, and the median time-to-first-token's speed-up over full prefill "
               "in the same run. Questions are paired by their text and gold answer; the "
               "documents around each fact are cut to the same number of tokens by each model's own tokenizer.",
             ""]
    for s, entry in result["sets"].items():
        lines += [f"## {s}", ""]
        if entry["one_to_one"]:
            lines += [f"The same {entry['shared']} questions for every model.", ""]
        else:
            lines += [f"**Not the same questions**: the runs share {entry['shared']} of them (this set's draws "
                      "depend on the tokenizer), so each column is its model's own "
                      + " / ".join(str(a) for a in entry["answered"]) + " questions of the same construction.", ""]
        modes = list(dict.fromkeys(m for rows in entry["rows"].values() for m in rows))
        lines += ["| mode | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for m in modes:
            lines.append(f"| {m} | " + " | ".join(_cell(m, entry["rows"][n][m]) if m in entry["rows"][n] else "not run"
                                                for n in names) + " |")
        lines.append("")
    if result.get("not_in_every_run"):
        lines += [f"Not compared (not answered in every run): {', '.join(result['not_in_every_run'])}.", ""]
    return "\n".join(lines)
