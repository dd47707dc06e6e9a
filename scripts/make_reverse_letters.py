"""Write configs/dataset/data/reverse_letters.jsonl: the dataset behind configs/dataset/reverse_letters.toml.

Rows are `{"prompt": "qzxwv", "answer": "vwxzq"}`, random lower-case strings of 3-8 letters (random letters rarely
merge into BPE tokens, so the tiny policy works letter by letter); the first 128 rows carry `"split": "eval"`.
Seeded and deduplicated, so every run writes the same file and no eval string appears in the train rows.

    python scripts/make_reverse_letters.py  # from the repository root
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "configs/dataset/data/reverse_letters.jsonl"
NUM_EVAL, NUM_TRAIN, MIN_LEN, MAX_LEN, SEED = 128, 1000, 3, 8, 0


def main() -> None:
    rng = random.Random(SEED)
    seen: set[str] = set()
    rows = []
    while len(rows) < NUM_EVAL + NUM_TRAIN:
        text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
        if text in seen:
            continue
        seen.add(text)
        row = {"prompt": text, "answer": text[::-1]}
        if len(rows) < NUM_EVAL:
            row["split"] = "eval"
        rows.append(row)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {OUT} ({NUM_EVAL} eval + {NUM_TRAIN} train rows)")


if __name__ == "__main__":
    main()
