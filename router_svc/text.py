"""Incremental detokenization with stop strings, for one request's stream."""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back what may still change.

    Held back: an incomplete UTF-8 character at the end (decoded as U+FFFD) and, when stop strings
    are set, the last ``len(longest stop) - 1`` characters, which could be the start of a stop.

    Each call decodes only the tokens after a settled prefix, not the whole completion: the text of
    ``token_ids[:_settled]`` is kept, and the settled point moves up to a few tokens behind the end
    whenever the tokens before it decode to whole characters (no U+FFFD), where a byte-level
    tokenizer's text of a concatenation is the concatenation of the texts.
    """

    _TAIL = 4  # tokens kept undecided behind the end: a character's bytes span at most 4 tokens

    def __init__(self, tokenizer, stop: Sequence[str], min_tokens: int = 0) -> None:
        """``min_tokens``: stop strings are looked for only once the completion has more tokens
        than this (vLLM's rule: the request asked for at least that many)."""
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self._frozen: str | None = None  # the final text, once a stop token ended the completion
        self.matched = ""  # the stop string that ended it
        self._floor = 0  # text length when the min_tokens-th token came: stop strings must end past it
        self.stop_token: int | None = None  # or the stop token that did
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self._settled = 0  # tokens whose text is final
        self._settled_text = ""  # the text of token_ids[:_settled]
        self._emitted = 0  # characters of the text already returned
        self.stopped = False
        self.consumed = 0  # how many of the tokens given to the last add() are part of the completion

    def add(self, token_ids: Sequence[int], ends: bool = False) -> str:
        """Append tokens and return the new text that is now final. ``ends``: the last of them is
        a stop token (``stop_token_ids``) that ended the completion: it counts as a token of it,
        but its text is not part of the text (vLLM's ``include_stop_str_in_output`` off), and the
        whole rest of the text is returned now.

        With stop strings the tokens are taken one at a time: when one of them completes a stop
        string, the rest are dropped (decode runs ahead of the router, so a batch can carry tokens
        generated after the stop). ``consumed`` then says how many of ``token_ids`` were kept, the
        last of them the token that completed the stop; the completion (``token_ids``) ends there,
        so its length, and anything counted from it, is the same however decode batched it."""
        if self.stopped or self._frozen is not None:
            self.consumed = 0
            return ""
        if ends and token_ids:
            delta = self.add(token_ids[:-1])
            if self.stopped:  # a stop string came first
                return delta
            text = self._text()
            self._frozen = text
            self.token_ids.append(token_ids[-1])
            self.stop_token = token_ids[-1]
            self.consumed = len(token_ids)
            return delta + self._advance(text, len(text))
        if not self.stop:  # nothing can stop the stream: the whole batch at once
            self.token_ids.extend(token_ids)
            self.consumed = len(token_ids)
            return self._release(self._text())
        delta = ""
        for index, token_id in enumerate(token_ids):
            self.token_ids.append(token_id)
            text = self._text()
            if len(self.token_ids) > self.min_tokens:
                cut = self._find_stop(text)
            else:  # within min_tokens: a stop string completed now never counts, later or not
                cut, self._floor = None, len(text)
            if cut is not None:
                self.stopped = True
                self.consumed = index + 1
                return delta + self._advance(text, cut)
            delta += self._release(text)
        self.consumed = len(token_ids)
        return delta

    def _release(self, text: str) -> str:
        """What of ``text`` is final now: all but the held-back tail and an unfinished character."""
        end = len(text) - self._hold
        while end > self._emitted and text[end - 1] == "\ufffd":
            end -= 1
        return self._advance(text, end)

    def flush(self) -> str:
        """All text not yet returned (the stream ended)."""
        if self.stopped:
            return ""
        text = self._text()
        return self._advance(text, len(text))

    def _text(self) -> str:
        """The whole completion's text, decoding only the unsettled tail."""
        if self._frozen is not None:
            return self._frozen
        settle = len(self.token_ids) - self._TAIL
        if settle > self._settled:
            piece = self._decode(self.token_ids[self._settled : settle])
            if not piece.endswith("\ufffd"):
                self._settled_text += piece
                self._settled = settle
        return self._settled_text + self._decode(self.token_ids[self._settled :])

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _find_stop(self, text: str) -> int | None:
        # Only text past what was already emitted minus the hold can hold a new stop string.
        start = max(0, self._emitted - self._hold)
        # and none that ended within the first min_tokens tokens (at or before ``_floor``)
        hits = [(i, s) for i, s in ((text.find(s, max(start, self._floor - len(s) + 1)), s) for s in self.stop)
                if i >= 0]
        if not hits:
            return None
        cut, self.matched = min(hits, key=lambda hit: hit[0])
        return cut

    def _advance(self, text: str, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = text[self._emitted : end]
        self._emitted = end
        return delta
