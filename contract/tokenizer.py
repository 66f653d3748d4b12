"""The byte-level BPE tokenizer format of the embedded default model: special tokens, files, encode/decode.

It is trained on the training corpus by :mod:`dsv4.train.tokenizer`; this file is what the model
and its users need to read, write and apply one.

Why byte-level BPE: every string (any Unicode, any whitespace) round-trips exactly with no
unknown token, which a code-and-prose corpus needs, and it is the family DeepSeek-V4's own
tokenizer belongs to. The special tokens follow DeepSeek-V4's config: ``<｜begin▁of▁sentence｜>``
is id 0 (bos) and ``<｜end▁of▁sentence｜>`` id 1 (eos). There is no post-processor, so encoding
never adds tokens behind the caller's back: the runtime/training code adds bos/eos explicitly.

Reading (`read_tokenizer`, `read_tokenizer_config`) and encoding (`literal_ids`, `literal_ids_batch`
for text, `template_ids` for a rendered chat template) hold for any export's tokenizer (a released checkpoint's too, whose special
ids differ); `load_tokenizer`, `encode` and `decode` add the embedded format's bos/eos rules.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from .errors import ArtifactError

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "BOS_ID",
    "EOS_ID",
    "SPECIAL_TOKENS",
    "save_tokenizer",
    "read_tokenizer",
    "read_tokenizer_config",
    "load_tokenizer",
    "literal_ids",
    "literal_ids_batch",
    "template_ids",
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


def _tokenizer_file(path: str | Path) -> Path:
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def read_tokenizer(path: str | Path) -> Tokenizer:
    """Any ``tokenizer.json`` (or a directory containing it); ArtifactError naming the file when it
    cannot be read."""
    p = _tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises its own Exception type
        raise ArtifactError(f"{p}: cannot load the tokenizer ({e}); re-export it") from None


def read_tokenizer_config(path: str | Path) -> dict:
    """The ``tokenizer_config.json`` beside ``tokenizer.json`` (or in the directory): {} when there is
    none, ArtifactError when it is not valid JSON."""
    p = _tokenizer_file(path).with_name("tokenizer_config.json")
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{p} is not valid JSON ({e}); re-export it") from None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load the embedded format's ``tokenizer.json`` (or a directory containing it) and check the bos/eos ids."""
    tok = read_tokenizer(path)
    if tok.token_to_id(BOS_TOKEN) != BOS_ID or tok.token_to_id(EOS_TOKEN) != EOS_ID:
        raise ValueError(f"{_tokenizer_file(path)}: expected {BOS_TOKEN}=0 and {EOS_TOKEN}=1")
    return tok


def literal_ids(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` taken literally, nothing added: a special-token string written inside it
    (``<｜end▁of▁sentence｜>``) becomes ordinary byte tokens, so user text can never inject a control
    token and decode(literal_ids(s)) == s for every string. (This sets ``tok.encode_special_tokens``,
    which is not saved.)"""
    tok.encode_special_tokens = True
    return tok.encode(text, add_special_tokens=False).ids


def literal_ids_batch(tok: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """`literal_ids` of each text (encoded in parallel by tokenizers)."""
    tok.encode_special_tokens = True
    return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def template_ids(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of a rendered template (the chat template's output), whose special-token strings
    are the special tokens themselves; the tokenizer is left in literal mode, as `literal_ids` needs."""
    tok.encode_special_tokens = False
    try:
        return tok.encode(text, add_special_tokens=False).ids
    finally:
        tok.encode_special_tokens = True


def encode(tok: Tokenizer, text: str, bos: bool = False, eos: bool = False) -> list[int]:
    """`literal_ids` of ``text``, with the embedded format's bos/eos only when asked (nothing is added
    implicitly)."""
    return ([BOS_ID] if bos else []) + literal_ids(tok, text) + ([EOS_ID] if eos else [])


def decode(tok: Tokenizer, ids: Sequence[int]) -> str:
    """Text of ``ids``; bos/eos are dropped, everything else round-trips byte-exactly."""
    return tok.decode(list(ids), skip_special_tokens=True)
