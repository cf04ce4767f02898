"""Offline training material: generated corpora and a tiny transformer built from a config.

Nothing here downloads anything, so tests, the demo and the notebooks run on a machine without
network. Every generator is deterministic for a given ``seed``, which matters under DDP: each rank
that builds the same corpus gets the same sentences.

Example:
    >>> from flair_nbddp.synthetic import sentiment_corpus
    >>> corpus = sentiment_corpus(n_train=40, n_dev=10, n_test=10, seed=1)
    >>> len(corpus.train), corpus.train[0].get_labels("sentiment")[0].value in {"POSITIVE", "NEGATIVE"}
    (40, True)
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigurationError

if TYPE_CHECKING:  # flair is imported lazily: the parent must not pay for it until it is needed
    from flair.data import Corpus

POSITIVE_WORDS = ["great", "wonderful", "superb", "moving", "brilliant", "charming", "delightful", "gripping"]
NEGATIVE_WORDS = ["awful", "boring", "dreadful", "clumsy", "tedious", "bland", "painful", "forgettable"]
FILLER_WORDS = [
    "the", "film", "story", "actor", "plot", "scene", "music", "camera", "director", "ending", "was", "felt",
    "quite", "really", "and", "but", "with", "a", "an", "of", "in", "this", "that", "it", "movie", "cast",
]
PERSON_NAMES = ["Anna", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jana"]
LOCATION_NAMES = ["Berlin", "Lisbon", "Osaka", "Quito", "Nairobi", "Oslo", "Lima", "Hanoi", "Perth", "Tunis"]
NER_TEMPLATES = [
    "{PER} travelled to {LOC} last spring .",
    "yesterday {PER} met {PER} in {LOC} .",
    "{LOC} welcomed {PER} with music .",
    "the letter from {PER} arrived in {LOC} on time .",
    "{PER} said that {LOC} is lovely in winter .",
]
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _review(rng: random.Random, positive: bool, n_words: int) -> str:
    """One review whose sentiment words mostly (3 in 4) agree with its label."""
    words = []
    for _ in range(n_words):
        if rng.random() < 0.2:
            agree = rng.random() < 0.75
            pool = POSITIVE_WORDS if positive == agree else NEGATIVE_WORDS
            words.append(rng.choice(pool))
        else:
            words.append(rng.choice(FILLER_WORDS))
    return " ".join(words)


def sentiment_corpus(
    n_train: int = 400,
    n_dev: int = 50,
    n_test: int = 50,
    words: tuple[int, int] = (12, 40),
    seed: int = 0,
    label_type: str = "sentiment",
) -> Corpus:
    """A binary sentiment corpus (``POSITIVE``/``NEGATIVE``) of generated movie reviews.

    Args:
        n_train, n_dev, n_test: number of documents per split.
        words: inclusive range of words per document; ``(200, 260)`` gives IMDB-length reviews.
        seed: the same seed always gives the same corpus.
        label_type: the label type the documents carry.

    Example:
        >>> corpus = sentiment_corpus(n_train=8, n_dev=2, n_test=2)
        >>> sorted(corpus.make_label_dictionary("sentiment", add_unk=False).get_items())
        ['NEGATIVE', 'POSITIVE']
    """
    from flair.data import Corpus, Sentence
    from flair.datasets import FlairDatapointDataset

    rng = random.Random(seed)

    def split(n: int) -> FlairDatapointDataset:
        sentences = []
        for i in range(n):
            positive = i % 2 == 0
            sentence = Sentence(_review(rng, positive, rng.randint(*words)), use_tokenizer=False)
            sentence.add_label(label_type, "POSITIVE" if positive else "NEGATIVE")
            sentences.append(sentence)
        rng.shuffle(sentences)
        return FlairDatapointDataset(sentences)

    return Corpus(split(n_train), split(n_dev), split(n_test), name="generated-sentiment", sample_missing_splits=False)


def ner_corpus(
    n_train: int = 300, n_dev: int = 40, n_test: int = 40, seed: int = 0, label_type: str = "ner", words: int = 1,
) -> Corpus:
    """A span-labelled NER corpus (``PER``, ``LOC``) of generated sentences.

    Args:
        n_train, n_dev, n_test: number of sentences per split.
        seed: the same seed always gives the same corpus.
        label_type: the label type the spans carry.
        words: a sentence joins templates until it has at least this many words (by default one template, 6-10
            words; ``40`` gives sentences of about 40 words with several names each).

    Example:
        >>> corpus = ner_corpus(n_train=4, n_dev=1, n_test=1)
        >>> sorted({span.tag for s in corpus.train for span in s.get_spans("ner")}) == ["LOC", "PER"]
        True
        >>> min(len(sentence) for sentence in ner_corpus(n_train=4, n_dev=1, n_test=1, words=40).train) >= 40
        True
    """
    from flair.data import Corpus, Sentence
    from flair.datasets import FlairDatapointDataset

    rng = random.Random(seed)

    def make() -> Sentence:
        tokens, spans = [], []
        while not tokens or len(tokens) < words:
            for word in rng.choice(NER_TEMPLATES).split():
                if word in ("{PER}", "{LOC}"):
                    tag = word[1:-1]
                    name = rng.choice(PERSON_NAMES if tag == "PER" else LOCATION_NAMES)
                    spans.append((len(tokens), tag))
                    tokens.append(name)
                else:
                    tokens.append(word)
        sentence = Sentence(tokens)
        for index, tag in spans:
            sentence[index : index + 1].add_label(label_type, tag)
        return sentence

    def split(n: int) -> FlairDatapointDataset:
        return FlairDatapointDataset([make() for _ in range(n)])

    return Corpus(split(n_train), split(n_dev), split(n_test), name="generated-ner", sample_missing_splits=False)


def vocabulary() -> list[str]:
    """Every word the generators can emit, lower-cased, after the special tokens."""
    words = POSITIVE_WORDS + NEGATIVE_WORDS + FILLER_WORDS + PERSON_NAMES + LOCATION_NAMES
    for template in NER_TEMPLATES:
        words += template.split()
    seen = dict.fromkeys(SPECIAL_TOKENS)
    seen.update(dict.fromkeys(w.lower() for w in words if not w.startswith("{")))
    return list(seen)


TRANSFORMER_SIZES = {
    # a few hundred thousand parameters: trains in seconds on CPU
    "tiny": {"dim": 32, "hidden_dim": 64, "n_layers": 2, "n_heads": 2},
    # distilbert-base-uncased's shape with a generated vocabulary, for throughput work on GPUs
    "distilbert": {"dim": 768, "hidden_dim": 3072, "n_layers": 6, "n_heads": 12},
}


TOKENIZER_KINDS = ("word", "wordpiece", "bpe")


def tiny_transformer(path: str | Path, size: str = "tiny", seed: int = 0, tokenizer: str = "word") -> str:
    """Write a randomly initialised transformer and its tokenizer, built offline, to ``path``.

    The directory loads like any Hugging Face model name, e.g.
    ``TransformerDocumentEmbeddings(tiny_transformer(tmp))``. Online, pass ``"distilbert-base-uncased"``
    instead to train the real thing.

    Args:
        path: directory to create (reused if it already holds a model).
        size: ``"tiny"`` for tests and CPU demos, ``"distilbert"`` for DistilBERT's shape.
        seed: seed of the random weights.
        tokenizer: ``"word"``: one token per word of the generators' vocabulary (DistilBERT); ``"wordpiece"``:
            BERT's WordPiece over letters and a few whole words, so most words are several sub-tokens
            (DistilBERT); ``"bpe"``: a byte-level BPE trained on generated text, as RoBERTa's (a RoBERTa model).

    Returns:
        ``str(path)``, ready to hand to flair's transformer embeddings.

    Example:
        >>> import tempfile
        >>> from transformers import AutoTokenizer
        >>> pieces = AutoTokenizer.from_pretrained(tiny_transformer(tempfile.mkdtemp(), tokenizer="wordpiece"))
        >>> pieces.tokenize("film")
        ['f', '##i', '##l', '##m']
    """
    import torch
    from transformers import (
        DistilBertConfig,
        DistilBertModel,
        RobertaConfig,
        RobertaModel,
    )

    if size not in TRANSFORMER_SIZES:
        raise ConfigurationError(f"size={size!r} is not one of {sorted(TRANSFORMER_SIZES)}")
    if tokenizer not in TOKENIZER_KINDS:
        raise ConfigurationError(f"tokenizer={tokenizer!r} is not one of {list(TOKENIZER_KINDS)}")
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return str(path)
    fast = _bpe_tokenizer() if tokenizer == "bpe" else _bert_tokenizer(tokenizer)
    torch.manual_seed(seed)
    shape = TRANSFORMER_SIZES[size]
    if tokenizer == "bpe":
        model = RobertaModel(RobertaConfig(
            vocab_size=len(fast), hidden_size=shape["dim"], intermediate_size=shape["hidden_dim"],
            num_hidden_layers=shape["n_layers"], num_attention_heads=shape["n_heads"], max_position_embeddings=514,
            pad_token_id=fast.pad_token_id, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
            type_vocab_size=1,
        ))  # fmt: skip
    else:
        model = DistilBertModel(DistilBertConfig(vocab_size=len(fast), max_position_embeddings=512, **shape))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def _bert_tokenizer(kind: str) -> Any:
    """A BERT-style tokenizer: whole words of the vocabulary, or WordPiece over letters and a few words."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = vocabulary()
    if kind == "word":
        tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    else:
        letters = [chr(code) for code in range(ord("a"), ord("z") + 1)] + [".", ","]
        pieces = [*SPECIAL_TOKENS, *letters, *(f"##{letter}" for letter in letters), *words[len(SPECIAL_TOKENS)::3]]
        words = list(dict.fromkeys(pieces))
        tokenizer = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", words.index("[CLS]")), ("[SEP]", words.index("[SEP]"))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=512,
    )  # fmt: skip


def _bpe_tokenizer() -> Any:
    """A byte-level BPE tokenizer (RoBERTa's kind) trained on generated reviews and NER sentences."""
    from tokenizers import ByteLevelBPETokenizer, processors
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    texts = [_review(rng, index % 2 == 0, 30) for index in range(200)]
    texts += [" ".join(vocabulary()[len(SPECIAL_TOKENS):])] * 3
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe = ByteLevelBPETokenizer(add_prefix_space=True)
    bpe.train_from_iterator(texts, vocab_size=320, min_frequency=2, special_tokens=specials, show_progress=False)
    bpe._tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        mask_token="<mask>", cls_token="<s>", sep_token="</s>", model_max_length=512,
    )  # fmt: skip
