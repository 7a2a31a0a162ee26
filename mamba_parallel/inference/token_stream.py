"""Every row's new tokens as they are decoded, for Python callers serving several requests at once.

``TokenStream`` is a streamer for a whole batch: ``generate(..., streamer=stream)`` puts each decode step's tokens
(b,) into it, in the input's row order, and iterating it (from another thread) yields them. ``stream_generate``
does both: it runs ``model.generate`` in a worker thread and yields the steps as they come, raising in the caller
whatever the generation raised. A row that has finished (its eos, a stop string, or its own length limit in a
ragged request) shows the pad id (``pad_token_id``, else the first eos id, else 0) in the later steps.

transformers' ``TextStreamer`` / ``TextIteratorStreamer`` follow one sequence and see the prompt first; a
``TokenStream`` sees no prompt, only new tokens, for any batch size.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch

_END = object()


class GenerationCancelled(RuntimeError):
    """The consumer of a TokenStream stopped reading: the generation feeding it ends at its next step."""


class TokenStream:
    """A queue of decode steps: ``put(tokens)`` (b,) int64 per step, ``end()`` once. Iterating yields the steps
    until the end; ``timeout`` (seconds) bounds the wait for each one (``queue.Empty`` after it)."""

    batched = True  # generate hands it every row, in input order, and no prompt

    def __init__(self, timeout: float | None = None):
        self.timeout = timeout
        self._queue: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()

    def put(self, tokens: torch.Tensor) -> None:
        if self._cancelled.is_set():  # raised inside generate: its decode loop stops here
            raise GenerationCancelled("the token stream was closed before the generation ended")
        self._queue.put(tokens)

    def cancel(self) -> None:
        """Stop the generation that feeds this stream at its next step."""
        self._cancelled.set()

    def end(self) -> None:
        self._queue.put(_END)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``: the iterating side raises it."""
        self._queue.put(error)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            item = self._queue.get(timeout=self.timeout)
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def stream_generate(model, input_ids, timeout: float | None = None, **kwargs) -> Iterator[torch.Tensor]:
    """``model.generate(input_ids, **kwargs)`` in a worker thread -> each decode step's new tokens (b,) int64 on
    the CPU, rows in the order of ``input_ids`` (a (b, L) tensor or a list of 1-D prompts), as they are decoded.
    Stacked along a new dimension 1 they are the new tokens ``generate`` returns (the (b, L + n) result's last
    n columns), with finished rows padded. Errors of the generation are raised here."""
    if kwargs.get("streamer") is not None:
        raise ValueError("stream_generate: it brings its own streamer; drop streamer=")
    stream = TokenStream(timeout)

    def work():
        try:
            model.generate(input_ids, streamer=stream, **kwargs)
        except GenerationCancelled:
            pass
        except BaseException as e:  # handed to the iterating thread
            stream.fail(e)

    worker = threading.Thread(target=work, name="stream_generate", daemon=True)
    worker.start()
    try:
        yield from stream
    finally:  # the caller may stop early: the generation stops at its next step
        stream.cancel()
        worker.join()
