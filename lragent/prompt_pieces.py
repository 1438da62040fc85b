"""Where one prompt piece of an agent trajectory starts: the rule training, fidelity and the agents share.

An AutoAct trajectory is a sequence of model outputs, each after a response marker, and of the pieces the runtime
appends between them. Training (the cache-sharing-aware loss: where the shared cache ends), the datamodules and
the fidelity measure cut trajectories with :func:`last_piece_start`; :mod:`lragent.agents.prompts` builds the
pieces with the same marker.
"""

from __future__ import annotations

RESPONSE_MARKER = "### Response:\n"


def last_piece_start(text: str, marker: str = RESPONSE_MARKER) -> int:
    """Character index where the text appended after the previous model output starts (0: there is none).

    In the agent loop every model call follows a response marker and stops at a newline, and the runtime then
    appends a new piece (observation, next marker) that the *next* caller prefills itself; everything before that
    piece is already in the shared cache. For ``"...### Response:\nprevious output\nAction: \n### Response:\n"``
    the piece is ``"\nAction: \n### Response:\n"``. Training (the shared-loss split) and fidelity use this rule.
    """
    end = len(text) - len(marker) if text.endswith(marker) else len(text)
    prev = text.rfind(marker, 0, end)
    if prev < 0:
        return 0
    newline = text.find("\n", prev + len(marker))
    return len(text) if newline < 0 else newline
