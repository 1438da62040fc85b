"""Prompt text of the AutoAct agent loop, exactly as the role adapters saw it in training.

Everything here is derived from the bundled training data (``data/trajectories``), checked by
``tests/test_agents_loop.py`` against real role examples, and from the code that produced that data
(LRAgent ``Scripts/filter_data.py``, which cuts the raw trajectories into role examples, and
LRAgent ``Self_Plan/Group_Planning/benchmark_run/Meta_agent_arch.py``, its evaluation loop).

The role examples (``{"input", "output"}``) format one trajectory in two ways:

* **plan** inputs::

      {system}\\nQuestion:{question}\\nThought: \\n### Response:\\n{thought}\\nAction: \\n### Response:\\n{Type}[{arg}]
      \\nObversation: {observation}\\nThought: \\n### Response:\\n ...

  and the plan adapter outputs either a thought (input ends ``Thought: \\n### Response:\\n``) or the bare
  action type such as ``BingSearch`` (input ends ``Action: \\n### Response:\\n``).
* **action** and **reflect** inputs::

      {system}\\nQuestion:{question}\\nThought: \\n### Response:\\n{thought}\\nAciton: {Type}[\\n### Response:\\n{arg}]
      \\nObversation: {observation}\\n ...

  the action adapter outputs the argument (input ends ``Aciton: {Type}[\\n### Response:\\n``); the reflect
  adapter outputs a thought after a ``Please reflect your answer.`` observation (input ends
  ``Thought: \\n### Response:\\n``) and then ``Reflect[right]`` / ``Reflect[wrong]`` with an input that
  ends ``Thought: \\n### Response:\\n{thought}\\n`` (no ``Action:`` marker at all). Earlier reflect steps
  appear in the history as ``Action: Reflect[right]``.

**One shared trajectory.** Cache sharing needs one append-only token sequence that all three roles
extend, so one step is written once, as LRAgent's evaluation loop writes it::

    Thought: \\n### Response:\\n{thought}\\nAction: \\n### Response:\\n{Type}[\\n### Response:\\n{arg}]
    \\nObversation: {obs}\\n

At the moment each adapter generates, the text it sees ends *exactly* as in its training inputs for the
current step: plan sees ``Thought: \\n### Response:\\n`` and ``Action: \\n### Response:\\n``; reflect sees
``Thought: \\n### Response:\\n`` and ``{thought}\\n``. Known, unavoidable mismatches (documented, not hidden):

1. action sees ``Action: \\n### Response:\\n{Type}[\\n### Response:\\n`` where its training input had
   ``Aciton: {Type}[\\n### Response:\\n`` (plan generated ``{Type}`` after ``Action: \\n### Response:\\n``,
   and a shared sequence cannot be both);
2. earlier steps in the history are in the merged form above, which differs from the plan history
   (``Action: \\n### Response:\\n{Type}[{arg}]``) by one ``[\\n### Response:\\n`` and from the
   action/reflect history by ``Action: \\n### Response:\\n`` vs ``Aciton: ``;
3. an earlier reflect step is in the history as ``{thought}\\nReflect[...]`` (what reflect generated after
   ``{thought}\\n``) where the action/reflect training history had ``{thought}\\nAction: Reflect[...]``;
4. LRAgent's own evaluation loop used ``Question: {q}\\n\\n`` and ``Observation:``; we follow the training
   data instead (``Question:{q}\\n`` and ``Obversation:``), since the adapters only ever saw those.

The observation strings are those of the AutoAct/LRAgent trajectory synthesis code that produced the
training trajectories (``Self_Plan/Traj_Syn/benchmark_run/agent_arch.py``), checked against the raw
trajectories in ``data/trajectories/raw``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lragent.prompt_pieces import RESPONSE_MARKER, last_piece_start  # noqa: F401  (re-exported)

RESPONSE = "\n### Response:\n"
"""The instruction-tuning marker after which an adapter generates."""

THOUGHT_MARKER = "Thought: " + RESPONSE
"""Ends every text after which plan (or reflect) generates a thought."""

ACTION_MARKER = "\nAction: " + RESPONSE
"""Appended after a plan thought; plan then generates the action type (``BingSearch``)."""

ARGUMENT_MARKER = "[" + RESPONSE
"""Appended after the action type; action then generates the argument."""

REFLECT_ACTION_MARKER = "\n"
"""Appended after a reflect thought; reflect then generates ``Reflect[right]`` / ``Reflect[wrong]``."""

OBSERVATION_PREFIX = "\nObversation: "
"""Starts an observation line; the misspelling is the training data's."""

