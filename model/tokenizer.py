"""A byte-level BPE tokenizer for the embedded default model, trained on :mod:`dsv4.model.corpus`.

Why byte-level BPE: every string (any Unicode, any whitespace) round-trips exactly with no
unknown token, which a code-and-prose corpus needs, and it is the family DeepSeek-V4's own
tokenizer belongs to. The special tokens follow DeepSeek-V4's config: ``<｜begin▁of▁sentence｜>``
is id 0 (bos) and ``<｜end▁of▁sentence｜>`` id 1 (eos). There is no post-processor, so encoding
never adds tokens behind the caller's back: the runtime/training code adds bos/eos explicitly.

Training is deterministic: the same texts and settings give byte-identical ``tokenizer.json``.

Run ``python -m dsv4.model.tokenizer`` to compare vocabulary sizes on the corpus eval split, and
``python -m dsv4.model.tokenizer --save DIR --vocab-size N`` to write one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "BOS_ID",
    "EOS_ID",
    "RECOMMENDED_VOCAB_SIZE",
    "train_tokenizer",
    "save_tokenizer",
    "load_tokenizer",
    "tokenizer_config",
    "encode",
    "decode",
]

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
BOS_ID = 0
EOS_ID = 1
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN)  # order gives the ids

# See the measurements in main(): 2048 is the best trade-off for a 5-20 M parameter model
# trained for a few CPU minutes on the ~1.2 M-character corpus.
RECOMMENDED_VOCAB_SIZE = 2048

# A plain-text prompt layout for services that call apply_chat_template. The embedded model is
# trained on documentation, not dialogue, so this only gives prompts a consistent shape.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n\n"
    "{% else %}Assistant: {{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


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
    n_base = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < n_base:
        raise ValueError(f"vocab_size must be at least {n_base} (special tokens + 256 bytes)")

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


def tokenizer_config(tok: Tokenizer, model_max_length: int = 4096) -> dict:
    """The ``tokenizer_config.json`` content Hugging Face loaders expect next to tokenizer.json.

    ``add_bos_token``/``add_eos_token`` are false because tokenizer.json has no post-processor;
    ``clean_up_tokenization_spaces`` is false because it would alter decoded text.
    """
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, directory: str | Path, model_max_length: int = 4096) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``; return it.

    Files are written with fixed formatting so identical tokenizers give identical bytes.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    cfg = tokenizer_config(tok, model_max_length=model_max_length)
    (out / "tokenizer_config.json").write_text(
        json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return out


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` (or a directory containing it) and check the bos/eos ids."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    tok = Tokenizer.from_file(str(p))
    if tok.token_to_id(BOS_TOKEN) != BOS_ID or tok.token_to_id(EOS_TOKEN) != EOS_ID:
        raise ValueError(f"{p}: expected {BOS_TOKEN}=0 and {EOS_TOKEN}=1")
    return tok


def encode(tok: Tokenizer, text: str, bos: bool = False, eos: bool = False) -> list[int]:
    """Token ids of ``text``, with bos/eos only when asked (nothing is added implicitly).

    The text is taken literally: a ``<｜end▁of▁sentence｜>`` written inside it becomes ordinary
    byte tokens, so user text can never inject a control token and decode(encode(s)) == s
    holds for every string. (This sets ``tok.encode_special_tokens``, which is not saved.)
    """
    tok.encode_special_tokens = True
    ids = tok.encode(text, add_special_tokens=False).ids
    return ([BOS_ID] if bos else []) + ids + ([EOS_ID] if eos else [])


def decode(tok: Tokenizer, ids: Sequence[int]) -> str:
    """Text of ``ids``; bos/eos are dropped, everything else round-trips byte-exactly."""
    return tok.decode(list(ids), skip_special_tokens=True)


def _count_tokens(tok: Tokenizer, docs: Sequence[str]) -> int:
    tok.encode_special_tokens = True
    return sum(len(e.ids) for e in tok.encode_batch(list(docs), add_special_tokens=False))


def main(argv: Sequence[str] | None = None) -> None:
    """Measure vocab sizes (training time, eval tokens/char) or save one tokenizer."""
    import argparse

    from dsv4.model.corpus import build_corpus

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
