"""The byte-level BPE tokenizer format of the embedded default model: special tokens, files, encode/decode.

It is trained on the training corpus by :mod:`dsv4.train.tokenizer`; this file is what the model
and its users need to read, write and apply one.

Why byte-level BPE: every string (any Unicode, any whitespace) round-trips exactly with no
unknown token, which a code-and-prose corpus needs, and it is the family DeepSeek-V4's own
tokenizer belongs to. The special tokens follow DeepSeek-V4's config: ``<｜begin▁of▁sentence｜>``
is id 0 (bos) and ``<｜end▁of▁sentence｜>`` id 1 (eos). There is no post-processor, so encoding
never adds tokens behind the caller's back: the runtime/training code adds bos/eos explicitly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "BOS_ID",
    "EOS_ID",
    "SPECIAL_TOKENS",
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
