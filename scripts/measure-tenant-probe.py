"""The PIN probe of issue 59, measured: can one client tell whether another sent a text?

Client A sends a note holding a four-digit code in a system message (the note is learned from
the prompt). Client B then guesses the code, sending A's prompt with each guess in its place:
``--tries`` right guesses and as many wrong ones (each wrong guess a different code), in
alternation, on the embedded model. Each try is timed (time to first token) and its cached
tokens counted, in two settings in the same run:

* ``shared``: A and B are the same tenant, as every client was before tenants existed: what A
  taught is read for B (the side channel);
* ``tenants``: A and B are two tenants (two API keys on a server): a right guess is a first
  sight for B exactly as a wrong one is.

In ``tenants`` every try of B is a fresh tenant, so no try reads what B's own earlier tries
taught (in ``shared``, the prompt's opening is learned by the first call and read by every try,
right or wrong, alike). Prints medians and a one-sided Mann-Whitney U test per setting (is a
right guess faster than a wrong one?).

    .venv/bin/python scripts/measure-tenant-probe.py [--tries 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# run with the project's .venv: pcache_rag is installed there (make setup)
NOTE = ("Vault note for the night shift: the door code of the archive room is {pin}. Keep it to yourselves, and "
        "change it on the first Monday of every month. The spare key hangs in the boiler room behind the blue "
        "panel, and the alarm panel beside the archive door is reset with the same code.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from scipy.stats import mannwhitneyu

    from pcache_rag import PromptCache
    from pcache_rag.default_model import load_model
    from pcache_rag.docmodules import Assembler

    model, tok = load_model()
    pc = PromptCache(model, tok)
    asm = Assembler(pc)
    pin = "4417"
    wrong = [f"{n:04d}" for n in range(1000, 10000, 97)][: a.tries]

    def msgs(code: str) -> list[tuple[str, str]]:
        return [("system", "Answer from the notes.\n\n" + NOTE.format(pin=code)),
                ("user", "What is the door code of the archive room?")]

    def ask(tenant: str, code: str) -> tuple[float, int, int]:
        out = asm.generate(asm.message_segments(msgs(code), tenant=tenant), max_new_tokens=1)
        return out.ttft_s, out.cached_tokens, out.prompt_tokens

    ask("warm-up", "0000")  # the engine's first call
    rows = {}
    for setting in ("shared", "tenants"):
        victim = "victim" if setting == "tenants" else ""
        ask(victim, pin)  # A's note, learned for A
        right, wrong_t = [], []
        for i in range(a.tries):
            shared = setting == "shared"
            right.append(ask("" if shared else f"right-{i}", pin))
            wrong_t.append(ask("" if shared else f"wrong-{i}", wrong[i]))
        rt, wt = [r[0] for r in right], [w[0] for w in wrong_t]
        p = mannwhitneyu(rt, wt, alternative="less").pvalue
        rows[setting] = {"right_ttft_ms": round(1e3 * statistics.median(rt), 1),
                         "wrong_ttft_ms": round(1e3 * statistics.median(wt), 1),
                         "right_cached": sorted({r[1] for r in right}), "wrong_cached": sorted({w[1] for w in wrong_t}),
                         "prompt_tokens": right[0][2], "mannwhitney_p_right_faster": round(float(p), 4)}
        print(f"{setting:8} right guess: median TTFT {rows[setting]['right_ttft_ms']} ms, cached "
              f"{rows[setting]['right_cached']} of {right[0][2]}; wrong guess: {rows[setting]['wrong_ttft_ms']} ms, "
              f"cached {rows[setting]['wrong_cached']}; right faster than wrong: Mann-Whitney p = {p:.4f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"tries": a.tries, "settings": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
