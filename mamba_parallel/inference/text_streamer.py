"""``TextStreamer``: prints the text of one generation as its tokens arrive (generate's ``streamer`` interface:
``put(tokens)`` with the prompt first, then each step's token, and ``end()``), for any tokenizer with
``decode(ids) -> str`` (ours or transformers').

The whole continuation is decoded at every step and only the new suffix is printed, so tokens that merge (BPE
pieces, multi-byte UTF-8 characters split over byte tokens) come out right; text ending in an incomplete
character (U+FFFD) is held back until the next token completes it, and so is a tail that could begin a stop string.
"""

from __future__ import annotations

import sys

import torch


class TextStreamer:
    """skip_ids: token ids that end the text (eos): neither they nor what follows (padding) is printed.
    stop_strings: the printed text ends before the first of them."""

    def __init__(self, tokenizer, skip_prompt: bool = True, file=None, stop_strings: tuple[str, ...] = (),
                 skip_ids=()):
        self.tokenizer, self.skip_prompt = tokenizer, skip_prompt
        self.file = file if file is not None else sys.stdout
        self.stop_strings, self.skip_ids = tuple(stop_strings), set(skip_ids)
        self.ids: list[int] = []
        self.printed = 0
        self.prompt_seen = False
        self.finished = False  # an eos id or a stop string was seen: the rest is not text

    def put(self, value: torch.Tensor) -> None:
        """value: the prompt (1, L) first, then one token (1,) per step."""
        if value.dim() > 1 and value.shape[0] > 1:
            raise ValueError(f"TextStreamer follows one sequence; got a batch of {value.shape[0]}")
        tokens = value.reshape(-1).tolist()
        if not self.prompt_seen:
            self.prompt_seen = True
            if self.skip_prompt:
                return
        for t in tokens:
            if self.finished or t in self.skip_ids:
                self.finished = True
                break
            self.ids.append(t)
        self._flush(final=False)

    def end(self) -> None:
        self._flush(final=True)
        print(file=self.file, flush=True)

    def text(self) -> str:
        """The text of the continuation, cut before a stop string."""
        text = self.tokenizer.decode(self.ids)
        for s in self.stop_strings:
            at = text.find(s)
            if at >= 0:
                text = text[:at]
                self.finished = True
        return text

    def _flush(self, final: bool) -> None:
        text = self.text()
        if not final and not self.finished:
            text = text.rstrip("\ufffd")  # an incomplete character: wait for its other bytes
            hold = max((len(s) - 1 for s in self.stop_strings), default=0)  # a stop string may be starting
            text = text[:len(text) - hold] if hold else text
        if len(text) > self.printed:
            print(text[self.printed:], end="", file=self.file, flush=True)
            self.printed = len(text)
