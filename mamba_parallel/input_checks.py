"""Checks of what a user hands the CLI (sampling settings, prompts, tokenizers): one clear error naming the flag.

Shared by ``generate`` and the trainer's closing sample; each raises ``ConfigError`` (exit 2 in the CLI) or returns
what deserves a warning.
"""

from __future__ import annotations

import math

from mamba_parallel.config import ConfigError


def check_sampling(temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
                   prefix: str = "--") -> None:
    """The sampling settings that are given (None: unset): temperature >= 0 (0 = greedy), top_k >= 0 (0 = all),
    top_p in (0, 1] (1 = off), min_p in [0, 1], repetition_penalty > 0. ``prefix`` "--" names CLI flags
    (``--top-p``), "" the keyword arguments (``top_p``)."""
    def name(n: str) -> str:
        return prefix + (n.replace("_", "-") if prefix else n)

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if temperature is not None and not (number(temperature) and temperature >= 0):
        raise ConfigError(f"{name('temperature')} must be a number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ConfigError(f"{name('top_k')} must be an integer >= 0 (0 = all tokens), got {top_k!r}")
    if top_p is not None and not (number(top_p) and 0 < top_p <= 1):
        raise ConfigError(f"{name('top_p')} must lie in (0, 1] (1 = off), got {top_p!r}")
    if min_p is not None and not (number(min_p) and 0 <= min_p <= 1):
        raise ConfigError(f"{name('min_p')} must lie in [0, 1], got {min_p!r}")
    if repetition_penalty is not None and not (number(repetition_penalty) and repetition_penalty > 0):
        raise ConfigError(f"{name('repetition_penalty')} must be > 0 (1 = off), got {repetition_penalty!r}")


def check_prompt(text: str, what: str = "--prompt") -> str:
    """``text`` as valid UTF-8: command-line bytes that are not UTF-8 reach Python as lone surrogates; refused
    naming the first bad byte."""
    for i, ch in enumerate(text):
        if "\udc80" <= ch <= "\udcff":
            raise ConfigError(f"{what}: not valid UTF-8 (byte 0x{ord(ch) - 0xdc00:02x} at character {i}); pass the "
                              f"text in UTF-8")
        if "\ud800" <= ch <= "\udfff":
            raise ConfigError(f"{what}: holds a lone surrogate U+{ord(ch):04X} at character {i} (not valid text)")
    return text


def unencodable(tokenizer, text: str) -> list[str]:
    """The distinct characters of ``text`` that ``tokenizer`` cannot represent (mapped to its unknown token or
    dropped), in order of appearance; empty when every character survives."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None:  # bytes: every character is its UTF-8 bytes
        return []
    enc = tok.encode(text, add_special_tokens=False)
    unk = _unk_id(tok)
    covered = [False] * len(text)
    bad = []
    for tid, (start, end) in zip(enc.ids, enc.offsets):
        for i in range(start, min(end, len(text))):
            covered[i] = tid != unk
            if tid == unk:
                bad.append(text[i])
    bad += [c for c, ok in zip(text, covered) if not ok and not c.isspace()]
    return list(dict.fromkeys(bad))


def _unk_id(tok) -> int | None:
    try:
        model = tok.model
        unk = getattr(model, "unk_token", None)
        return tok.token_to_id(unk) if unk else None
    except Exception:  # tokenizers models without an unknown token
        return None


def warn_unencodable(tokenizer, text: str, what: str = "--prompt") -> None:
    """One warning naming the characters of ``text`` the tokenizer cannot encode (none: silent)."""
    lost = unencodable(tokenizer, text)
    if lost:
        import warnings

        warnings.warn(f"the tokenizer cannot encode {len(lost)} character(s) of {what}: "
                      f"{' '.join(repr(c) for c in lost[:20])}{' ...' if len(lost) > 20 else ''} (encoded as its "
                      f"unknown token or dropped)", stacklevel=2)


def check_vocab_fits(tokenizer_vocab: int, model_vocab: int, what: str) -> None:
    """A tokenizer whose ids reach beyond the model's embedding would index out of range."""
    if tokenizer_vocab > model_vocab:
        raise ConfigError(f"{what}: the tokenizer has {tokenizer_vocab:,} tokens but the model's vocabulary is "
                          f"{model_vocab:,}; use the tokenizer the model was trained with")
