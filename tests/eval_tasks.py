"""Task files in llama-perplexity's three formats, made from the shared texts (seeded: the
same files every run), for test_evaluation.py and record_llama_cpp_eval.py.

    python tests/eval_tasks.py      # (re)writes tests/data/eval_{hellaswag.txt,winogrande.csv,mc.bin}

and a small file of each format, its first few tasks (eval_*_small.*), for the larger model.

- HellaSwag: a TinyStories story's opening sentences as the context, its next sentence as
  the right ending among three wrong ones: sentences of other stories and the right one
  with its words shuffled.
- Winogrande: a sentence of a story with two named characters, one name blanked; the
  choices are both names. Sentences with commas are quoted, as in the real CSV.
- Multiple choice: fill-in-the-blank questions on TinyStories and WikiText sentences, with
  2 to 4 answers (the word that was there and words from other sentences).
"""
from __future__ import annotations

import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llamapy.evaluation.multiple_choice import to_bytes  # noqa: E402
from llamapy.evaluation.records import MultipleChoiceTask  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DATA = Path(__file__).parent / "data"
FILES = {"hellaswag": "eval_hellaswag.txt", "winogrande": "eval_winogrande.csv", "multiple-choice": "eval_mc.bin"}
SMALL_FILES = {kind: name.replace(".", "_small.") for kind, name in FILES.items()}
N_HELLASWAG, N_WINOGRANDE, N_MC = 120, 120, 60
N_SMALL = {"hellaswag": 4, "winogrande": 10, "multiple-choice": 5}  # (Winogrande reads 9: not the last line)
NAMES = ("Lily", "Timmy", "Tim", "Lucy", "Jack", "Tom", "Max", "Jane", "Sarah", "Sue", "Bob", "Joe", "John", "Amy",
         "Mia", "Ben", "Anna", "Sam", "Mom", "Dad")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def stories(shared: Path = SHARED_DATA) -> list[list[str]]:
    """TinyStories' stories as lists of sentences (without quotes, which the formats need not
    carry), each 20 to 160 characters."""
    text = (shared / "tinystories_sample.txt").read_text(encoding="utf-8")
    out = []
    for story in text.split("<|endoftext|>"):
        sentences = [s.strip() for s in _SENTENCE_END.split(story.replace("\n", " ")) if s.strip()]
        sentences = [s for s in sentences if '"' not in s and 20 <= len(s) <= 160]
        if len(sentences) >= 4:
            out.append(sentences)
    return out


def wiki_sentences(shared: Path = SHARED_DATA) -> list[str]:
    text = (shared / "wiki.test.raw").read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("=")]
    sentences = [s for line in lines for s in _SENTENCE_END.split(line)]
    return [s for s in sentences if 40 <= len(s) <= 140 and '"' not in s and "@" not in s]


def hellaswag_text(rng: random.Random, corpus: list[list[str]], n: int = N_HELLASWAG) -> str:
    lines = []
    for story in rng.sample(corpus, n):
        k = rng.randint(1, min(2, len(story) - 1))
        right = story[k]
        words = right.rstrip(".!?").split()
        shuffled = " ".join(rng.sample(words, len(words))) + "."
        others = [rng.choice(rng.choice(corpus)) for _ in range(2)]
        endings = [right, shuffled, *others]
        order = list(range(4))
        rng.shuffle(order)
        lines += ["Story: " + " ".join(story[:k]), str(order.index(0)), *(endings[i] for i in order)]
    return "\n".join(lines) + "\n"


def winogrande_text(rng: random.Random, corpus: list[list[str]], n: int = N_WINOGRANDE) -> str:
    word = {name: re.compile(rf"\b{name}\b") for name in NAMES}
    candidates = []
    for story in corpus:
        text = " ".join(story)
        names = [name for name in NAMES if name in text and any(word[name].search(s) for s in story)]
        if len(names) < 2:
            continue
        for sentence in story:
            found = [name for name in names if name in sentence and len(word[name].findall(sentence)) == 1]
            if len(found) == 1 and "_" not in sentence:
                candidates.append((sentence, found[0], rng.choice([x for x in names if x != found[0]])))
    rows = []
    for i, (sentence, name, other) in enumerate(rng.sample(candidates, n)):
        blanked = re.sub(rf"\b{name}\b", "_", sentence, count=1)
        if "," in blanked:
            blanked = f'"{blanked}"'
        choices = [name, other]
        rng.shuffle(choices)
        rows.append(f"{i},{blanked},{choices[0]},{choices[1]},{choices.index(name) + 1}")
    return "\n".join(rows) + "\n"


def mc_tasks(rng: random.Random, corpus: list[list[str]], wiki: list[str], n: int = N_MC) -> list[MultipleChoiceTask]:
    pool = [s for story in corpus for s in story] + wiki
    words = sorted({w for s in pool for w in re.findall(r"\b[a-z]{4,}\b", s)})
    tasks = []
    while len(tasks) < n:
        source = rng.choice(wiki) if len(tasks) % 3 == 2 else rng.choice(rng.choice(corpus))
        blanks = re.findall(r"\b[a-z]{4,}\b", source)
        if not blanks:
            continue
        word = rng.choice(blanks)
        question = "Fill in the blank: " + re.sub(rf"\b{word}\b", "___", source, count=1) + " Answer:"
        wrong = rng.sample([w for w in words if w != word], rng.randint(1, 3))
        answers = [word, *wrong]
        rng.shuffle(answers)
        tasks.append(MultipleChoiceTask(question=question, answers=tuple(answers),
                                        labels=tuple(int(a == word) for a in answers)))
    return tasks


def generate(shared: Path = SHARED_DATA) -> dict[str, bytes]:
    """Every file's contents, by file name."""
    corpus = stories(shared)
    hellaswag = hellaswag_text(random.Random(1), corpus)
    winogrande = winogrande_text(random.Random(2), corpus)
    mc = mc_tasks(random.Random(3), corpus, wiki_sentences(shared))
    first_lines = lambda text, n: "".join(text.splitlines(keepends=True)[:n])  # noqa: E731
    return {FILES["hellaswag"]: hellaswag.encode(), FILES["winogrande"]: winogrande.encode(),
            FILES["multiple-choice"]: to_bytes(mc),
            SMALL_FILES["hellaswag"]: first_lines(hellaswag, 6 * N_SMALL["hellaswag"]).encode(),
            SMALL_FILES["winogrande"]: first_lines(winogrande, N_SMALL["winogrande"]).encode(),
            SMALL_FILES["multiple-choice"]: to_bytes(mc[:N_SMALL["multiple-choice"]])}


def main() -> None:
    for name, data in generate().items():
        (DATA / name).write_bytes(data)
        print(f"{DATA / name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
