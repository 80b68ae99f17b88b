"""The env test kit (`looprl envs check`): built-ins pass, a broken env fails loudly."""

from __future__ import annotations

import random

import pytest
from typer.testing import CliRunner

from looprl.cli import app
from looprl.envs import env_class, list_envs
from looprl.envs.check import check_env, random_value

BROKEN = "tests.toy_envs:BrokenPickSeven"


# the envs that need arguments (dataset, mix, mcp) and the adapters, which need a target
# (`reasoning-gym:<dataset>`), are checked in their own test files
@pytest.mark.parametrize(
    "name",
    sorted(n for n in list_envs() if "<" not in n and not getattr(env_class(n), "needs_args", 0)),
)
def test_every_builtin_env_passes(name):
    report = check_env(name)
    failed = [f"{c.name}: {c.detail}" for c in report.checks if not c.ok]
    assert not failed, failed
    assert report.agents["random"].episodes == 64


def test_toy_env_passes_and_its_outcomes_are_all_reached():
    report = check_env("tests.toy_envs:PickSeven", n=40)
    assert report.ok, [(c.name, c.detail) for c in report.checks]
    seen = {o for s in report.agents.values() for o in s.outcomes}
    assert {"hit", "miss", "no_tool_call", "bad_json", "unknown_tool"} <= seen


def test_broken_env_fails_each_check():
    report = check_env(BROKEN, n=16)
    status = {c.name: c for c in report.checks}
    for name in ("deterministic tasks", "train/eval disjoint", "no exceptions",
                 "rewards in range", "outcomes declared", "outcomes reachable",
                 "turn rewards"):  # fmt: skip
        assert not status[name].ok, name
    assert "never" in status["outcomes reachable"].detail
    assert "jackpot" in status["outcomes declared"].detail
    assert "simulated environment bug" in status["no exceptions"].detail
    assert status["step time"].ok and status["task data is JSON"].ok


def test_graded_game_passes_the_turn_reward_check():
    report = check_env("tictactoe-game", {"move_rewards": True}, n=8)
    status = {c.name: c for c in report.checks}
    assert report.ok, [(c.name, c.detail) for c in report.checks if not c.ok]
    assert "steps graded with a finite number" in status["turn rewards"].detail


def test_slow_steps_fail_the_time_check():
    report = check_env("tests.toy_envs:PickSeven", n=4, max_step_ms=0.0)
    assert not {c.name: c for c in report.checks}["step time"].ok


def test_random_values_follow_the_schema():
    rng = random.Random(0)
    properties = {
        "a": {"type": "integer", "minimum": 1, "maximum": 3},
        "b": {"enum": ["x", "y"]},
        "c": {"type": "array", "items": {"type": "number"}},
    }
    schema = {"type": "object", "required": ["a", "b"], "properties": properties}
    for _ in range(50):
        value = random_value(schema, rng)
        assert 1 <= value["a"] <= 3 and value["b"] in ("x", "y")
        assert all(isinstance(v, float) for v in value.get("c", []))


def test_random_strings_follow_pattern_format_and_lengths():
    import jsonschema

    rng = random.Random(1)
    schemas = [
        {"type": "string", "pattern": r"^2027-[01][0-9]-[0-3][0-9]$"},
        {"type": "string", "pattern": r"^([01]\d|2[0-3]):[0-5]\d$"},
        {"type": "string", "pattern": r"^(red|green|blue)-\w{2,4}$"},
        {"type": "string", "pattern": r"^[^aeiou]{3}$"},
        {"type": "string", "format": "email"},
        {"type": "string", "format": "date"},
        {"type": "string", "minLength": 5, "maxLength": 7},
        {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 13},
        {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2},
    ]
    checker = jsonschema.FormatChecker()
    for schema in schemas:
        for _ in range(20):
            jsonschema.validate(random_value(schema, rng), schema, format_checker=checker)


def test_cli_exit_codes():
    runner = CliRunner()
    ok = runner.invoke(app, ["envs", "check", "tictactoe-move"])
    assert ok.exit_code == 0, ok.output
    assert "outcomes reachable" in ok.output
    bad = runner.invoke(app, ["envs", "check", BROKEN, "--tasks", "8"])
    assert bad.exit_code == 1
    assert "checks failed for: " + BROKEN in bad.output
    unknown = runner.invoke(app, ["envs", "check", "no-such-env"])
    assert unknown.exit_code == 2 and "unknown environment" in unknown.output
    badarg = runner.invoke(app, ["envs", "check", "tictactoe-move", "--arg", "oops"])
    assert badarg.exit_code == 2 and "key=value" in badarg.output


def test_an_uncertain_outcome_unreached_is_reported_not_failed():
    maybe = check_env("tests.toy_envs:PickSevenMaybeClose", n=16)
    reach = next(c for c in maybe.checks if c.name == "outcomes reachable")
    assert maybe.ok and "close not reached" in reach.detail
    never = check_env("tests.toy_envs:PickSevenNeverClose", n=16)
    reach = next(c for c in never.checks if c.name == "outcomes reachable")
    assert not never.ok and reach.detail == "missing: close"


def test_capabilities_are_read_from_what_each_env_declares():
    """The loop asks `capabilities(env)`; each built-in declares what it can do."""
    from looprl.envs import Capabilities, capabilities, make_env

    move = capabilities(make_env("tictactoe-move", {}))
    assert move.demonstrations and not move.turn_rewards and not move.snapshot_opponent
    assert "optimal" in move.solved
    game = capabilities(make_env("tictactoe-game", {"opponent": "snapshot", "move_rewards": True}))
    assert game.snapshot_opponent and game.turn_rewards and not game.agent
    assert capabilities(object()) == Capabilities()  # declares nothing: can do nothing more
