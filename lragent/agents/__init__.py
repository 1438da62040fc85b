"""AutoAct agents on a shared trajectory: prompts, offline tools and the plan/action/reflect loop.

Nothing here imports torch; :class:`~lragent.agents.loop.SessionPolicy` imports the session lazily.
"""

from lragent.agents.loop import (
    AgentConfig,
    AgentLoop,
    EpisodeResult,
    Policy,
    RoleStats,
    ScriptedPolicy,
    SessionPolicy,
    Step,
    StepStats,
    run_episode,
)
from lragent.agents.prompts import HOTPOTQA, SCIENCEQA, BenchmarkSpec, format_question, get_spec, initial_text
from lragent.agents.tools import Passage, Toolbox, WikiIndex

__all__ = [
    "AgentConfig",
    "AgentLoop",
    "BenchmarkSpec",
    "EpisodeResult",
    "HOTPOTQA",
    "Passage",
    "Policy",
    "RoleStats",
    "SCIENCEQA",
    "ScriptedPolicy",
    "SessionPolicy",
    "Step",
    "StepStats",
    "Toolbox",
    "WikiIndex",
    "format_question",
    "get_spec",
    "initial_text",
    "run_episode",
]
