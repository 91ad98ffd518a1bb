"""Make a small instruction dataset (messages JSONL) from the Shakespeare plays that ship in data/shakespeare.

Two tasks, both answerable from the text alone: name the play a speech comes from (a small answer space, so a
fine-tune's validation loss visibly falls within minutes), and give the reply that follows a speech (multi-turn:
the previous exchange is kept as context). Deterministic: the same files give the same samples.

    python scripts/shakespeare_sft.py --output runs/shakespeare_sft.jsonl [--samples 600]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEAKER = re.compile(r"^[A-Z][A-Za-z ]{0,24}\.$")  # "Hor." "ROMEO." "First Witch."
SYSTEM = "You are an assistant who knows Shakespeare's plays well. Answer briefly."


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, speech) blocks: a speaker line, then the lines up to the next blank line."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.strip().splitlines() if ln.strip()]
        if len(lines) >= 2 and SPEAKER.match(lines[0]):
            out.append((lines[0].rstrip("."), " ".join(lines[1:])))
    return out


def title(path: Path) -> str:
    return path.stem.replace("_", " ").title().replace("Nights", "Night's").replace("And", "and")


def build(samples: int) -> list[dict]:
    plays = sorted((ROOT / "data" / "shakespeare").glob("*.txt"))
    per_play = max(2, samples // (2 * len(plays)))
    rows = []
    for play in plays:
        blocks = [(s, t) for s, t in speeches(play.read_text(encoding="utf-8")) if 40 <= len(t) <= 240]
        step = max(1, len(blocks) // per_play)
        for i in range(0, min(len(blocks) - 1, step * per_play), step):
            speaker, speech = blocks[i]
            rows.append(
                {
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"Which play is this speech from?\n\n{speech}"},
                        {"role": "assistant", "content": f"{title(play)}. It is spoken by {speaker}."},
                    ]
                }
            )
            reply_speaker, reply = blocks[i + 1]
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": f'In {title(play)}, {speaker} says: "{speech}" Who answers?'},
                        {"role": "assistant", "content": f"{reply_speaker}."},
                        {"role": "user", "content": "And what does the reply say?"},
                        {"role": "assistant", "content": reply},
                    ]
                }
            )
    return rows[:samples]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--samples", type=int, default=600)
    args = ap.parse_args()
    rows = build(args.samples)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} conversations to {args.output}")


if __name__ == "__main__":
    main()
