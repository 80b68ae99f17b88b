"""The `mcp` environment against real MCP servers (tests/mcp_servers/counter.py over stdio
and streamable HTTP, and the shop of examples/mcp_shop): tools listed and called,
scoring, the isolation modes, the faults (a tool error, a timeout, a crash, a server that
will not start, a bad schema, bad rows) and one `looprl run` on the tiny model."""

from __future__ import annotations

import gc
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

pytest.importorskip("mcp")

from looprl.cli import app  # noqa: E402
from looprl.envs import list_envs, make_env  # noqa: E402
from looprl.envs.adapters import mcp_client  # noqa: E402
from looprl.envs.adapters.mcp_env import calls_credit  # noqa: E402
from looprl.envs.check import check_env  # noqa: E402
from looprl.errors import EnvError  # noqa: E402
from looprl.types import Message, ToolCall  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COUNTER = f"python {ROOT / 'tests' / 'mcp_servers' / 'counter.py'}"
SHOP = ROOT / "examples" / "mcp_shop"
TINY = ["--set", "model.name=tiny-random", "--set", "train.steps=1",
        "--set", "rollout.tasks_per_step=2", "--set", "rollout.group_size=2",
        "--set", "eval.tasks=2", "--set", "eval.samples_per_task=1"]  # fmt: skip
ROWS = [
    {"prompt": "Count to 3.", "answer": "3", "score_tool": "grade", "info": {"target": 3},
     "expected_calls": [{"name": "increment", "arguments": {"by": 3}}]},
    {"prompt": "Count to 2.", "answer": "2",
     "expected_calls": [{"name": "increment", "arguments": {"by": 2}}]},
    {"prompt": "Count to 4.", "answer": "4", "score_tool": "grade", "info": {"target": 4}},
    {"prompt": "Say 5.", "answer": "5"},
]  # fmt: skip


@pytest.fixture(autouse=True)
def server_log(tmp_path, monkeypatch):
    """Each test's servers log their calls to its own file, and are closed after it."""
    path = tmp_path / "calls.jsonl"
    monkeypatch.setenv("MCP_TEST_LOG", str(path))
    yield path
    mcp_client.close_all()