SYSTEM_PROMPT_HOTPOTQA = (
    "I want you to be a good multi-hop question answerer ,solving a question answering task with interleaving "
    "Thought, Action, Observation steps. Thought can reason about the current situation, and Action can be five "
    "types :\n"
    "(1) BingSearch[query], which search the exact detailed query on the Internet and returns the relevant "
    "information to the query. Be specific and precise with your query to increase the chances of getting relevant "
    'results. For example, instead of searching for "dogs," you can search for "popular dog breeds in the United '
    'States."For example, BingSearch[Which type of computer networking technology, developed in the 1970s, allows '
    "devices to communicate over a shared network]\n"
    "(2) Retrieve[entity], which retrieve the exact entity on Wikipedia and returns the first paragraph if it "
    "exists. If not, it will return some similar entities to retrieve. For example, Retrieve[Milhouse]\n"
    "(3) Lookup[keyword], which returns the next sentence containing keyword in the last passage successfully found "
    "by Retrieve or BingSearch. For example, Lookup[river]\n"
    "(4) Finish[answer], which returns a definite answer. For example, Finish[Richard Nixon] (If it is a judgement "
    "question, please Finish[yes] or Finish[no])\n"
    "(5) Reflect[right/wrong], which reflects the answer right or wrong based on the context history. For example, "
    "Reflect[right]\n"
    "Note that Reflect must be the next Action after Finish. You may take as many steps as necessary."
)

SYSTEM_PROMPT_SCIENCEQA = (
    "I want you to be a good multimodal multiple-choice science questions answerer. Select a correct option to a "
    "multi-choice multi-modal question with interleaving Thought, Action, Observation steps. Thought can reason "
    "about the current situation, and Action can be five types:\n"
    "(1) Image2Text[image], which generates captions for the image and detects words in the image.You are recommand "
    "to use it first to get more information about the imgage to the question. If the questions contains image, it "
    "will return catption and ocr text, else, it will return None. For example, Image2Text[image]\n"
    "(2) BingSearch[question], which searches the exact detailed question on the Internet and returns the relevant "
    "information to the query. Be specific and precise with your query to increase the chances of getting relevant "
    'results. For example, instead of searching for "dogs," you can search for "popular dog breeds in the United '
    'States." For example, BingSearch[Which type of computer networking technology, developed in the 1970s, allows '
    "devices to communicate over a shared network]\n"
    "(3) Retrieve[entity], which retrieves the exact entity on Wikipedia and returns the first paragraph if it "
    "exists. If not, it will return some similar entities to retrieve. For example, Retrieve[Milhouse]\n"
    "(4) Finish[option], which returns the answer option and finishes the task. For example, Finish[A]\n"
    "(5) Reflect[right/wrong], which reflects the answer right or wrong based on the context history. For example, "
    "Reflect[right]\n"
    "Note that to determine the answer, it's needed to consider both the Question and the available Options.\n"
    "Note that Reflect must be the next Action after Finish.\n"
    "BingSearch and Retrieve can be used multi-times."
)

# Observation strings of the loop itself (the tools' own strings live in lragent.agents.tools).
OBS_PLEASE_REFLECT = "Please reflect your answer."
OBS_REFLECT_INVALID = "Invalid action. Reflect only follows the Finish action."
OBS_MAYBE_WRONG = "The answer maybe wrong, please try to solve the question again."

OPTION_LETTERS = "ABCDEFGHIJ"


