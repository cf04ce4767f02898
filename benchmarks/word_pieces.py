"""Tokenizing a corpus's sentences with the tokenizer against putting them together from their words' ids.

    python benchmarks/word_pieces.py --docs 800 --tokenizer word --json results/cpu-word-pieces.json
    python benchmarks/word_pieces.py --docs 800 --tokenizer wordpiece --words 60,80   # within the model's 512

Fast inputs build a sentence's sub-token ids once (``flair_nbddp/worker/fast_inputs.py``): from its words' ids
(``flair_nbddp/worker/word_pieces.py``), or with the tokenizer itself for the sentences that cannot be (longer than
the model) and for the first ones, which are checked. This measures the two ways on the same generated reviews
(IMDB-length by default; the project's WordPiece and BPE tokenizers cut its made-up words so small that such a review
is longer than the model and goes to the tokenizer either way: ``--words`` shortens them), in batches of 32 as flair
embeds them, alternating for ``--rounds`` rounds: this process's CPU seconds
(the tokenizer's Rust threads included), and that both give the same ids. Each round starts with no word known.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

BATCH = 32


def measure(docs: int, kind: str, rounds: int, workdir: Path, words: tuple[int, int]) -> dict:
    from transformers import AutoTokenizer

    from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer
    from flair_nbddp.worker.fast_inputs import Settings, _tokenize
    from flair_nbddp.worker.word_pieces import WordPieces

    tokenizer = AutoTokenizer.from_pretrained(tiny_transformer(workdir / kind, tokenizer=kind))
    sentences = [[token.text for token in sentence] for sentence in sentiment_corpus(docs, 8, 8, words=words).train]
    batches = [sentences[start : start + BATCH] for start in range(0, len(sentences), BATCH)]
    settings = Settings(stride=0, overflow=False, truncation=True, word_ids=False)

    def tokenizer_way() -> list:
        return [rows[0][0] for batch in batches for rows in _tokenize(tokenizer, batch, settings)]

    def words_way() -> list:  # sentences longer than the model go to the tokenizer, as in fast inputs
        pieces, made = WordPieces(tokenizer), []
        for batch in batches:
            found = pieces.rows(batch, truncation=True, word_ids=False)
            long = [sentence for sentence, rows in zip(batch, found) if rows is None]
            tokenized = iter(_tokenize(tokenizer, long, settings))
            made += [(rows or next(tokenized))[0][0] for rows in found]
        return made

    seconds: dict[str, list[float]] = {"tokenizer": [], "words": []}
    same = True
    for _ in range(rounds):
        made = {}
        for name, way in (("tokenizer", tokenizer_way), ("words", words_way)):
            cpu = time.process_time()
            made[name] = way()
            seconds[name].append(round(time.process_time() - cpu, 4))
        same = same and all(list(a) == list(b) for a, b in zip(made["tokenizer"], made["words"]))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    longer = sum(rows is None for batch in batches for rows in WordPieces(tokenizer).rows(batch, True, False))
    return {
        "docs": docs, "review_words": list(words), "tokenizer": kind, "words": sum(map(len, sentences)), "model_max_length": tokenizer.model_max_length,
        "sentences_longer_than_the_model": longer, "cpu_s": seconds,
        "words_vs_tokenizer_cpu": round(medians["words"] / medians["tokenizer"], 4), "same_ids": same,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=800)
    parser.add_argument("--tokenizer", choices=["word", "wordpiece", "bpe"], default="wordpiece")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--words", default="200,260", help="the shortest and longest review, in words")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    low, high = map(int, args.words.split(","))
    figures = measure(args.docs, args.tokenizer, args.rounds, Path(tempfile.mkdtemp()), (low, high))
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
