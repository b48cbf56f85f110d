"""Model-free proposers: the next tokens of a request guessed from its own tokens.

Both look for an earlier place where the request's latest tokens occurred and propose what
followed there. They run in the engine core at schedule time (the scheduler knows every
request's tokens; no round trip through the worker), cost no weights, and are exact in the
sense that matters: a wrong guess only costs the forward rows it took, never a wrong token
(the rejection sampler keeps the target's distribution).

- NgramProposer (method "ngram", prompt lookup): for n from prompt_lookup_max down to
  prompt_lookup_min, the last n tokens are searched (vectorised, numpy) among the earlier ones;
  the first occurrence of the longest n that matches gives the proposal.
- SuffixProposer (method "suffix"): a suffix automaton per request, extended token by token,
  finds the longest suffix of the request's tokens that occurred before (no upper bound on
  its length) in amortised O(1) per token; the proposal continues from that suffix's first
  occurrence. A long match is strong evidence of copying, and the automaton never rescans.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from lm_console.engine.config.speculative import SpeculativeConfig


class Proposer(Protocol):
    """What the scheduler asks of a proposer."""

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to max_tokens guesses of what follows token_ids (the request's prompt + output)."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop any state kept for a finished request."""
        ...


class NgramProposer:
    """Prompt lookup: the continuation of the first earlier occurrence of the last n tokens."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        return ngram_lookup(np.asarray(token_ids, dtype=np.int64), self.min_n, self.max_n, max_tokens)

    def forget(self, request_id: str) -> None:
        """Stateless: nothing to drop."""


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, max_tokens: int) -> list[int]:
    """The tokens that followed the first earlier occurrence of tokens' last n (longest n in
    [min_n, max_n] that occurs), at most max_tokens of them; [] when none occurs."""
    length = tokens.shape[0]
    if max_tokens <= 0 or length < min_n + 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n:]
        # Windows starting at i cover tokens[i : i + n]; i + n < length leaves a continuation,
        # and excludes the suffix itself.
        windows = sliding_window_view(tokens[:length - 1], n)
        # The first token alone narrows the candidates cheaply before the full comparison.
        candidates = np.flatnonzero(windows[:, 0] == pattern[0])
        if candidates.size == 0:
            continue
        hits = candidates[(windows[candidates] == pattern).all(axis=1)]
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start:start + max_tokens].tolist()
    return []


class _SuffixAutomaton:
    """The suffix automaton of one request's tokens, built online.

    States are parallel lists: `length` (the longest string a state stands for), `link` (its
    suffix link), `first_end` (the end index of that string's first occurrence) and `next`
    (transitions by token). `last` is the state of the whole text.
    """

    __slots__ = ("first_end", "last", "length", "link", "next", "tokens")

    def __init__(self) -> None:
        self.length = [0]
        self.link = [-1]
        self.first_end = [-1]
        self.next: list[dict[int, int]] = [{}]
        self.last = 0
        self.tokens: list[int] = []

    def extend(self, token: int) -> None:
        """Append one token (the textbook online construction, with first-occurrence ends)."""
        position = len(self.tokens)
        self.tokens.append(token)
        length, link, first_end, nxt = self.length, self.link, self.first_end, self.next
        current = len(length)
        length.append(length[self.last] + 1)
        link.append(-1)
        first_end.append(position)
        nxt.append({})
        state = self.last
        while state != -1 and token not in nxt[state]:
            nxt[state][token] = current
            state = link[state]
        if state == -1:
            link[current] = 0
        else:
            target = nxt[state][token]
            if length[state] + 1 == length[target]:
                link[current] = target
            else:
                clone = len(length)
                length.append(length[state] + 1)
                link.append(link[target])
                first_end.append(first_end[target])  # a clone's strings first end where the original's do
                nxt.append(dict(nxt[target]))
                while state != -1 and nxt[state].get(token) == target:
                    nxt[state][token] = clone
                    state = link[state]
                link[target] = clone
                link[current] = clone
        self.last = current

    def longest_repeat(self) -> tuple[int, int]:
        """(length, end of its first occurrence) of the longest suffix of the text that also
        ends earlier; (0, -1) when no suffix repeats.

        The suffix link of the whole text's state stands for exactly that suffix: the longest
        one with more than one end position. Its first end is earlier than the text's end.
        """
        state = self.link[self.last]
        if state <= 0:
            return 0, -1
        return self.length[state], self.first_end[state]


class SuffixProposer:
    """The continuation of the longest earlier occurrence of the request's own suffix."""

    def __init__(self, min_match: int) -> None:
        self.min_match = min_match
        self._automata: dict[str, _SuffixAutomaton] = {}

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        automaton = self._automata.get(request_id)
        if automaton is None:
            automaton = self._automata[request_id] = _SuffixAutomaton()
        # A request's tokens only grow (a preempted one keeps them): extend by the new ones.
        for token in token_ids[len(automaton.tokens):]:
            automaton.extend(token)
        if max_tokens <= 0:
            return []
        match_length, end = automaton.longest_repeat()
        if match_length < self.min_match:
            return []
        return token_ids[end + 1:end + 1 + max_tokens]

    def forget(self, request_id: str) -> None:
        self._automata.pop(request_id, None)


def create_proposer(config: SpeculativeConfig) -> NgramProposer | SuffixProposer:
    """The proposer config.method names."""
    if config.method == "ngram":
        return NgramProposer(config.min_match, config.max_match)
    if config.method == "suffix":
        return SuffixProposer(config.min_match)
    raise ValueError(f"unknown speculative method {config.method!r}")
