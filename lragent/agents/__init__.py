"""AutoAct agents on a shared trajectory: prompts, offline tools and the plan/action/reflect loop.

Nothing here imports torch: :class:`~lragent.agents.policies.SessionPolicy` is handed a function that opens a session.
"""

from lragent.agents.constraints import action_type_options, answer_options, is_judgement_question
from lragent.agents.loop import (
    CYCLE_RESERVE_TOKENS,
    AgentConfig,
    AgentLoop,
    EpisodeResult,
    RoleStats,
    Step,
    context_bound,
    drive,
    run_episode,
)
from lragent.agents.policies import Policy, ScriptedPolicy, SessionPolicy
from lragent.agents.prompts import HOTPOTQA, SCIENCEQA, BenchmarkSpec, format_question, get_spec, initial_text
from lragent.agents.requests import Choose, Generate, Reply, StepStats
from lragent.agents.tools import Passage, Toolbox, WikiIndex

__all__ = [
    "CYCLE_RESERVE_TOKENS",
    "context_bound",
    "AgentConfig",
    "AgentLoop",
    "BenchmarkSpec",
    "Choose",
    "EpisodeResult",
    "Generate",
    "HOTPOTQA",
    "Passage",
    "Policy",
    "Reply",
    "RoleStats",
    "SCIENCEQA",
    "ScriptedPolicy",
    "SessionPolicy",
    "Step",
    "StepStats",
    "Toolbox",
    "WikiIndex",
    "action_type_options",
    "answer_options",
    "drive",
    "format_question",
    "get_spec",
    "initial_text",
    "is_judgement_question",
    "run_episode",
]
