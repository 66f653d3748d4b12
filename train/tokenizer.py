"""Train the byte-level BPE tokenizer of the embedded default model on the corpus (`corpus.py`).

The tokenizer's format (special tokens, ids, files, encode/decode) is the model's and lives in
`dsv4.contract.tokenizer`; training it is this file. Training is deterministic: the same texts and
settings give a byte-identical ``tokenizer.json``.

Run ``python -m dsv4.train.tokenizer`` to compare vocabulary sizes on the corpus eval split, and
``python -m dsv4.train.tokenizer --save DIR --vocab-size N`` to write one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv4.contract.tokenizer import (BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN, SPECIAL_TOKENS, literal_ids_batch,
                                     save_tokenizer)

__all__ = ["RECOMMENDED_VOCAB_SIZE", "MIN_VOCAB_SIZE", "train_tokenizer", "corpus_tokenizer"]

# See the measurements in main(): 2048 is the best trade-off for a 5-20 M parameter model
# trained for a few CPU minutes on the ~1.2 M-character corpus.
RECOMMENDED_VOCAB_SIZE = 2048
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())  # specials + 256 bytes


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = RECOMMENDED_VOCAB_SIZE,
    min_frequency: int = 2,
    max_token_length: int | None = 16,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer with bos=0 and eos=1.

    ``texts`` are documents (BPE merges never cross document boundaries). All 256 byte symbols
    are in the initial alphabet, so nothing is ever unknown. ``max_token_length`` keeps the small
    vocabulary from being spent on long verbatim strings that occur a few times in the corpus.
    """
    texts = list(texts)
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (special tokens + 256 bytes)")

    tok = Tokenizer(models.BPE())
    # use_regex splits words/numbers/punctuation/whitespace runs before BPE (GPT-2 style).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=max_token_length,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.token_to_id(BOS_TOKEN) != BOS_ID or tok.token_to_id(EOS_TOKEN) != EOS_ID:
        raise RuntimeError("special tokens did not get ids 0/1")
    return tok


@functools.lru_cache(maxsize=4)
def corpus_tokenizer(vocab_size: int = RECOMMENDED_VOCAB_SIZE) -> Tokenizer:
    """The tokenizer trained on the corpus's training documents (cached per vocab size): what the
    embedded model uses at 2048, and what `dsv4 checkpoint make` ships with a random checkpoint."""
    from .corpus import build_corpus

    return train_tokenizer(build_corpus().train_docs, vocab_size=vocab_size)


def _count_tokens(tok: Tokenizer, docs: Sequence[str]) -> int:
    return sum(len(ids) for ids in literal_ids_batch(tok, docs))


def main(argv: Sequence[str] | None = None) -> None:
    """Measure vocab sizes (training time, eval tokens/char) or save one tokenizer."""
    import argparse

    from .corpus import build_corpus

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--save", metavar="DIR", help="train --vocab-size on the train split and save")
    ap.add_argument("--vocab-size", type=int, default=RECOMMENDED_VOCAB_SIZE)
    args = ap.parse_args(argv)

    corpus = build_corpus()
    print(f"corpus sha256 {corpus.sha256} (python {corpus.python_version})")
    if args.save:
        tok = train_tokenizer(corpus.train_docs, vocab_size=args.vocab_size)
        print(f"wrote {save_tokenizer(tok, args.save)}")
        return

    eval_chars = len(corpus.eval_text)
    train_chars = len(corpus.train_text)
    print(f"{'vocab':>6} {'train s':>8} {'eval tok/char':>14} {'eval tokens':>12} {'train tok':>10}")
    for vs in args.vocab_sizes:
        t0 = time.perf_counter()
        tok = train_tokenizer(corpus.train_docs, vocab_size=vs)
        dt = time.perf_counter() - t0
        n_eval = _count_tokens(tok, corpus.eval_docs)
        n_train = _count_tokens(tok, corpus.train_docs)
        print(f"{vs:>6} {dt:>8.2f} {n_eval / eval_chars:>14.4f} {n_eval:>12,} {n_train:>10,}")
    print(f"train chars {train_chars:,}, eval chars {eval_chars:,}")


if __name__ == "__main__":
    main()