def logged(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def counter_env(tmp_path: Path, rows: list[dict] = ROWS, **args):
    tasks = write_rows(tmp_path / "tasks.jsonl", rows)
    return make_env("mcp", {"server": COUNTER, "tasks": str(tasks), "eval_fraction": 0.25,
                            "isolation": "reset", **args})  # fmt: skip


def task_of(env, prompt: str):
    tasks = env.tasks("train") + env.tasks("eval")
    return next(t for t in tasks if t.data["messages"][-1]["content"] == prompt)


def call(name: str, **arguments) -> Message:
    return Message("assistant", tool_calls=[ToolCall(name, arguments, id=f"id_{name}")])


def read_state(env) -> dict:
    return json.loads(env.step(call("read")).messages[0].content)


# ------------------------------------------------------------------ tools, calls, scores


def test_the_servers_tools_are_the_episodes_and_calls_run_on_it(tmp_path, server_log):
    env = counter_env(tmp_path)
    obs = env.reset(task_of(env, "Count to 3."))
    names = [t["function"]["name"] for t in obs.tools]
    assert names == ["increment", "read", "fail", "slow", "crash"]  # reset and grade hidden
    assert obs.tool_choice == "auto" and obs.messages[-1].content == "Count to 3."
    assert obs.tools[0]["function"]["parameters"]["properties"]["by"]["type"] == "integer"
    result = env.step(call("increment", by=3))
    assert not result.done and result.reward == 0.0
    (reply,) = result.messages
    assert (reply.role, reply.content, reply.name, reply.tool_call_id) == (
        "tool", "3", "increment", "id_increment")  # fmt: skip
    final = env.step(Message("assistant", "3"))
    assert final.done and final.outcome == "correct" and final.reward == 1.0
    assert final.info["scores"] == {"answer": 1.0, "calls": 1.0, "score_tool": 1.0}
    tools = [c["tool"] for c in logged(server_log)]
    assert tools == ["reset", "increment", "grade"]
    assert logged(server_log)[-1]["arguments"] == {"answer": "3", "info": {"target": 3}}


def test_partial_and_wrong_answers_and_a_plain_text_first_reply(tmp_path):
    env = counter_env(tmp_path)
    env.reset(task_of(env, "Count to 3."))
    env.step(call("increment", by=2))
    result = env.step(Message("assistant", "3"))  # right answer, wrong count and call
    assert result.outcome == "partial" and result.info["scores"]["calls"] == 0.0
    assert result.reward == pytest.approx((1.0 + 0.0 + 0.5) / 3)
    env.reset(task_of(env, "Say 5."))
    # with tool_choice auto the parser marks a reply without a call no_tool_call: the answer
    result = env.step(Message("assistant", "six", parse_failure="no_tool_call"))
    assert (result.done, result.outcome, result.reward) == (True, "wrong", 0.0)


def test_expected_calls_credit_is_order_free_and_repeats_cost():
    want = [{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]
    made = [{"name": "look", "arguments": {}}, {"name": "add", "arguments": {"a": 2}},
            {"name": "add", "arguments": {"a": 1}}]  # fmt: skip
    assert calls_credit(made, want) == 1.0  # another tool's call costs nothing
    assert calls_credit(made + [{"name": "add", "arguments": {"a": 3}}], want) == 2 / 3
    assert calls_credit([{"name": "add", "arguments": {"a": 1}}], want) == 0.5
    assert calls_credit([], want) == 0.0 and calls_credit([], []) == 1.0


def test_a_tool_error_is_the_models_to_read_and_the_episode_goes_on(tmp_path):
    env = counter_env(tmp_path)
    env.reset(task_of(env, "Count to 2."))
    calls = [ToolCall("fail", {"reason": "x"}, id="a"), ToolCall("increment", {"by": 2}, id="b")]
    result = env.step(Message("assistant", tool_calls=calls))
    assert not result.done and result.info["tool_errors"] == 1
    assert "fail" in result.messages[0].content and result.messages[1].content == "2"
    final = env.step(Message("assistant", "2"))
    assert final.outcome == "correct" and final.info["tool_errors"] == 1


@pytest.mark.parametrize("failure", ["bad_json", "unknown_tool", "bad_arguments"])
def test_a_malformed_call_ends_the_episode_with_the_failure_reward(tmp_path, failure):
    env = counter_env(tmp_path, failure_reward=-0.5)
    env.reset(task_of(env, "Count to 2."))
    result = env.step(Message("assistant", "x", parse_failure=failure, parse_detail="d"))
    assert (result.done, result.outcome, result.reward) == (True, failure, -0.5)
    assert env.reward_range == (-0.5, 1.0) and failure in env.outcomes


def test_calls_at_the_last_turn_end_the_episode_as_turn_limit(tmp_path):
    env = counter_env(tmp_path, max_turns=2)
    env.reset(task_of(env, "Count to 2."))
    assert not env.step(call("increment", by=1)).done
    result = env.step(call("increment", by=1))
    assert result.done and result.outcome == "turn_limit" and len(result.messages) == 1
    assert result.info["scores"] == {"answer": 0.0, "calls": 0.0} and result.reward == 0.0


# ------------------------------------------------------------------ isolation


def test_reset_isolation_pools_servers_and_resets_them(tmp_path):
    first, second = counter_env(tmp_path), counter_env(tmp_path)
    task = task_of(first, "Count to 2.")
    first.reset(task), second.reset(task)  # two live episodes: two processes
    first.step(call("increment", by=5))
    one, two = read_state(first), read_state(second)
    assert one["pid"] != two["pid"] and (one["count"], two["count"]) == (5, 0)
    first.step(Message("assistant", "done"))  # gives its server back
    third = counter_env(tmp_path)
    third.reset(task)
    assert read_state(third) == {"count": 0, "pid": one["pid"]}  # reused, and reset
    del second  # a dropped (truncated) episode's server goes back to the pool too
    gc.collect()
    fourth = counter_env(tmp_path)
    fourth.reset(task)
    assert read_state(fourth)["pid"] == two["pid"]


def test_fresh_and_shared_isolation(tmp_path):
    rows = [{"prompt": f"Say {i}.", "answer": str(i)} for i in range(4)]
    pids = []
    for _ in range(2):
        env = counter_env(tmp_path, rows, isolation="fresh")
        env.reset(env.tasks("train")[0])
        env.step(call("increment", by=1))
        pids.append(read_state(env))
        env.step(Message("assistant", "1"))
    assert pids[0]["pid"] != pids[1]["pid"] and pids[0]["count"] == pids[1]["count"] == 1
    states = []
    for _ in range(2):
        env = counter_env(tmp_path, rows, isolation="shared")
        env.reset(env.tasks("train")[0])
        env.step(call("increment", by=1))
        states.append(read_state(env))
    assert states[0]["pid"] == states[1]["pid"] and states[1]["count"] == 2


def test_a_server_over_streamable_http(tmp_path, server_log):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, COUNTER.split()[1], "--http", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        env = counter_env(tmp_path, server=f"http://127.0.0.1:{port}/mcp")
        env.reset(task_of(env, "Count to 3."))
        assert env.step(call("increment", by=3)).messages[0].content == "3"
        assert env.step(Message("assistant", "3")).outcome == "correct"
        assert [c["tool"] for c in logged(server_log)] == ["reset", "increment", "grade"]
    finally:
        mcp_client.close_all()
        server.terminate()
        server.wait(10)


# ------------------------------------------------------------------ faults


def test_a_call_past_its_timeout_raises_and_the_server_is_replaced(tmp_path):
    env = counter_env(tmp_path, call_timeout_s=1)
    task = task_of(env, "Count to 2.")
    env.reset(task)
    pid = read_state(env)["pid"]
    started = time.monotonic()
    with pytest.raises(EnvError, match="tool 'slow': no answer within 1 s"):
        env.step(call("slow", seconds=60))
    assert time.monotonic() - started < 5
    again = counter_env(tmp_path, call_timeout_s=1)
    again.reset(task)
    assert read_state(again)["pid"] != pid


def test_a_server_that_dies_in_a_call_raises_and_is_replaced(tmp_path):
    env = counter_env(tmp_path)
    task = task_of(env, "Count to 2.")
    env.reset(task)
    with pytest.raises(EnvError, match="tool 'crash': the server is gone"):
        env.step(call("crash"))
    again = counter_env(tmp_path)
    again.reset(task)
    assert again.step(call("increment", by=2)).messages[0].content == "2"


def test_a_server_that_will_not_start_is_an_env_error_with_its_stderr(tmp_path):
    with pytest.raises(EnvError, match="did not start(.|\n)*cannot open the inventory"):
        counter_env(tmp_path, server=COUNTER + " --fail-start")
    with pytest.raises(EnvError, match="did not start.*No such file"):
        counter_env(tmp_path, server="no-such-mcp-server --stdio")


def test_a_tool_schema_that_is_not_json_schema_is_an_env_error(tmp_path):
    with pytest.raises(EnvError, match="server tool 'odd''s input schema is not a valid"):
        counter_env(tmp_path, server=COUNTER + " --bad-schema")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "x", "answer": "1", "expeced_calls": []}, "row 1: unknown fields"),
        ({"prompt": "x"}, "row 1: nothing to score it by"),
        ({"answer": "1"}, "row 1 has neither a 'prompt' nor 'messages'"),
        ({"prompt": "x", "expected_calls": [{"name": "reset"}]},
         "row 1: field 'expected_calls': call 0 names 'reset', not one of the model's tools"),
        ({"prompt": "x", "expected_calls": [{"name": "increment", "arguments": {"by": "2"}}]},
         "row 1: field 'expected_calls': call 0 does not fit increment's schema at by"),
        ({"prompt": "x", "score_tool": "nope"}, "row 1: field 'score_tool': 'nope' is not a"),
        ({"prompt": "x", "score_tool": "read"},
         "row 1: field 'score_tool': 'read' must take the arguments 'answer' and"),
        ({"prompt": "x", "answer": "1", "info": [1]}, "row 1: field 'info': expected an"),
    ],
)  # fmt: skip
def test_bad_rows_name_the_file_the_row_and_the_field(tmp_path, row, message):
    with pytest.raises(EnvError, match="tasks.jsonl: " + message.replace("(", r"\(")):
        counter_env(tmp_path, [row, *ROWS], eval_path=str(write_rows(tmp_path / "e.jsonl",
                                                                      ROWS)))  # fmt: skip


