"""The trajectories a server holds, as text, and how a prompt is matched to them.

A client of the server sends the whole trajectory so far with every call (DESIGN.md §9). The server keeps, for each
engine row, the text that row's trajectory holds and where its **pieces** begin: every request appends one piece
(the prompt's new text, tokenised on its own) and its generation another (the kept generated tokens, with the text
the client was sent). :class:`TextTrajectory` stores those piece boundaries as ``(chars, tokens)`` marks.

Matching (:func:`match_prompt`) finds the longest common text prefix of the prompt and a trajectory, keeps the
trajectory's **own tokens for every whole piece** inside it (generated tokens included) and tokenises only the rest
of the prompt, from the start of the piece where the two part. Within that piece the new tokens are then compared
with the trajectory's, token by token: the leading tokens they share are cached too. So

- a prompt that extends a trajectory (the next agent call) gets exactly the trajectory's tokens plus its new text
  tokenised on its own, as ``MultiAgentSession.append_text`` would give: no boundary is re-split, nothing is lost;
- a prompt that parts from a trajectory inside a piece (another episode with the same system prompt) is tokenised
  from that piece's start, as a client appending it as one piece would have it tokenised, and shares the tokens up
  to where the tokenisations part.

The generated piece's text is the text the client was sent; its tokens are the ones the trajectory kept. The two
can differ in their last characters (a token that holds text before a stop string is dropped with the stop, as the
session does): the mark maps the sent text to the kept tokens, so the next call continues the trajectory exactly as
the session continues it.

:class:`TrajectoryStore` holds one :class:`TextTrajectory` per engine row and their use order (least recently used
rows are evicted first). Pure Python: the scheduler (:mod:`lragent.serving.scheduler`) supplies the token ids and the
scheme's cached lengths.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


def common_prefix_len(a: str | list[int], b: str | list[int]) -> int:
    """Length of the longest common prefix of two strings or two lists (binary search over slice comparisons: C
    speed)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_token_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens two id lists share (:func:`common_prefix_len` over them: a server compares each prompt
    with every held trajectory, thousands of tokens each)."""
    a = a if isinstance(a, list) else list(a)  # slices of two lists compare; a list and a tuple never equal
    b = b if isinstance(b, list) else list(b)
    return common_prefix_len(a, b)


@dataclass
class TextTrajectory:
    """The text of one held trajectory and its piece boundaries.

    Attributes:
        text: the trajectory's text: prompts' new text and generated text (as sent to clients), in order.
        marks: ``(chars, tokens)`` at the start of the trajectory and after every piece, increasing: the first
            ``chars`` characters of ``text`` are held as the first ``tokens`` token ids of the engine row.
    """

    text: str = ""
    marks: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])

    @property
    def n_tokens(self) -> int:
        """Tokens the text is held as (the engine row's trajectory length)."""
        return self.marks[-1][1]

    def append(self, text: str, n_tokens: int) -> None:
        """Appends one piece: ``text`` held as ``n_tokens`` more tokens (either may be empty)."""
        if not text and not n_tokens:
            return
        self.text += text
        self.marks.append((len(self.text), self.marks[-1][1] + n_tokens))


@dataclass(frozen=True)
class Match:
    """How a prompt continues (or parts from) a held trajectory.

    Attributes:
        row: the engine row holding the trajectory (None: no trajectory, the prompt tokenised whole).
        tokens: the prompt's token ids: the trajectory's own for its whole pieces, then the rest tokenised.
        shared: leading ``tokens`` equal to the trajectory's ids: the part its caches can serve.
        extends: ``shared`` is the whole trajectory: the prompt continues it (served in place).
        trajectory: the prompt's own :class:`TextTrajectory` (the shared pieces, then the rest as one piece).
    """

    row: int | None
    tokens: list[int]
    shared: int
    extends: bool
    trajectory: TextTrajectory


Tokenize = Callable[[str], list[int]]


def match_prompt(prompt: str, held: TextTrajectory, ids: Sequence[int], tokenize: Tokenize, row: int) -> Match:
    """Matches ``prompt`` to one held trajectory (see the module docstring).

    Args:
        prompt: the request's prompt text.
        held: the trajectory's text and marks.
        ids: the trajectory's token ids (``held.n_tokens`` of them).
        tokenize: text -> token ids (no special tokens added); callers may cache it by text.
        row: the engine row that holds the trajectory.

    Returns:
        the :class:`Match`; ``shared`` is 0 when prompt and trajectory share no token.
    """
    assert len(ids) == held.n_tokens, (len(ids), held.n_tokens)
    common = common_prefix_len(prompt, held.text)
    chars = [c for c, _ in held.marks]
    j = bisect.bisect_right(chars, common) - 1  # the last piece boundary inside the common text
    c, k = held.marks[j]
    rest = tokenize(prompt[c:]) if len(prompt) > c else []
    tokens = list(ids[:k]) + rest
    shared = k + common_token_prefix(rest, ids[k:])
    marks = held.marks[: j + 1] + ([(len(prompt), len(tokens))] if len(prompt) > c else [])
    return Match(row, tokens, shared, shared == len(ids), TextTrajectory(prompt, marks))


def tokenize_once(tokenize: Tokenize) -> Tokenize:
    """``tokenize`` remembering its answer per text: one request's matches share the tokenisations of a text."""
    cache: dict[str, list[int]] = {}

    def cached(text: str) -> list[int]:
        if text not in cache:
            cache[text] = tokenize(text)
        return cache[text]

    return cached


class TrajectoryStore:
    """The text trajectories of an engine's rows, with their use order.

    Args:
        rows: the engine's rows.
    """

    def __init__(self, rows: int) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.rows = rows
        self.held: dict[int, TextTrajectory] = {}
        self._used: dict[int, int] = {}
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self.held)

    def set(self, row: int, trajectory: TextTrajectory) -> None:
        """Row ``row`` now holds ``trajectory`` (used now)."""
        self.held[row] = trajectory
        self.touch(row)

    def touch(self, row: int) -> None:
        """Marks ``row`` as used now."""
        self._used[row] = next(self._clock)

    def drop(self, row: int) -> None:
        """Row ``row`` holds nothing any more."""
        self.held.pop(row, None)
        self._used.pop(row, None)

    def spare_row(self, busy: Iterable[int], exclude: Iterable[int] = ()) -> int | None:
        """A row a new trajectory can take: an empty one (lowest first), else the least recently used held one that
        is neither busy nor excluded; None when there is none."""
        taken = set(busy) | set(exclude)
        for row in range(self.rows):
            if row not in self.held and row not in taken:
                return row
        idle = [r for r in self.held if r not in taken]
        return min(idle, key=self._used.__getitem__) if idle else None

    def best_match(
        self,
        prompt: str,
        candidates: Iterable[int],
        ids_of: Callable[[int], Sequence[int]],
        reusable: Callable[[int, int], int],
        tokenize: Tokenize,
    ) -> Match | None:
        """The held trajectory that serves ``prompt`` best, or None when none shares a token with it.

        Args:
            prompt: the request's prompt text.
            candidates: rows that may serve it (held and not generating).
            ids_of: row -> its trajectory's token ids.
            reusable: ``(row, shared)`` -> how many of the ``shared`` leading tokens the requesting role can read
                from that row's caches under the scheme (e.g. ``min(shared, cached length of the role's cache)``).
            tokenize: text -> token ids; called at most once per distinct piece start (cached here by text).

        Returns:
            the match with the most reusable tokens (ties: the most shared tokens, then the most recently used
            row), or None.
        """
        cached_tokenize = tokenize_once(tokenize)
        # Each candidate's bound: its tokens up to the first piece boundary past the text it shares with the prompt.
        # Tokens that match decode to text both hold, so no match runs past that boundary (for tokens that decode to
        # the text they were made from: byte-level BPE). Candidates go best bound first, then most recently used; one
        # that cannot beat the best so far, and every one after it, is not matched: a server holds many trajectories
        # with the same system prompt, and matching one tokenises the prompt from its first piece and compares
        # thousands of tokens.
        ranked = []
        for row in candidates:
            held = self.held.get(row)
            if held is None:
                continue
            common = common_prefix_len(prompt, held.text)
            if common == 0:
                continue  # not a single character in common: no token can be
            nxt = bisect.bisect_right(held.marks, (common, float("inf")))
            bound = held.marks[nxt][1] if nxt < len(held.marks) else held.n_tokens
            ranked.append((bound, self._used.get(row, 0), row, held))
        ranked.sort(key=lambda t: (t[0], t[1]), reverse=True)
        best, best_key = None, None
        for bound, used, row, held in ranked:
            if best_key is not None and (bound, bound, used) < best_key:
                break  # reusable <= shared <= bound: neither this one nor any after it can win
            m = match_prompt(prompt, held, ids_of(row), cached_tokenize, row)
            if m.shared == 0:
                continue
            key = (reusable(row, m.shared), m.shared, used)
            if best_key is None or key > best_key:
                best, best_key = m, key
        return best
