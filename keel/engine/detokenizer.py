"""Incremental detokenization and stop strings, with vLLM v1's semantics.

Text is produced one token at a time (never by re-decoding the whole output), because a request
streams and a full re-decode per token would cost O(n^2). A token may end in the middle of a
multi-byte UTF-8 character; its text is held until the character is complete, so the output
never carries a replacement character that a full decode would not.

Stop strings live here, not in the engine core, because they are about text: the engine core
only sees token ids. When a stop string appears, the text is cut and the caller aborts the
request in the engine core."""

from __future__ import annotations

import logging
from typing import Any

from tokenizers.decoders import DecodeStream

from keel.request import Request
from keel.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
# DecodeStream raises this when a token changes text it already returned (rare, non-monotonic
# decoders); the stream is restarted rather than failing the request.
_INVALID_PREFIX_ERR = "Invalid prefix encountered"
# The fast path primes its stream with the shortest prompt suffix, within these many tokens,
# that decodes cleanly: enough context for the first output token's leading space.
_MIN_PRIME_TOKENS = 4
_MAX_PRIME_TOKENS = 24
# The slow path starts its window with this many prompt tokens, for the same reason.
_SLOW_PRIME_TOKENS = 5
# The slow path drops ids it will never decode again once this many have piled up in front.
_SLOW_TRIM_AT = 64


class _TextBuffer:
    """Append-only text kept as chunks, so appending a token's text costs O(len(chunk)), not a
    copy of everything so far (`str +=` on an attribute copies). Joined only when all of it is
    wanted."""

    __slots__ = ("_chunks", "_len")

    def __init__(self) -> None:
        self._chunks: list[str] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, text: str) -> None:
        if text:
            self._chunks.append(text)
            self._len += len(text)

    def text(self) -> str:
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def tail(self, start: int) -> str:
        """text()[start:], reading only the chunks that overlap it."""
        need = self._len - max(start, 0)
        if need <= 0:
            return ""
        parts: list[str] = []
        got = 0
        i = len(self._chunks)
        while got < need:
            i -= 1
            parts.append(self._chunks[i])
            got += len(self._chunks[i])
        parts.reverse()
        return "".join(parts)[got - need:]

    def truncate(self, length: int) -> None:
        if length < self._len:
            text = self.text()[:length]
            self._chunks = [text] if text else []
            self._len = len(text)


class IncrementalDetokenizer:
    """Tracks the output token ids of one request. This base class is what a request gets when
    there is no tokenizer or it asked for detokenize=False: no text, no stop strings."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []

    @classmethod
    def from_new_request(cls, tokenizer: Any | None, request: Request) -> IncrementalDetokenizer:
        params = request.sampling_params
        if tokenizer is None or not params.detokenize:
            return IncrementalDetokenizer()
        # A tokenizer with a `tokenizers` backend: transformers' fast ones and keel's
        # FastTokenizer (keel/engine/fast_tokenizer.py), which is not a transformers class.
        if getattr(tokenizer, "is_fast", False) and params.spaces_between_special_tokens:
            return FastIncrementalDetokenizer(tokenizer, request)
        return SlowIncrementalDetokenizer(tokenizer, request)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_text(self) -> str:
        return ""

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add new tokens; returns the stop string that matched, if any (never, here)."""
        self.token_ids.extend(new_token_ids)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""

    def flush(self) -> None:
        """The request finished: emit text still held for a character that never completed
        (as replacement characters, as a full decode of the output shows them)."""


