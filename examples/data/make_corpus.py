"""Writes corpus.txt: a few hundred KB of plain English prose generated from templates with a fixed
seed (original text, no downloads), the default training corpus of examples/train_moe.py.

    python examples/data/make_corpus.py [--kb 320]
"""

import argparse
import os
import random

PLACES = ["the harbour", "the old mill", "the market square", "the hill above the town", "the river bank",
          "the lighthouse", "the orchard", "the library", "the railway station", "the quiet lane", "the forest edge",
          "the bakery", "the school yard", "the stone bridge", "the garden wall", "the village green"]
PEOPLE = ["the miller", "the young sailor", "the keeper", "an old woman", "the baker", "a tired traveller",
          "the schoolmaster", "the doctor", "a small boy", "the fisherman's daughter", "the clockmaker", "the captain",
          "the gardener", "a stranger in a grey coat", "the farmer", "the postman"]
ANIMALS = ["a black cat", "the old dog", "a flock of geese", "two white horses", "a fox", "the crows",
           "a heron", "the sheep", "a robin", "the bees"]
TIMES = ["In the morning", "At noon", "Late in the evening", "Before dawn", "On Sunday", "In the spring",
         "When the rain stopped", "After the storm", "At the end of summer", "On the first cold night"]
VERBS = ["walked to", "looked towards", "waited at", "came back from", "sang softly near", "hurried past",
         "sat down by", "painted a picture of", "spoke of", "remembered"]
ADJS = ["bright", "cold", "quiet", "golden", "grey", "warm", "strange", "gentle", "heavy", "clear"]
NOUNS = ["light", "wind", "sea", "sky", "bell", "road", "letter", "song", "lamp", "door", "field", "boat"]
THOUGHTS = ["that the year would be kind", "that the ships would return", "that nothing ever stays the same",
            "that the bread was better than ever", "that the clocks were a minute slow",
            "that the water was rising", "that someone had left the gate open", "that the letter would come"]


def sentence(rng: random.Random) -> str:
    kind = rng.randrange(7)
    p, q = rng.choice(PEOPLE), rng.choice(PEOPLE)
    if kind == 0:
        return f"{rng.choice(TIMES)}, {p} {rng.choice(VERBS)} {rng.choice(PLACES)}."
    if kind == 1:
        return f"The {rng.choice(ADJS)} {rng.choice(NOUNS)} fell over {rng.choice(PLACES)}, and {p} was glad."
    if kind == 2:
        return f"{p.capitalize()} said to {q}, \"I think {rng.choice(THOUGHTS)}.\""
    if kind == 3:
        return f"{rng.choice(ANIMALS).capitalize()} followed {p} along {rng.choice(PLACES)}."
    if kind == 4:
        n = rng.randrange(2, 12)
        near = f"{rng.choice(NOUNS)}s near {rng.choice(PLACES)}"
        return f"There were {n} {near}, each more {rng.choice(ADJS)} than the last."
    if kind == 5:
        return f"Nobody knew why {p} {rng.choice(VERBS)} {rng.choice(PLACES)} every day."
    return f"{p.capitalize()} believed {rng.choice(THOUGHTS)}, but {q} only smiled."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kb", type=int, default=320)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.txt"))
    args = ap.parse_args()
    rng = random.Random(1234)
    parts, size = [], 0
    while size < args.kb * 1024:
        para = " ".join(sentence(rng) for _ in range(rng.randrange(3, 8))) + "\n\n"
        parts.append(para)
        size += len(para)
    with open(args.out, "w", encoding="ascii") as f:
        f.write("".join(parts))
    print(f"wrote {size} bytes to {args.out}")


if __name__ == "__main__":
    main()
