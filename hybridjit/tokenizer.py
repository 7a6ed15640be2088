"""Text <-> token ids through the checkpoint's tokenizer.json (the `tokenizers` library)."""

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, directory: Path, bos_token_id: int | None):
        path = directory / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise ValueError(f"{path}: cannot be read as a tokenizer ({e})") from None
        settings = _read_json(directory / "tokenizer_config.json")
        # DeepSeek's tokenizer.json has no post-processor: the BOS comes from tokenizer_config.json.
        self.add_bos = bool(settings.get("add_bos_token", False)) and bos_token_id is not None
        self.bos_token_id = bos_token_id

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=True).ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class IncrementalDecoder:
    """Turns a growing token list into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[self.emitted :]
        self.emitted = len(text)
        return delta


def load_tokenizer(directory: Path, bos_token_id: int | None) -> Tokenizer | None:
    return Tokenizer(directory, bos_token_id) if (directory / "tokenizer.json").exists() else None


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
