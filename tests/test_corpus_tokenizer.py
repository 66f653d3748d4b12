"""Corpus (CPython docs text) and byte-level BPE tokenizer: determinism, split, round trips."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsv4.contract.tokenizer import (
    BOS_ID,
    BOS_TOKEN,
    EOS_ID,
    EOS_TOKEN,
    decode,
    encode,
    load_tokenizer,
    save_tokenizer,
)
from dsv4.train.corpus import DOC_SEPARATOR, build_corpus
from dsv4.train.tokenizer import train_tokenizer

SMALL_VOCAB = 512
EDGE_CASES = [
    "",
    " ",
    "  leading and trailing  ",
    "\n",
    "\n\n\n",
    "\t\ttabs\tinside\t",
    "windows\r\nline\rendings\r\n",
    "    def f(x):\n        return x  # indented code\n",
    "naïve café — “quotes” ‘single’ … ß",
    "e\u0301 (combining) vs \u00e9 (precomposed)",
    "日本語のテキスト, 中文, 한국어",
    "emoji 🙂👍🏽 and ZWJ 👨\u200d👩\u200d👧",
    "\x00nul and \x7f del and \u200b zero width",
    "numbers 1234567890 3.14159 -0x1F",
    f"literal specials {BOS_TOKEN} and {EOS_TOKEN} stay text",
    "ĠĊ (byte-level alphabet characters themselves)",
]


@pytest.fixture(scope="module")
def corpus():
    return build_corpus()


@pytest.fixture(scope="module")
def small_train(corpus):
    # A slice of the training documents keeps tokenizer training well under a second.
    return list(corpus.train_docs[:300])


@pytest.fixture(scope="module")
def tok(small_train):
    return train_tokenizer(small_train, vocab_size=SMALL_VOCAB)


def test_corpus_deterministic(corpus, monkeypatch):
    # Libraries patch the stdlib on import (torch replaces inspect.getfile); the default build
    # reads docstrings in a fresh interpreter, so a patch in this process must not matter.
    import textwrap

    def dedent(text):
        """A patched docstring that must not reach the corpus."""
        return text

    dedent.__module__ = "textwrap"
    monkeypatch.setattr(textwrap, "dedent", dedent)
    again = build_corpus()
    assert again.sha256 == corpus.sha256
    assert again.train_docs == corpus.train_docs and again.eval_docs == corpus.eval_docs
    assert build_corpus(isolated=False).sha256 != corpus.sha256  # the patch is visible in-process


def test_corpus_matches_reference_when_recorded(corpus):
    """The shipped model was trained on the recorded reference corpus (train_log.json's hash), on
    every Python; a rebuild must reproduce it on the CPython release that hash belongs to (another
    release regenerates stdlib docstrings, so its corpus may differ: nothing more to compare)."""
    from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT

    reference = sys.modules[build_corpus.__module__].REFERENCE_SHA256
    log = json.loads((EMBEDDED_CHECKPOINT / "train_log.json").read_text())
    assert log["corpus_sha256"] in reference.values() and log["corpus_matches_reference"]
    if corpus.reference_sha256 is not None:
        assert corpus.matches_reference


def test_split_disjoint_and_sized(corpus):
    assert not set(corpus.train_keys) & set(corpus.eval_keys)
    assert not set(corpus.train_docs) & set(corpus.eval_docs)
    for doc in corpus.eval_docs:
        assert doc not in corpus.train_text  # not even as a substring
    s = corpus.sizes
    assert s["eval_docs"] >= 30 and s["eval_chars"] >= 20_000 and s["eval_words"] >= 3_000
    assert s["train_chars"] >= 500_000
    assert 0.02 <= s["eval_chars"] / (s["eval_chars"] + s["train_chars"]) <= 0.10
    assert corpus.train_text.split(DOC_SEPARATOR) == list(corpus.train_docs)
    assert corpus.eval_text.split(DOC_SEPARATOR) == list(corpus.eval_docs)


def test_corpus_text_normalized(corpus):
    for doc in corpus.train_docs + corpus.eval_docs:
        assert doc and doc == doc.strip()
        assert "\n\n\n" not in doc and "\t" not in doc and "\r" not in doc
        assert all(line == line.rstrip() for line in doc.split("\n"))


def test_tokenizer_round_trip(tok, corpus):
    for text in list(corpus.eval_docs) + EDGE_CASES:
        assert decode(tok, encode(tok, text)) == text, repr(text[:80])
    assert decode(tok, encode(tok, corpus.eval_text)) == corpus.eval_text


def test_special_ids_and_no_implicit_tokens(tok):
    assert tok.token_to_id(BOS_TOKEN) == BOS_ID == 0
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID == 1
    assert tok.get_vocab_size() == SMALL_VOCAB
    assert tok.post_processor is None
    ids = encode(tok, "hello world")
    assert BOS_ID not in ids and EOS_ID not in ids
    assert tok.encode("hello world").ids == ids  # the raw API adds nothing either
    wrapped = encode(tok, "hello world", bos=True, eos=True)
    assert wrapped == [BOS_ID, *ids, EOS_ID]
    assert decode(tok, wrapped) == "hello world"
    # A literal special-token string in user text is not turned into the control token.
    assert EOS_ID not in encode(tok, f"x{EOS_TOKEN}y")


def test_tokenizer_training_deterministic(small_train, tok, tmp_path):
    a = save_tokenizer(tok, tmp_path / "a") / "tokenizer.json"
    b = save_tokenizer(train_tokenizer(small_train, vocab_size=SMALL_VOCAB), tmp_path / "b")
    assert a.read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (tmp_path / "a" / "tokenizer_config.json").read_bytes() == (
        b / "tokenizer_config.json"
    ).read_bytes()

    # Another process (other hash seed, one Rayon thread) must give the same bytes.
    code = (
        "import sys\n"
        "from dsv4.contract.tokenizer import save_tokenizer\n"
        "from dsv4.train.corpus import build_corpus\n"
        "from dsv4.train.tokenizer import train_tokenizer\n"
        f"docs = list(build_corpus().train_docs[:{len(small_train)}])\n"
        f"save_tokenizer(train_tokenizer(docs, vocab_size={SMALL_VOCAB}), sys.argv[1])\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", RAYON_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], check=True, env=env)
    assert a.read_bytes() == (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_save_load(tok, tmp_path, corpus):
    d = save_tokenizer(tok, tmp_path / "tok", model_max_length=512)
    loaded = load_tokenizer(d)
    assert load_tokenizer(d / "tokenizer.json").to_str() == loaded.to_str() == tok.to_str()
    text = corpus.eval_docs[0]
    assert encode(loaded, text) == encode(tok, text)
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["bos_token"] == BOS_TOKEN and cfg["eos_token"] == EOS_TOKEN
    assert cfg["model_max_length"] == 512
    assert cfg["add_bos_token"] is False and cfg["clean_up_tokenization_spaces"] is False


def test_reading_any_tokenizer_and_the_encoding_modes(tok, tmp_path):
    from dsv4.contract.errors import ArtifactError
    from dsv4.contract.tokenizer import (literal_ids, literal_ids_batch, read_tokenizer, read_tokenizer_config,
                                         template_ids)
    from dsv4.runtime.text import TextCodec

    d = save_tokenizer(tok, tmp_path / "tok")
    assert read_tokenizer(d).to_str() == tok.to_str()
    assert read_tokenizer_config(d / "tokenizer.json")["eos_token"] == EOS_TOKEN
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "tokenizer.json").write_text(tok.to_str())
    assert read_tokenizer_config(tmp_path / "bare") == {}  # no tokenizer_config.json: nothing to read
    (tmp_path / "bare" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="tokenizer_config.json is not valid JSON"):
        read_tokenizer_config(tmp_path / "bare")
    (tmp_path / "bare" / "tokenizer.json").write_text(tok.to_str()[:100])
    with pytest.raises(ArtifactError, match="bare/tokenizer.json: cannot load the tokenizer"):
        read_tokenizer(tmp_path / "bare")

    # literal: a special-token string is text; template: it is the special token (tokenizers' own modes)
    text = f"a{EOS_TOKEN}b"
    tok.encode_special_tokens = True
    want_literal = tok.encode(text, add_special_tokens=False).ids
    tok.encode_special_tokens = False
    want_template = tok.encode(text, add_special_tokens=False).ids
    assert EOS_ID in want_template and EOS_ID not in want_literal
    assert template_ids(tok, text) == want_template and tok.encode_special_tokens  # left in literal mode
    assert literal_ids(tok, text) == want_literal
    assert literal_ids_batch(tok, [text, "hello"]) == [want_literal, literal_ids(tok, "hello")]
    # the runtime's codec: the export's own bos id, the same literal ids
    codec = TextCodec(d / "tokenizer.json", bos_token_id=7)
    assert codec.encode(text) == [7, *want_literal] and codec.encode(text, add_bos=False) == want_literal
    assert codec.decode([BOS_ID, *want_template]) == "ab"