@dataclass(frozen=True)
class BenchmarkSpec:
    """What differs between benchmarks: prompt, tool set, and two observation strings.

    Attributes:
        name: benchmark name (``hotpotqa`` or ``scienceqa``).
        system_prompt: the system text that starts every role input of this benchmark's training data.
        tools: tool action types the loop executes (``Finish``/``Reflect`` are handled by the loop).
        invalid_action: observation for an action type that is neither a tool nor ``Finish``/``Reflect``.
        search_error: observation for a ``BingSearch`` that finds nothing.
    """

    name: str
    system_prompt: str
    tools: tuple[str, ...]
    invalid_action: str
    search_error: str

    def __post_init__(self) -> None:
        if not self.system_prompt:
            raise ValueError(f"system_prompt of {self.name!r} is empty")
        bad = [t for t in self.tools if t in ("Finish", "Reflect")]
        if bad:
            raise ValueError(f"tools of {self.name!r} must not contain loop actions, got {bad}")


HOTPOTQA = BenchmarkSpec(
    name="hotpotqa",
    system_prompt=SYSTEM_PROMPT_HOTPOTQA,
    tools=("BingSearch", "Retrieve", "Lookup"),
    invalid_action=(
        "Invalid Action. Valid Actions are Lookup[<topic>] Retrieve[<topic>] BingSearch[<topic>] Finish[<answer>] "
        "and Reflect[right/wrong]."
    ),
    # the exact (lower-case b) string of the HotpotQA training trajectories
    search_error="bingSearch error, please try again.",
)

SCIENCEQA = BenchmarkSpec(
    name="scienceqa",
    system_prompt=SYSTEM_PROMPT_SCIENCEQA,
    tools=("Image2Text", "BingSearch", "Retrieve"),
    # "imgae" is the training trajectories' spelling
    invalid_action=(
        "Invalid Action. Valid Actions are Retrieve[<topic>] BingSearch[<topic>] Finish[<answer>] Image2Text[imgae] "
        "and Reflect[right/wrong]."
    ),
    search_error="BingSearch error, please try again.",
)

BENCHMARKS: dict[str, BenchmarkSpec] = {spec.name: spec for spec in (HOTPOTQA, SCIENCEQA)}


def get_spec(name: str) -> BenchmarkSpec:
    """Returns the :class:`BenchmarkSpec` called ``name`` (``hotpotqa`` or ``scienceqa``)."""
    key = name.lower()
    if key not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}: allowed {', '.join(BENCHMARKS)}")
    return BENCHMARKS[key]


def format_question(question: str, choices: Sequence[str] | None = None) -> str:
    """Formats a benchmark question as the training data does.

    HotpotQA: the question, stripped. ScienceQA: the question followed by ``\\nOptions:(A) x (B) y``
    (no space after ``Options:``, one space between options), as in every ScienceQA training example.

    Args:
        question: the question text (ScienceQA questions may contain ``\\nContext: ...`` lines).
        choices: the answer options, or None for an open question.

    Returns:
        The text that follows ``Question:`` in the prompt.
    """
    text = question.strip()
    if choices:
        if len(choices) > len(OPTION_LETTERS):
            raise ValueError(f"at most {len(OPTION_LETTERS)} choices are supported, got {len(choices)}")
        options = " ".join(f"({OPTION_LETTERS[i]}) {c}" for i, c in enumerate(choices))
        text = f"{text}\nOptions:{options}"
    return text


def initial_text(spec: BenchmarkSpec, question_text: str) -> str:
    """Returns the first text of a trajectory, up to where plan writes its first thought.

    Equal, character for character, to the input of every first-thought plan example in the training data.

    Args:
        spec: the benchmark.
        question_text: the output of :func:`format_question`.
    """
    return f"{spec.system_prompt}\nQuestion:{question_text}\n{THOUGHT_MARKER}"


def observation_text(observation: str, *, closing: str = "") -> str:
    """Returns the text appended after an action: its closing, the observation, and the next thought marker.

    Args:
        observation: the tool's (or loop's) observation, one line.
        closing: ``"]"`` after a tool argument, ``""`` after a reflect action.
    """
    return f"{closing}{OBSERVATION_PREFIX}{observation}\n{THOUGHT_MARKER}"
