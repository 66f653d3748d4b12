"""Training data: the corpus and tokenizer as token streams, batches cut from them, and the
prepared-data folder (`--save-data` here, `--data` on a GPU host whose Python gives other text)."""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dsv4.model.config import ModelConfig
from dsv4.contract.tokenizer import BOS_ID, EOS_ID, literal_ids_batch, load_tokenizer, save_tokenizer

from .config import TrainConfig

__all__ = ["token_stream", "BatchSampler", "prepare_data", "save_data", "DATA_STREAMS", "DATA_INFO"]

DATA_STREAMS = "streams.safetensors"
DATA_INFO = "corpus.json"


def token_stream(tok: Any, docs: Sequence[str]) -> torch.Tensor:
    """All documents as one int64 stream, each framed as bos + text + eos (how documents are seen)."""
    ids: list[int] = []
    for doc in literal_ids_batch(tok, docs):
        ids.append(BOS_ID)
        ids.extend(doc)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


class BatchSampler:
    """Deterministic random-access batches of `seq_len + 2` tokens (inputs, next, and t+2 targets).

    Epoch e cuts the stream into chunks at an offset drawn from a generator seeded by (seed, e) and
    visits them in a permutation from the same generator; batch `step` is chunks
    [step*B, (step+1)*B) of that sequence, so any step can be produced without replaying the others.
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self.stream, self.L, self.B, self.seed = stream, seq_len + 2, batch_size, seed
        self.per_epoch = (len(stream) - self.L) // self.L
        if self.per_epoch < 1:
            raise ValueError(f"stream of {len(stream)} tokens is too short for sequences of {self.L}")
        self._epoch: tuple[int, torch.Tensor] | None = None

    def _starts(self, epoch: int) -> torch.Tensor:
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            offset = int(torch.randint(0, self.L, (1,), generator=g))
            order = torch.randperm(self.per_epoch, generator=g)
            self._epoch = (epoch, offset + order * self.L)
        return self._epoch[1]

    def batch(self, step: int) -> torch.Tensor:
        rows = []
        for i in range(step * self.B, (step + 1) * self.B):
            s = int(self._starts(i // self.per_epoch)[i % self.per_epoch])
            rows.append(self.stream[s:s + self.L])
        return torch.stack(rows)


@dataclass(frozen=True)
class _CorpusInfo:
    """What the log records of a corpus whose token streams were prepared elsewhere (`--data`)."""

    sha256: str
    matches_reference: bool
    reference_sha256: str | None


def prepare_data(tcfg: TrainConfig, data: str | Path | None = None):
    """(corpus info, preset config, tokenizer, train stream, eval stream): built from the local
    stdlib (the corpus is checked against its reference hash), or loaded from a folder written by
    `save_data` (for a machine whose Python differs, e.g. the GPU host)."""
    cfg = ModelConfig.preset(tcfg.preset, quant_sim=tcfg.quant_sim)
    if data is not None:
        d = Path(data)
        info = json.loads((d / DATA_INFO).read_text())
        corpus: Any = _CorpusInfo(info["sha256"], info["matches_reference"], info["reference_sha256"])
        tok = load_tokenizer(d)
        streams = load_file(str(d / DATA_STREAMS))
        train_ids, eval_ids = streams["train"].long(), streams["eval"].long()
    else:
        from .corpus import build_corpus
        from .tokenizer import train_tokenizer

        corpus = build_corpus()
        tok = train_tokenizer(corpus.train_docs, vocab_size=cfg.vocab_size)
        train_ids, eval_ids = token_stream(tok, corpus.train_docs), token_stream(tok, corpus.eval_docs)
    if tok.get_vocab_size() != cfg.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, the preset {cfg.vocab_size}")
    return corpus, cfg, tok, train_ids, eval_ids


def save_data(tcfg: TrainConfig, directory: str | Path) -> Path:
    """Build the corpus, tokenizer and token streams here and write them for `--data`: tokenizer
    files, streams.safetensors (int32 train/eval streams) and corpus.json (hash, reference check)."""
    corpus, cfg, tok, train_ids, eval_ids = prepare_data(tcfg)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, out, model_max_length=cfg.max_seq_len)
    save_file({"train": train_ids.int().contiguous(), "eval": eval_ids.int().contiguous()}, str(out / DATA_STREAMS))
    (out / DATA_INFO).write_text(json.dumps({
        "sha256": corpus.sha256, "matches_reference": corpus.matches_reference,
        "reference_sha256": corpus.reference_sha256, "python": platform.python_version(),
        "train_tokens": len(train_ids), "eval_tokens": len(eval_ids)}, indent=1) + "\n")
    return out