def test_bad_arguments_are_clear(tmp_path):
    for args, message in [
        ({"isolation": "pooled"}, "isolation='pooled' is invalid"),
        ({"reset_tool": "clear"}, "isolation reset calls the tool 'clear'"),
        ({"tools": ["increment", "nope"]}, r"tools names \['nope'\]"),
        ({"server": ""}, "env.args.server is required"),
        ({"call_timeout_s": 0}, "call_timeout_s=0 is invalid"),
        ({"colour": "red"}, "bad env.args for 'mcp'.*colour"),
    ]:
        with pytest.raises(EnvError, match=message):
            counter_env(tmp_path, **args)
    env = counter_env(tmp_path, tools=["increment", "read"])
    assert [t["function"]["name"] for t in env.tools] == ["increment", "read"]


def test_the_env_is_listed_without_the_sdk_and_asks_for_it_when_used(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)
    assert "mcp" in list_envs()
    with pytest.raises(EnvError, match="pip install mcp"):
        counter_env(tmp_path)


# ------------------------------------------------------------------ the kit and a run


@pytest.mark.parametrize("answer_tool", [None, "answer"])
def test_the_example_passes_the_env_kit(answer_tool):
    args = {"server": f"python {SHOP / 'server.py'}", "tasks": str(SHOP / "train.jsonl"),
            "eval_path": str(SHOP / "eval.jsonl"), "isolation": "reset",
            "scorers": "numeric", "answer_tool": answer_tool}  # fmt: skip
    report = check_env("mcp", args, n=16)  # 16: the random agent writes every parse failure
    assert report.ok, [c for c in report.checks if not c.ok]
    assert report.agents["expert"].outcomes == {"correct": 16}


