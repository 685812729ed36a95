"""Builds jobs/data/demo.parquet: a few hundred varied prompts (deterministic), for `make demo`.

Run: .venv/bin/python jobs/make_demo_data.py
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TOPICS = [
    "photosynthesis",
    "the French Revolution",
    "black holes",
    "compound interest",
    "the water cycle",
    "machine learning",
    "the Roman Empire",
    "vaccines",
    "plate tectonics",
    "the stock market",
    "bread baking",
    "climate change",
    "the human heart",
    "electric cars",
    "the Renaissance",
    "honeybees",
    "the internet",
    "volcanoes",
    "chess openings",
    "the moon landing",
    "recycling",
    "sleep",
    "coffee",
    "the printing press",
    "jazz music",
    "rainforests",
    "solar panels",
    "the Olympic Games",
    "DNA",
    "earthquakes",
]
TASKS = [
    ("explain", "Explain {t} to a ten-year-old."),
    ("summary", "Write a short summary of {t}."),
    ("facts", "List three surprising facts about {t}."),
    ("poem", "Write a four-line poem about {t}."),
    ("question", "What is the most important thing to know about {t}?"),
    ("compare", "Compare {t} and {u} in two sentences."),
    ("story", "Tell a very short story that involves {t}."),
    ("advice", "Give one practical tip related to {t}."),
]
LONG_CONTEXT = (
    "Here are some notes a student wrote while studying. They are unordered and sometimes repeat themselves. "
    "Read them carefully before answering the question at the end. "
)


def make(n: int = 240, seed: int = 7) -> pa.Table:
    rng = random.Random(seed)
    ids, prompts, categories = [], [], []
    for i in range(n):
        kind, template = TASKS[i % len(TASKS)]
        t, u = rng.sample(TOPICS, 2)
        prompt = template.format(t=t, u=u)
        if rng.random() < 0.3:  # a share of long prompts, a few hundred tokens, for varied lengths
            notes = " ".join(
                f"Note {k + 1}: {rng.choice(TOPICS)} is related to {rng.choice(TOPICS)} in some way."
                for k in range(rng.randint(5, 25))
            )
            prompt = f"{LONG_CONTEXT}{notes}\nQuestion: {prompt}"
            kind = f"{kind}-long"
        ids.append(f"demo-{i:04d}")
        prompts.append(prompt)
        categories.append(kind)
    return pa.table({"id": ids, "prompt": prompts, "category": categories})


if __name__ == "__main__":
    out = Path(__file__).parent / "data" / "demo.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(make(), out)
    print(f"wrote {out}")
