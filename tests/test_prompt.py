"""Step prompt and action parsing (docs/ALGORITHM.md, "Environments"): the conventions the trainer
relies on, in both response formats."""

import pytest

from envs import ACTION_END, ACTION_PREFILL, build_prompt, normalize_action, parse_action


def test_normalize_action_strips_lowercases_and_collapses_spaces():
    assert normalize_action("  Go  To\tDesk 1 \n") == "go to desk 1"


def test_parse_action_takes_the_last_closed_action_tag():
    reply = "<think>first <action>look</action> is wrong</think>\n<ACTION> go to  desk 1 </ACTION>"
    assert parse_action(reply) == "go to desk 1"


def test_parse_action_without_a_tag_is_none():
    assert parse_action("<think>hmm</think> go to desk 1") is None
    assert parse_action("<action>  </action>") is None  # an empty tag counts as no action
    assert parse_action("<action>open drawer 1") is None  # unclosed tag
    assert parse_action("") is None and parse_action(None) is None


def test_prompt_holds_task_history_observation_and_admissible_actions():
    prompt = build_prompt(
        "put a mug in desk.",
        [("You see a desk.", "go to desk 1")],
        "On the desk 1, you see a mug 1.",
        ["take mug 1 from desk 1", "look"],
    )
    for part in (
        "Your task: put a mug in desk.",
        "Observation: You see a desk.",
        "Action: go to desk 1",
        "Current observation: On the desk 1, you see a mug 1.",
        "- take mug 1 from desk 1",
        "- look",
        "<think>",
        "<action>",
    ):
        assert part in prompt
    assert "last" not in build_prompt("g", [], "o", ["look"])  # no history block on the first step


def test_action_format_lists_tagged_actions_and_its_prefilled_reply_parses():
    prompt = build_prompt(
        "put a mug in desk.",
        [],
        "You see a desk.",
        ["go to desk 1", "look"],
        response_format="action",
    )
    assert "<action>go to desk 1</action>\n<action>look</action>" in prompt
    assert "<think>" not in prompt and "- look" not in prompt
    # the reply of the action format is the prefill (prompt) plus what the model generated
    assert parse_action(ACTION_PREFILL + "go to desk 1" + ACTION_END) == "go to desk 1"
    assert parse_action(ACTION_PREFILL + "go to desk 1") is None  # cut before the stop string
    with pytest.raises(ValueError, match="response_format"):
        build_prompt("g", [], "o", ["look"], response_format="json")