def test_looprl_run_plays_episodes_on_the_server(tmp_path, server_log):
    tasks = write_rows(tmp_path / "tasks.jsonl", ROWS * 2)
    config = {"env": {"name": "mcp", "args": {
        "server": COUNTER, "tasks": str(tasks), "eval_path": str(write_rows(
            tmp_path / "eval.jsonl", [{"prompt": "Count to 9.", "answer": "9", "score_tool":
                                       "grade", "info": {"target": 9}}])),
        "isolation": "reset", "max_turns": 2}}, "rollout": {"max_new_tokens": 48}}  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    # algo.expert_samples: each group also plays the row's demonstration through the env
    res = CliRunner().invoke(app, ["run", str(tmp_path / "run.yaml"), *TINY, "--set",
                                   "algo.expert_samples=1", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert (out / "metrics.jsonl").exists() and (out / "report.md").exists()
    baseline = json.loads((out / "eval" / "baseline.json").read_text())
    assert baseline["env"] == "mcp" and baseline["solved_outcomes"] == ["correct"]
    calls = [c["tool"] for c in logged(server_log)]
    # every episode started with a reset on its server (the tiny model's replies are cut
    # at the token limit); the expert episodes' calls and answers ran there too
    assert calls.count("reset") >= 4 + 2 * 2 and "increment" in calls and "grade" in calls
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert step["train/expert_advantage"] > 0  # the expert, scored on the server, did better


def test_a_run_on_a_broken_server_stops_before_the_model_loads(tmp_path):
    tasks = write_rows(tmp_path / "tasks.jsonl", ROWS)
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", *TINY, "--set", "env.name=mcp", "--set",
                                   f"env.args={{server: '{COUNTER} --fail-start', tasks: "
                                   f"'{tasks}'}}", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "did not start" in res.output and "cannot open the inventory" in res.output
    assert "load model" not in res.output and not out.exists()


def test_an_answer_tool_forces_every_reply_into_a_call(tmp_path, server_log):
    env = counter_env(tmp_path, answer_tool="answer")
    task = task_of(env, "Count to 3.")
    obs = env.reset(task)
    assert obs.tool_choice == "required" and obs.tools[-1]["function"]["name"] == "answer"
    assert not env.step(call("increment", by=3)).done
    result = env.step(call("answer", answer="3"))
    assert result.done and result.outcome == "correct" and result.reward == 1.0
    env.reset(task)
    no_call = env.step(Message("assistant", "3", parse_failure="no_tool_call"))
    assert no_call.outcome == "no_tool_call" and no_call.reward == -1.0
    demo = env.demonstrations(task)[-1]
    assert demo.tool_calls[0].name == "answer" and demo.tool_calls[0].arguments == {"answer": "3"}
    with pytest.raises(EnvError, match="answer_tool='increment' is invalid"):
        counter_env(tmp_path, answer_tool="increment")


def test_a_schema_the_grammar_cannot_force_stops_the_run_before_the_model_loads(tmp_path):
    tasks = write_rows(tmp_path / "tasks.jsonl", ROWS)
    out = tmp_path / "run"
    args = f"env.args={{server: '{COUNTER} --lookbehind', tasks: '{tasks}', answer_tool: answer}}"
    res = CliRunner().invoke(app, ["run", *TINY, "--set", "env.name=mcp", "--set", args,
                                   "--out", str(out)])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "cannot be forced" in res.output and "Lookbehind" in res.output
    assert "load model" not in res.output and not out.exists()
