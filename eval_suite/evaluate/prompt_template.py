"""A batch's shared prompt computed once: episodes start from a template row's caches instead of feeding it again.

Every episode of a benchmark opens with the same system prompt and few-shot examples (``initial_text``: about 1,700 of
an opening's 1,800 characters on ScienceQA), which the first role computes on each row again: under ``non_shared``
the other roles compute it once more each. With ``LRAGENT_PROMPT_TEMPLATE=1`` the executor keeps one more engine
row, the template: the first episode's opening is prefilled there once under its role (under ``non_shared`` under
every role), and every episode that starts with that role copies the part of the template its opening shares
(:func:`lragent.serving.rows.fork_row`, the copy the server makes for a prompt that parts from a held trajectory) and
appends only the rest. The copied caches hold what the row would have computed for the same tokens at the same
positions; on a GPU, where the rows' openings are fed through batched decode steps, bf16 rounds the template's eager
prefill otherwise, so sampled episodes may part at near-ties (accuracies compare, records not), as with any other
change of the steps' widths.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from lragent.engine import Engine
from lragent.serving.rows import fork_row
from lragent.sharing import NonShared

PROMPT_TEMPLATE_ENV = "LRAGENT_PROMPT_TEMPLATE"
"""``LRAGENT_PROMPT_TEMPLATE=1``: the executor starts episodes from a template row (default 0: each row computes
its own opening)."""

MIN_SHARED_TOKENS = 16
"""An opening that shares fewer tokens with the template is appended whole (a copy would save too little)."""


def prompt_template_enabled() -> bool:
    """Whether ``LRAGENT_PROMPT_TEMPLATE`` asks for a template row (unset: no).

    Raises:
        ValueError: a value other than 0 or 1, naming it.
    """
    value = os.environ.get(PROMPT_TEMPLATE_ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{PROMPT_TEMPLATE_ENV}={value!r}: allowed 0 (off) or 1 (episodes start from a template row)")
    return value == "1"


class PromptTemplate:
    """The template row of one engine: made from the first opening it is shown, then copied into new episodes' rows.

    Args:
        row: the engine row it owns (never given to an episode).
    """

    def __init__(self, row: int) -> None:
        self.row = row
        self.roles: set[int] = set()  # the roles whose caches hold the opening there (none: not made yet)
        self.copied_tokens = 0  # tokens episodes took from it instead of computing them (each row's once)

    def open(self, eng: Engine, row: int, tokens: Sequence[int], role: int) -> list[int]:
        """Starts ``row``'s empty trajectory with ``tokens``, the episode's opening for ``role``: the part the
        template shares is copied into the row, and the rest is returned for the caller to append.

        Args:
            eng: the engine (``row`` not generating; the template row never is).
            row: the episode's row, just reset.
            tokens: the opening's token ids.
            role: the role whose request the opening is.

        Returns:
            the tokens still to append (all of ``tokens`` when the template does not serve them).
        """
        if eng.ids(row):
            raise ValueError(f"row {row} is not empty: a template only opens a new episode's row")
        if not self.roles:  # the first opening: prefilled once in the template row, eagerly
            eng.reset(self.row)
            eng.append(self.row, list(tokens))
            # under its role; under non_shared, whose roles each compute the whole context in caches of their own,
            # under every role, so that each role's first call computes only what follows the opening
            roles = range(len(eng.model.router)) if isinstance(eng.scheme, NonShared) else [role]
            for r in roles:
                eng.prefill(self.row, r)
                eng.scheme.finish_step(eng.traj[self.row], r)  # the role has seen what it computed, as after a step
            self.roles = set(roles)
        if role not in self.roles:  # the opening's role differs from the template's: its caches are not there
            return list(tokens)
        held = eng.ids(self.row)
        n = 0
        limit = min(len(held), len(tokens) - 1)  # the opening's last token is the row's own: it yields the logits
        while n < limit and held[n] == tokens[n]:
            n += 1
        if n < MIN_SHARED_TOKENS:
            return list(tokens)
        fork_row(eng, self.row, row, n)
        self.copied_tokens += n
        return list(tokens[n:])
