"""Unit tests of lragent.agents.prompts: benchmark specs, question formatting and trajectory text pieces."""

from __future__ import annotations

import re

import pytest

from lragent.agents import prompts
from lragent.agents.prompts import (
    HOTPOTQA,
    OPTION_LETTERS,
    SCIENCEQA,
    BenchmarkSpec,
    format_question,
    get_spec,
    initial_text,
    observation_text,
)


def _spec(**overrides) -> BenchmarkSpec:
    fields = {
        "name": "toy",
        "system_prompt": "You are a toy.",
        "tools": ("BingSearch",),
        "invalid_action": "Invalid.",
        "search_error": "Error.",
    }
    fields.update(overrides)
    return BenchmarkSpec(**fields)


def test_spec_with_nonempty_prompt_and_plain_tools_is_accepted():
    """A spec with a non-empty system prompt and only tool actions constructs and keeps its fields."""
    spec = _spec(tools=("BingSearch", "Retrieve", "Lookup", "Image2Text"))
    assert spec.system_prompt == "You are a toy."
    assert spec.tools == ("BingSearch", "Retrieve", "Lookup", "Image2Text")


def test_spec_with_empty_prompt_is_rejected_with_its_name():
    """An empty system prompt raises ValueError naming the benchmark."""
    with pytest.raises(ValueError, match=re.escape("system_prompt of 'toy' is empty")):
        _spec(system_prompt="")


@pytest.mark.parametrize("loop_action", ["Finish", "Reflect"])
def test_spec_with_loop_action_as_tool_is_rejected(loop_action):
    """Finish or Reflect among the tools raises ValueError listing exactly the offending entries."""
    with pytest.raises(ValueError) as info:
        _spec(tools=("BingSearch", loop_action))
    assert str(info.value) == f"tools of 'toy' must not contain loop actions, got ['{loop_action}']"


def test_spec_with_both_loop_actions_lists_both():
    """Both loop actions among the tools are both reported, in tool order."""
    with pytest.raises(ValueError) as info:
        _spec(tools=("Reflect", "Lookup", "Finish"))
    assert str(info.value) == "tools of 'toy' must not contain loop actions, got ['Reflect', 'Finish']"


@pytest.mark.parametrize("name", ["finish", "FINISH", "reflect", "REFLECT", "XXFinishXX", "XXReflectXX"])
def test_spec_loop_action_check_is_case_sensitive(name):
    """Only the exact names Finish and Reflect are loop actions; other spellings are accepted as tools."""
    assert _spec(tools=(name,)).tools == (name,)


def test_builtin_specs():
    """The two built-in specs have their names, tools and observation strings."""
    assert HOTPOTQA.name == "hotpotqa"
    assert HOTPOTQA.tools == ("BingSearch", "Retrieve", "Lookup")
    assert HOTPOTQA.search_error == "bingSearch error, please try again."
    assert SCIENCEQA.name == "scienceqa"
    assert SCIENCEQA.tools == ("Image2Text", "BingSearch", "Retrieve")
    assert SCIENCEQA.search_error == "BingSearch error, please try again."
    assert prompts.BENCHMARKS == {"hotpotqa": HOTPOTQA, "scienceqa": SCIENCEQA}


def test_get_spec_is_case_insensitive():
    """get_spec finds a benchmark by its lower-cased name."""
    assert get_spec("hotpotqa") is HOTPOTQA
    assert get_spec("ScienceQA") is SCIENCEQA


def test_get_spec_unknown_lists_allowed_names():
    """An unknown name raises ValueError quoting the name and listing the allowed names comma-separated."""
    with pytest.raises(ValueError) as info:
        get_spec("GSM8K")
    assert str(info.value) == "unknown benchmark 'GSM8K': allowed hotpotqa, scienceqa"


def test_format_question_open_is_stripped():
    """Without choices (None or empty), the question is returned stripped."""
    assert format_question("  Who? \n") == "Who?"
    assert format_question(" Who? ", []) == "Who?"


def test_format_question_with_choices():
    """Choices follow as ``\\nOptions:(A) x (B) y``, no space after ``Options:``."""
    assert format_question(" Which? ", ["red", "blue"]) == "Which?\nOptions:(A) red (B) blue"


def test_format_question_accepts_as_many_choices_as_letters():
    """Exactly len(OPTION_LETTERS) == 10 choices are accepted, the last lettered J."""
    choices = [str(i) for i in range(len(OPTION_LETTERS))]
    assert len(choices) == 10
    text = format_question("Q", choices)
    assert text == "Q\nOptions:(A) 0 (B) 1 (C) 2 (D) 3 (E) 4 (F) 5 (G) 6 (H) 7 (I) 8 (J) 9"


def test_format_question_rejects_too_many_choices():
    """Eleven choices raise ValueError stating the limit and the count."""
    with pytest.raises(ValueError) as info:
        format_question("Q", [str(i) for i in range(11)])
    assert str(info.value) == "at most 10 choices are supported, got 11"


def test_initial_text_and_observation_text():
    """initial_text and observation_text produce the exact training-data text pieces."""
    spec = _spec()
    assert initial_text(spec, "Who?") == "You are a toy.\nQuestion:Who?\nThought: \n### Response:\n"
    assert observation_text("found", closing="]") == "]\nObversation: found\nThought: \n### Response:\n"
    assert observation_text("ok") == "\nObversation: ok\nThought: \n### Response:\n"