class _TextDetokenizer(IncrementalDetokenizer):
    """Text, stop strings and hold-back; subclasses say how one token becomes text."""

    def __init__(self, params: SamplingParams) -> None:
        super().__init__()
        self._text = _TextBuffer()
        self.stop: list[str] = list(params.stop or [])
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # Characters that might be the start of a stop string are not handed out until the
        # next tokens show they are not (they would be cut if they were).
        self.stop_buffer_length = (
            self._max_stop_len - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self._sent = 0  # characters already handed out in delta mode

    def _decode_next(self, token_id: int) -> str:
        raise NotImplementedError

    def _pending_text(self) -> str:
        raise NotImplementedError

    def flush(self) -> None:
        self._text.append(self._pending_text())

    @property
    def output_text(self) -> str:
        return self._text.text()

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        if not new_token_ids:
            return None
        # The token that stopped the request (EOS or a stop token id) is an output token, but
        # its text is not part of the output unless the user asked for it.
        skip_last = stop_terminated and not self.include_stop_str_in_output
        to_decode = new_token_ids[:-1] if skip_last else new_token_ids

        check_from = len(self._text)
        for token_id in to_decode:
            self.token_ids.append(token_id)
            self._text.append(self._decode_next(token_id))
            if len(self.token_ids) <= self.min_tokens:
                check_from = len(self._text)  # text of the first min_tokens cannot stop
        if skip_last:
            self.token_ids.append(new_token_ids[-1])

        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        return self._check_stop_strings(check_from)

    def _check_stop_strings(self, check_from: int) -> str | None:
        """Find a stop string that ends in the text added since `check_from` (it may start up
        to len(stop) - 1 characters before it, split across tokens); cut the text there.
        Where several match, the one that starts first wins (then list order)."""
        if len(self._text) <= check_from:
            return None
        base = max(check_from - (self._max_stop_len - 1), 0)
        window = self._text.tail(base)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = max(check_from - (len(stop) - 1), 0) - base
            index = window.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        cut = base + index + (len(stop) if self.include_stop_str_in_output else 0)
        self._text.truncate(cut)
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to hand out now: all of it so far, or (delta) only what is new since the
        last call. Until the request finishes, a possible stop-string prefix is held back."""
        hold = 0 if finished else self.stop_buffer_length
        length = max(len(self._text) - hold, 0)
        if not delta:
            return self._text.text()[:length] if hold else self._text.text()
        if length <= self._sent:
            return ""
        start, self._sent = self._sent, length
        return self._text.tail(start)[: length - start]


class FastIncrementalDetokenizer(_TextDetokenizer):
    """Steps a `tokenizers` DecodeStream on the fast tokenizer's Rust backend: O(1) work per
    token, and the stream itself waits for multi-byte characters to complete."""

    def __init__(self, tokenizer: Any, request: Request) -> None:
        params = request.sampling_params
        super().__init__(params)
        self._backend = tokenizer._tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        # Prime with the end of the prompt so the first output token decodes as a continuation
        # (a SentencePiece "▁word" keeps its space); what priming yields is prompt text.
        for token_id in self._prime_ids(request.prompt_token_ids):
            self._step(token_id)
        self._pending: list[int] = []  # output ids whose text the stream still holds

    def _prime_ids(self, prompt: list[int]) -> list[int]:
        """The shortest prompt suffix (of at least a few tokens) that does not start or end in
        the middle of a character, which would confuse the stream; none if there is none."""
        shortest = min(_MIN_PRIME_TOKENS, len(prompt))
        for n in range(shortest, min(len(prompt), _MAX_PRIME_TOKENS) + 1):
            suffix = prompt[-n:]
            text = self._backend.decode(suffix, skip_special_tokens=self.skip_special_tokens)
            if _REPLACEMENT_CHAR not in text:
                return suffix
        # No clean suffix (a prompt of stray bytes): priming would leak its broken bytes into
        # the output's first characters, so start from nothing.
        return []

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""
        except (OverflowError, TypeError):
            return ""  # an id the backend cannot take (negative, too large): no text
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX_ERR):
                raise
            logger.warning("DecodeStream hit an invalid prefix at token %d; restarting the "
                           "stream (a few characters may be lost).", token_id)
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self._stream.step(self._backend, token_id) or ""

    def _decode_next(self, token_id: int) -> str:
        text = self._step(token_id)
        if text:
            self._pending.clear()
        else:
            self._pending.append(token_id)
        return text

    def _pending_text(self) -> str:
        # Everything before the pending ids was emitted, so they start on a character boundary.
        return self._backend.decode(self._pending, skip_special_tokens=self.skip_special_tokens)


class SlowIncrementalDetokenizer(_TextDetokenizer):
    """The prefix_offset/read_offset algorithm, for slow tokenizers and for
    spaces_between_special_tokens=False: decode a small window ending at the new token, emit
    what it adds to the window's already-read part, and hold back text that ends in a
    replacement character (a character that the next token completes)."""

    def __init__(self, tokenizer: Any, request: Request) -> None:
        params = request.sampling_params
        super().__init__(params)
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        self._ids: list[int] = list(request.prompt_token_ids[-_SLOW_PRIME_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._added: dict[int, str] = {}
        self._special: set[int] = set()
        if not self.spaces_between_special_tokens:
            self._added = {i: str(t) for i, t in tokenizer.added_tokens_decoder.items()}
            self._special = set(tokenizer.all_special_ids)

    def _decode(self, ids: list[int]) -> str:
        if not self._added:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                         clean_up_tokenization_spaces=False)
        # Added tokens are written as they are, glued to their neighbours (no spaces).
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            content = self._added.get(token_id)
            if content is None:
                run.append(token_id)
                continue
            if run:
                parts.append(self.tokenizer.decode(run, clean_up_tokenization_spaces=False))
                run = []
            if not (self.skip_special_tokens and token_id in self._special):
                parts.append(content)
        if run:
            parts.append(self.tokenizer.decode(run, clean_up_tokenization_spaces=False))
        return "".join(parts)

    def _decode_next(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing yet, or a character still incomplete: wait for more tokens
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        if self._prefix_offset >= _SLOW_TRIM_AT:
            del ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text):]

    def _pending_text(self) -> str:
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        return self._decode(ids[self._prefix_offset:])[len(prefix_text):]
