"""Text <-> token ids through the checkpoint's tokenizer.json (the `tokenizers` library)."""

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from hybridjit.gguf_file import is_gguf


class Tokenizer:
    def __init__(self, directory: Path, bos_token_id: int | None):
        path = directory / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise ValueError(f"{path}: cannot be read as a tokenizer ({e})") from None
        settings = read_json(directory / "tokenizer_config.json")
        # DeepSeek's tokenizer.json has no post-processor: the BOS comes from tokenizer_config.json.
        self.add_bos = bool(settings.get("add_bos_token", False)) and bos_token_id is not None
        self.bos_token_id = bos_token_id
        self.chat_template: str | None = settings.get("chat_template")

    @classmethod
    def from_tokenizer(
        cls, tok: HFTokenizer, bos_token_id: int | None, add_bos: bool, chat_template: str | None = None
    ) -> "Tokenizer":
        """A tokenizer built in memory (a GGUF file's, hybridjit/gguf_tokenizer.py)."""
        self = cls.__new__(cls)
        self._tok, self.bos_token_id, self.chat_template = tok, bos_token_id, chat_template
        self.add_bos = add_bos and bos_token_id is not None
        return self

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(check_unicode(text), add_special_tokens=True).ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


def no_tokenizer(path) -> str:
    """What a checkpoint without a tokenizer lacks, for the errors that need one: tokenizer.json in a checkpoint
    directory, the tokenizer.ggml.* metadata in a GGUF file."""
    lacking = "tokenizer.ggml.* metadata" if is_gguf(path) else "tokenizer.json"
    return f"{path} has no tokenizer ({lacking})"


def check_unicode(text: str) -> str:
    """`text`, if it is valid Unicode; else a ValueError naming its first lone surrogate (JSON's "\\ud800" escape
    decodes to one, which no tokenizer or UTF-8 writer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = f"a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start}"
        raise ValueError(f"not valid Unicode: {where}") from None
    return text


class IncrementalDecoder:
    """Turns a growing token list into text deltas. Holds back an incomplete UTF-8 sequence, and any tail of
    the text that may still turn out to begin a stop string; once a stop string appears, `stopped` is set and
    no part of it is ever emitted."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.ids: list[int] = []
        self.text = ""  # the decoded text, as of its last complete character
        self.emitted = 0
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        self.text = text
        cut = first_stop(text, self.stops)
        self.stopped = cut is not None
        return self._emit(cut if self.stopped else len(text) - stop_prefix_length(text, self.stops))

    def flush(self) -> str:
        """What was held back for a stop string that never came: call it once generation has ended."""
        return "" if self.stopped else self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string in `text` begins (None: there is none), so that text[:first_stop] is the
    text before it."""
    return min((text.index(s) for s in stops if s in text), default=None)


def stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """The length of the longest tail of `text` that begins a stop string (and so may still become one)."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def load_tokenizer(directory: Path, bos_token_id: int | None) -> Tokenizer | None:
    return Tokenizer(directory, bos_token_id) if (directory / "tokenizer.json").exists() else None


def read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
