"""Text around the token ids: the export's tokenizer, its chat template, stop strings, and
incremental detokenization (each new token costs a decode of a few tokens, not of the whole reply).

Torch-free: tokenizers (and jinja2 for the chat template).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from dsv4.contract.errors import EngineError, RequestError
from dsv4.contract.tokenizer import decode, literal_ids, read_tokenizer, read_tokenizer_config, template_ids

__all__ = ["TextCodec", "StopMatcher", "IncrementalDecoder"]


class TextCodec:
    """The tokenizer of an export (tokenizer.json, and tokenizer_config.json when present), read
    through the tokenizer format (dsv4.contract.tokenizer) with the export's own bos id."""

    def __init__(self, path: str | Path, bos_token_id: int | None):
        self.tokenizer = read_tokenizer(path)
        self.bos_token_id = bos_token_id
        self.config: dict = read_tokenizer_config(path)
        self.chat_template: str | None = self.config.get("chat_template")

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text`` taken literally (special-token strings inside it stay plain text)."""
        bos = self.bos_token_id
        return ([bos] if add_bos and bos is not None else []) + literal_ids(self.tokenizer, text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens dropped."""
        return decode(self.tokenizer, ids)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render the chat template and encode it: the template's own special tokens (bos) are
        recognised; message contents are inserted as given (the caller's messages are trusted)."""
        if not self.chat_template:
            raise RequestError("this export's tokenizer has no chat template")
        try:
            import jinja2
        except ImportError:
            raise EngineError("rendering the chat template needs jinja2 (pip install jinja2)") from None
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        try:
            text = env.from_string(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.config.get("bos_token") or "", eos_token=self.config.get("eos_token") or "")
        except jinja2.TemplateError as e:
            raise RequestError(f"the chat template cannot render these messages: {e}") from None
        return template_ids(self.tokenizer, text)


class IncrementalDecoder:
    """Turns a growing token list into text pieces: ``push(token)`` returns the text that token
    completed. Decodes only a short window (from the last token that began an emitted piece), so
    a step costs the same at token 10 and token 10,000; the concatenated pieces plus ``flush()``
    equal decoding all tokens at once. A token that ends inside a UTF-8 sequence (U+FFFD in the
    window) produces nothing until the sequence completes."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self.tokens: list[int] = []
        self._prefix = 0  # window start: the tokens before it are context for spacing only
        self._read = 0  # tokens up to here are already in the emitted text

    def push(self, token: int) -> str:
        self.tokens.append(token)
        before = self._decode(self.tokens[self._prefix:self._read])
        now = self._decode(self.tokens[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd") and now.startswith(before):
            self._prefix, self._read = self._read, len(self.tokens)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """The text held back so far (an incomplete UTF-8 tail shows as U+FFFD), at the end."""
        before = self._decode(self.tokens[self._prefix:self._read])
        now = self._decode(self.tokens[self._prefix:])
        self._prefix = self._read = len(self.tokens)
        return now[len(before):] if now.startswith(before) else ""


class StopMatcher:
    """Finds stop strings in a growing text and says how much of it is safe to emit so far.

    Text that could still turn into a stop string (a suffix that is a prefix of one) and a
    trailing U+FFFD (an incomplete UTF-8 sequence) are held back.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, start: int = 0) -> int | None:
        """Index where the earliest stop string starts (searching from ``start``), or None."""
        hits = [i for i in (text.find(s, max(0, start)) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def find_new(self, text: str, old_len: int) -> int | None:
        """Like `find`, for a text that was ``old_len`` characters long at the previous check (and
        had no stop string then): only the part a new stop string can overlap is searched."""
        return self.find(text, old_len - self.longest + 1) if self.stops else None

    def safe_len(self, text: str) -> int:
        """Length of the prefix of ``text`` that can be emitted without risking a stop string."""
        n = len(text)
        while n > 0 and text[n - 1] == "\ufffd":
            n -= 1
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, n), 0, -1):
                if text[n - k:n] == s[:k]:
                    hold = max(hold, k)
                    break
        return n - hold

