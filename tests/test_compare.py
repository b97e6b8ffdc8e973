"""`pcache-rag eval compare`: two models' eval checkpoints side by side on the questions they
share, paired by question text and gold answer, each model's cached modes tested against its
own full prefill on those questions."""

import json

import pytest

from pcache_rag.cli import main
from pcache_rag.measure.compare import compare_runs, load_run, markdown
from pcache_rag.measure.quality import build_sets, mcnemar_p, wilson


def _checkpoint(path, model_dir, n, correct: dict, seed=0, sets=("plain",)):
    config = {"n_per_set": n, "doc_tokens": 48, "k": 4, "max_new_tokens": 4, "seed": seed, "split": "reporting",
              "modes": list(correct), "model": str(model_dir)}
    rec = {m: {"answers": [f"{m}-{i}" if not c else "same" for i, c in enumerate(cs)], "correct": cs,
               "f1": [0.0] * n, "ttft": [0.1] * n, "recomputed": [0.0] * n, "prompt_tokens": [100] * n}
           for m, cs in correct.items()}
    path.write_text(json.dumps({"config": config, "records": {s: rec for s in sets}}))
    return path


def test_runs_pair_on_shared_questions_with_intervals_and_paired_tests(smol_dir, smol_tok, tmp_path):
    a = _checkpoint(tmp_path / "a.json", smol_dir, 4, {"full": [True, True, False, True],
                                                       "cond:1": [False, True, False, False]})
    b = _checkpoint(tmp_path / "b.json", smol_dir, 3, {"full": [False, True, True],
                                                       "cond:1": [False, False, True], "epic:2": [True] * 3})
    ra, rb = load_run(a), load_run(b)
    # plain draws every fact before it cuts documents: 3 and 4 questions share the first 3
    assert ra.keys["plain"][:3] == rb.keys["plain"]
    assert ra.keys["plain"] == [(q.question, q.answer) for q in build_sets(smol_tok, 4, 48)["plain"]]
    res = compare_runs([ra, rb])
    plain = res["sets"]["plain"]
    assert plain["shared"] == 3 and plain["one_to_one"] and plain["answered"] == [4, 3]
    (na, rows_a), (nb, rows_b) = plain["rows"].items()
    assert na.endswith(" (1)") and nb.endswith(" (2)")  # one model twice: told apart
    assert rows_a["full"]["correct"] == 2 and rows_a["full"]["n"] == 3  # the 4th question is not shared
    assert rows_a["cond:1"]["mcnemar_p"] == mcnemar_p([False, True, False], [True, True, False])
    assert rows_b["cond:1"]["ci95"] == list(wilson(1, 3))
    assert rows_b["cond:1"]["agreement"] == 1 / 3  # both correct only on the last question: "same"
    assert "epic:2" not in rows_a and rows_b["epic:2"]["correct"] == 3
    with pytest.raises(ValueError, match="epic:9"):  # a mode no run holds is named, not dropped in silence
        compare_runs([ra, rb], modes=["full", "epic:9"])
    assert res["not_in_every_run"] == []
    text = markdown(res)
    assert "The same 3 questions for every model." in text and "| epic:2 | not run | 3/3 = 100% (44%–100%), p 1.000, agrees 67%, 1.0x |" in text


def test_other_draws_are_not_paired_and_the_cli_says_why_it_refuses(smol_dir, tmp_path, capsys):
    a = _checkpoint(tmp_path / "a.json", smol_dir, 3, {"full": [True] * 3, "cond:1": [False] * 3})
    c = _checkpoint(tmp_path / "c.json", smol_dir, 3, {"full": [False] * 3, "cond:1": [True] * 3}, seed=7)
    out = tmp_path / "cmp.md"
    assert main(["eval", "compare", str(a), str(c), "--out", str(out)]) == 0
    capsys.readouterr()
    text = out.read_text()
    assert "**Not the same questions**" in text and "3/3 = 100%" in text
    cross = _checkpoint(tmp_path / "x.json", smol_dir, 3, {"full": [True] * 3}, sets=("plain", "cross"))
    assert compare_runs([load_run(a), load_run(cross)])["not_in_every_run"] == ["cross"]  # said, not dropped
    assert main(["eval", "compare", str(a)]) == 2
    assert "two eval checkpoints or more" in capsys.readouterr().err
    gone = _checkpoint(tmp_path / "gone.json", tmp_path / "no-such-model", 3, {"full": [True] * 3})
    assert main(["eval", "compare", str(a), str(gone)]) == 1
    assert "cannot be loaded here" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["eval", "compare", str(a), str(tmp_path / "bad.json")]) == 1
    assert "not an eval checkpoint" in capsys.readouterr().err
    assert main(["eval", "quality", str(a)]) == 2  # files are compare's only
    assert "takes no files" in capsys.readouterr().err
