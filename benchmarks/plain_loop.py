"""The GPU-bound ceiling: a plain PyTorch loop on throughput.py's model and batches, inputs tokenized once.

    python benchmarks/plain_loop.py --device cuda --size distilbert --docs 4000 --words 230 --precision fp32
    python benchmarks/plain_loop.py --device cuda --size distilbert --docs 4000 --words 230 --precision bf16

The model is what flair fine-tunes in ``throughput.py``: the transformer, its first sub-token's state (flair's
``cls_pooling``) and a linear layer, AdamW at 5e-5, gradients clipped to norm 5 (flair's ``max_grad_norm``), batches
of 32 in the corpus's order, each padded to its longest review. Everything is tokenized before the loop, and
nothing is read back from the device but the loss every ``--sync-every`` batches.

Two modes, one after the other on the same device: ``train`` (dropout on, as flair fine-tunes) and ``eval``
(``model.eval()``: no dropout, the loop of ``gpu_profile.py``'s ``pure`` mode, whose model ``from_pretrained``
left in eval mode). ``--compile`` compiles the transformer with ``torch.compile``. Each prints samples/s over the
epochs after the first five batches and the GPU's busy share. ``--trace DIR`` traces batches 10-19 of the first
mode's last epoch as ``throughput.py``'s ``BENCH_TRACE`` traces the kit's (``trace_gaps.py DIR`` reads both), so a
flair step and a plain one can be set side by side; traced runs are slower, so take rates from runs without it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from throughput import IMDB_WORDS, TRACED_BATCHES, BatchTracer, GpuBusy, make_corpus, word_range

BATCH = 32
WARM_BATCHES = 5


def batches(model_path: str, docs: int, words: tuple[int, int], device: str, task: str = "classify") -> list[tuple]:
    """Each batch's ids, mask, labels and (``task="tag"``) the positions of each word's first sub-token in the
    batch's flattened sub-tokens, on the device, tokenized once. A tagger's labels are each word's tag, as flair's
    SequenceTagger makes them (BIOES)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    sentences = list(make_corpus(docs, words, task).train)
    tags = {"O": 0}
    out = []
    for start in range(0, len(sentences), BATCH):
        chunk = sentences[start : start + BATCH]
        firsts = None
        if task == "tag":
            encoded = tokenizer([[t.text for t in s] for s in chunk], is_split_into_words=True, padding=True,
                                truncation=True, return_tensors="pt")  # fmt: skip
            width, firsts, labels = encoded["input_ids"].shape[1], [], []
            for row, sentence in enumerate(chunk):
                word_ids = encoded.word_ids(row)
                firsts += [row * width + at for at, word in enumerate(word_ids)
                           if word is not None and (at == 0 or word_ids[at - 1] != word)]  # fmt: skip
                words = ["O"] * len(sentence)
                for span in sentence.get_spans("ner"):
                    for token in span:  # the generated names are single words: S- in flair's BIOES
                        words[token.idx - 1] = f"S-{span.tag}"
                labels += [tags.setdefault(word, len(tags)) for word in words]
            firsts = torch.tensor(firsts).to(device)
            labels = torch.tensor(labels, dtype=torch.long)
        else:
            encoded = tokenizer([s.to_original_text() for s in chunk], padding=True, truncation=True,
                                return_tensors="pt")  # fmt: skip
            labels = torch.tensor([s.get_label("sentiment").value == "POSITIVE" for s in chunk], dtype=torch.long)
        out.append((encoded["input_ids"].to(device), encoded["attention_mask"].to(device), labels.to(device), firsts))
    return out


def train(
    model_path: str, data: list[tuple], mode: str, precision: str, epochs: int, sync_every: int, device: str,
    compiled: bool = False, trace: Path | None = None,
):
    """Samples/s of ``epochs`` epochs over ``data`` after the first batches, and when they ran; ``compiled``: the
    transformer compiled with ``torch.compile`` (in the first batch, which is not counted); ``trace``: a folder
    where batches 10-19 of the last epoch are traced (``throughput.py``'s ``BENCH_TRACE``, for ``trace_gaps.py``)."""
    import torch
    from transformers import AutoModel

    torch.manual_seed(42)
    encoder = AutoModel.from_pretrained(model_path).to(device)
    if compiled:
        encoder.compile()
    classes = max(int(batch[2].max()) for batch in data) + 1
    head = torch.nn.Linear(encoder.config.hidden_size, max(2, classes)).to(device)
    params = [*encoder.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=5e-5)
    encoder.train(mode == "train")
    head.train(mode == "train")
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16")
    loss_fn = torch.nn.CrossEntropyLoss()
    step = samples = 0
    started = None
    for epoch in range(epochs):
        tracer = BatchTracer(trace) if trace and epoch == epochs - 1 else None
        for batch_no, (ids, mask, labels, firsts) in enumerate(data):
            if tracer:
                tracer.before(batch_no)
            with autocast:
                hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
                features = hidden[:, 0] if firsts is None else hidden.flatten(0, 1)[firsts]  # first sub-tokens
                loss = loss_fn(head(features).float(), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 5.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % sync_every == 0:
                loss.item()
            if tracer:
                tracer.after(batch_no)
            if step == WARM_BATCHES:
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                started = time.time()
            elif step > WARM_BATCHES:
                samples += len(ids)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return samples / (time.time() - started), started, time.time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--task", choices=["classify", "tag"], default="classify",
                        help="throughput.py's task: a review's first sub-token, or each word's first sub-token")
    parser.add_argument("--size", choices=["tiny", "distilbert"], default="distilbert")
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--words", type=word_range, default=IMDB_WORDS, help="words a review: N, or A-B")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--modes", default="train,eval", help="train (dropout on), eval (off), in this order")
    parser.add_argument("--sync-every", type=int, default=1, help="read the loss back every N batches (flair: 1)")
    parser.add_argument("--compile", action="store_true", help="the transformer compiled with torch.compile")
    parser.add_argument("--workdir", default="/tmp/flair_nbddp-bench")
    parser.add_argument("--trace", type=Path, default=None,
                        help="a folder: batches 10-19 of the first mode's last epoch traced there, for trace_gaps.py")
    args = parser.parse_args()
    if args.trace and args.docs < TRACED_BATCHES.stop * BATCH:  # before a model is built or loaded
        parser.error(f"--trace records batches {TRACED_BATCHES.start}-{TRACED_BATCHES.stop - 1} of the last epoch: "
                     f"give --docs of at least {TRACED_BATCHES.stop * BATCH}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from flair_nbddp.synthetic import tiny_transformer

    model_path = tiny_transformer(Path(args.workdir) / f"model-{args.size}", size=args.size)
    data = batches(model_path, args.docs, args.words, args.device, args.task)
    for mode in args.modes.split(","):
        busy = GpuBusy() if args.device.startswith("cuda") else None
        rate, start, end = train(model_path, data, mode, args.precision, args.epochs, args.sync_every, args.device,
                                  args.compile, args.trace)
        args.trace = None
        figures = {
            "loop": "plain", "task": args.task, "mode": mode, "precision": args.precision,
            "samples_per_s": round(rate, 1),
            "gpu_busy_percent": busy.between(start, end) if busy else None, "size": args.size, "docs": args.docs,
            "words": args.words, "epochs": args.epochs, "sync_every": args.sync_every, "compiled": args.compile,
        }  # fmt: skip
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
