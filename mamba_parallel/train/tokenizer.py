"""Tokenizers: the built-in byte tokenizer, and HF ``tokenizers`` tokenizer.json files from a local path.

Both expose ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``, ``eos_token_id`` and ``spec``
(what a token file header records so training and generation rebuild the same tokenizer).
"""

from __future__ import annotations

import os
import shutil


class TokenizerError(ValueError):
    pass


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255. Byte 0 (NUL, absent from text) separates documents and ends generation."""

    vocab_size = 256
    eos_token_id = 0
    spec = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, folder: str) -> None:
        """Nothing to write: a folder without tokenizer.json means bytes."""


class HFTokenizer:
    """A ``tokenizers`` tokenizer.json (no network: a local file or a folder holding tokenizer.json)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise TokenizerError("--tokenizer needs the `tokenizers` package: pip install 'mamba-parallel[data]'") \
                from e
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise TokenizerError(f"--tokenizer: no tokenizer.json at {path!r}")
        self.path = os.path.abspath(file)
        try:
            self.tok = Tokenizer.from_file(self.path)
        except Exception as e:  # tokenizers raises its own exception type, with serde's message
            raise TokenizerError(f"{file}: not a readable tokenizer.json ({str(e).splitlines()[0][:200]})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = None
        for name in ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]"):
            tid = self.tok.token_to_id(name)
            if tid is not None:
                self.eos_token_id = tid
                break
        self.spec = self.path

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, folder: str) -> None:
        shutil.copyfile(self.path, os.path.join(folder, "tokenizer.json"))


def load_tokenizer(spec: str | None):
    """``None`` / ``"byte"`` -> ByteTokenizer; a tokenizer.json path (or its folder) -> HFTokenizer."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def tokenizer_for_checkpoint(folder: str, override: str | None = None):
    """The tokenizer saved beside a model folder (tokenizer.json), else bytes; ``override`` wins."""
    if override:
        return load_tokenizer(override)
    path = os.path.join(folder, "tokenizer.json")
    return HFTokenizer(path) if os.path.isfile(path) else ByteTokenizer()
