"""The workflow environment: generated shops, tasks, tools, scoring and whole episodes."""

from __future__ import annotations

import json
import os
import random
from collections import Counter

import pytest

from looprl.chat.parsers import validate_arguments
from looprl.envs.base import Environment, demonstrations
from looprl.envs.builtin.workflow import (
    ENVIRONMENTS,
    TEMPLATES,
    TOOLS,
    WorkflowEnv,
    intended_changes,
    score,
)
from looprl.envs.builtin.workflow_db import generate_shop, open_db, snapshot
from looprl.errors import EnvError
from looprl.types import PARSE_FAILURES, Message, Task, ToolCall

ENV = WorkflowEnv()
EVAL = ENV.tasks("eval")


def _call(name: str, call_id: str = "c1", **arguments: object) -> Message:
    return Message("assistant", tool_calls=[ToolCall(name, arguments, call_id)])


def _finish() -> Message:
    return _call("finish")


def _play(env: WorkflowEnv, task: Task, messages: list[Message]):
    """Reset, then step each message; returns every StepResult (stops when done)."""
    env.reset(task)
    results = []
    for message in messages:
        results.append(env.step(message))
        if results[-1].done:
            break
    return results


def _tool_result(result) -> object:
    (reply,) = result.messages
    assert reply.role == "tool"
    return json.loads(reply.content)


def _task_where(predicate, template: str) -> Task:
    """The first eval or train task of `template` whose intended changes satisfy `predicate`."""
    for task in EVAL + ENV.tasks("train", n=200, seed=7):
        shop = generate_shop(task.data["shop_seed"])
        if task.data["template"] == template and predicate(intended_changes(shop, task.data)):
            return task
    raise AssertionError(f"no {template} task fits")


# ------------------------------------------------------------------------------- the shop


def test_generated_shop_is_deterministic_and_well_formed() -> None:
    assert generate_shop(5) == generate_shop(5) and generate_shop(5) != generate_shop(6)
    for seed in range(50):
        shop = generate_shop(seed)
        assert 6 <= len(shop.customers) <= 10
        assert len({c.email for c in shop.customers}) == len(shop.customers)
        counts = Counter(o.customer_id for o in shop.orders)
        assert set(counts) == {c.id for c in shop.customers}
        assert all(1 <= k <= 4 for k in counts.values())
        dates = [o.placed_at for o in shop.orders]
        assert dates == sorted(set(dates))  # one order a day, ids in date order
        assert [o.id for o in shop.orders] == list(range(101, 101 + len(shop.orders)))
        shipped = {o.id: o.status for o in shop.orders if o.status in ("shipped", "delivered")}
        assert {s.order_id for s in shop.shipments} == set(shipped)
        for s in shop.shipments:
            assert s.status == ("delivered" if shipped[s.order_id] == "delivered" else "in_transit")


def test_database_lives_in_memory_only(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    db = open_db(generate_shop(1))
    assert [row[2] for row in db.execute("PRAGMA database_list")] == [""]  # no file
    assert snapshot(db)["order:101"] == generate_shop(1).orders[0].status
    env = WorkflowEnv()
    for task in EVAL[:8]:
        _play(env, task, demonstrations(env, task))
    assert os.listdir(tmp_path) == []


def test_two_envs_do_not_share_state() -> None:
    task = _task_where(lambda changes: len(changes) == 1, "refund_if_undelivered")
    order_id = task.data["order_id"]
    first, second = WorkflowEnv(), WorkflowEnv()
    first.reset(task)
    second.reset(task)
    assert _tool_result(first.step(_call("refund_order", order_id=order_id)))["status"] == (
        "refunded"
    )
    assert _tool_result(second.step(_call("get_order", order_id=order_id)))["status"] != (
        "refunded"
    )
    first.reset(task)  # a new episode starts from the generated shop again
    assert _tool_result(first.step(_call("get_order", order_id=order_id)))["status"] != ("refunded")


# ------------------------------------------------------------------------------ the tasks


def test_registry_protocol_and_tool_schemas() -> None:
    assert ENVIRONMENTS["workflow"] is WorkflowEnv and len(ENVIRONMENTS) == 1
    assert isinstance(ENV, Environment) and "\n" not in ENV.description
    assert set(ENV.outcomes) >= set(PARSE_FAILURES) and ENV.reward_range == (-1.0, 1.0)
    names = [tool["function"]["name"] for tool in TOOLS]
    assert names == [
        "find_customer",
        "list_orders",
        "get_order",
        "refund_order",
        "update_address",
        "finish",
    ]
    for tool in TOOLS:
        params = tool["function"]["parameters"]
        assert params["required"] == list(params["properties"])
        assert params["additionalProperties"] is False
    bad = ToolCall("get_order", {"order_id": 0})
    assert validate_arguments(bad, TOOLS) is not None
    assert validate_arguments(ToolCall("finish", {"why": "x"}), TOOLS) is not None


def test_tasks_are_deterministic_and_splits_disjoint() -> None:
    assert len(EVAL) == 64 and len({t.id for t in EVAL}) == 64
    assert WorkflowEnv().tasks("eval") == EVAL
    assert Counter(t.data["template"] for t in EVAL) == {name: 16 for name in TEMPLATES}
    train = ENV.tasks("train", n=300, seed=1)
    assert train == WorkflowEnv().tasks("train", n=300, seed=1)
    assert train != ENV.tasks("train", n=300, seed=2)
    assert len({t.id for t in train}) == 300
    assert not {t.id for t in EVAL} & {t.id for t in train}
    assert not {t.seed for t in EVAL} & {t.seed for t in train}
    assert not {t.data["shop_seed"] for t in EVAL} & {t.data["shop_seed"] for t in train}
    for task in EVAL + train:
        assert json.loads(json.dumps(task.data)) == task.data
    assert ENV.tasks("eval", n=5, seed=3) == ENV.tasks("eval", n=5, seed=3)
    assert len(WorkflowEnv(eval_size=3).tasks("eval", n=7)) == 7
    only = WorkflowEnv(templates=["update_address"]).tasks("train", n=10)
    assert {t.data["template"] for t in only} == {"update_address"}
    with pytest.raises(EnvError, match="pass n"):
        ENV.tasks("train")
    with pytest.raises(EnvError, match="split"):
        ENV.tasks("test")


def test_same_index_in_both_splits_is_a_different_task() -> None:
    # Train indices are sampled from a huge range, so check the small ones directly.
    train = [ENV._task("train", i) for i in range(len(EVAL))]
    assert not {t.seed for t in train} & {t.seed for t in EVAL}
    assert all(a.data != b.data for a, b in zip(train, EVAL))


def test_intended_changes_follow_the_request() -> None:
    """Recomputed here from the shop, independently of the env's own code."""
    kinds = Counter()
    for task in EVAL:
        data = task.data
        shop = generate_shop(data["shop_seed"])
        customer = shop.customer_by_email(data.get("email", ""))
        mine = shop.orders_of(customer.id) if customer else []
        if data["template"] == "latest_undelivered":
            open_orders = [o for o in mine if o.status not in ("delivered", "refunded")]
            latest = max(open_orders, key=lambda o: o.placed_at)
            expected = {f"order:{latest.id}": "refunded"}
            kinds["not the newest order"] += latest.id != max(o.id for o in mine)
        elif data["template"] == "refund_placed":
            expected = {f"order:{o.id}": "refunded" for o in mine if o.status == "placed"}
        elif data["template"] == "update_address":
            expected = {f"address:{customer.id}": data["address"].lower()}
            assert data["address"] != customer.address
        else:
            order = next(o for o in shop.orders if o.id == data["order_id"])
            expected = {} if order.status == "delivered" else {f"order:{order.id}": "refunded"}
            kinds[order.status] += 1
        assert intended_changes(shop, data) == expected
        assert 1 <= len(expected) <= 2 or data["template"] == "refund_if_undelivered"
    assert kinds["not the newest order"] > 0  # the newest order is not always the answer
    assert kinds["delivered"] > 0 and kinds["placed"] + kinds["shipped"] > 0


def test_prompt_stays_short(renderer) -> None:
    obs = ENV.reset(EVAL[0])
    assert [m.role for m in obs.messages] == ["system", "user"]
    assert obs.tools == TOOLS and obs.tool_choice == "required"
    assert len(renderer.prompt_ids(obs.messages, [])) < 150
    assert len(renderer.prompt_ids(obs.messages, obs.tools)) < 700


def test_expert_reaches_max_reward() -> None:
    env = WorkflowEnv()
    for task in EVAL + env.tasks("train", n=100, seed=4):
        demos = demonstrations(env, task)
        assert len(demos) <= env.max_turns
        for demo in demos:
            assert validate_arguments(demo.tool_calls[0], TOOLS) is None
        results = _play(env, task, demos)
        assert len(results) == len(demos)
        assert (results[-1].done, results[-1].outcome) == (True, "success")
        assert results[-1].reward == env.reward_range[1]
        assert not any(r.done for r in results[:-1])


# ---------------------------------------------------------------------------- the scoring


@pytest.mark.parametrize(
    ("intended", "final", "cut_off", "reward", "outcome"),
    [
        ({"order:1": "refunded"}, {"order:1": "refunded"}, False, 1.0, "success"),
        (
            {"order:1": "refunded", "order:2": "refunded"},
            {"order:1": "refunded"},
            False,
            0.5,
            "partial",
        ),  # fmt: skip
        ({"order:1": "refunded"}, {}, False, 0.0, "no_change"),
        (
            {"order:1": "refunded"},
            {"order:1": "refunded", "order:3": "refunded"},
            False,
            0.5,
            "wrong_side_effect",
        ),  # fmt: skip
        ({"order:1": "refunded"}, {"order:3": "refunded"}, False, -0.5, "wrong_side_effect"),
        ({}, {}, False, 1.0, "success"),  # nothing to do, nothing done
        ({}, {"order:3": "refunded"}, False, -0.5, "wrong_side_effect"),
        ({"address:1": "new"}, {"address:1": "typo"}, False, -0.5, "wrong_side_effect"),
        ({"order:1": "refunded"}, {"order:1": "refunded"}, True, 0.5, "turn_limit"),
        ({}, {}, True, 0.5, "turn_limit"),
        (
            {"order:1": "refunded"},
            {"order:2": "refunded", "order:3": "refunded"},
            True,
            -1.0,
            "turn_limit",
        ),  # fmt: skip  (-1.5 clamped)
    ],
)
def test_score(intended, final, cut_off, reward, outcome) -> None:
    initial = {"order:1": "placed", "order:2": "shipped", "order:3": "delivered", "address:1": "a"}
    got_reward, got_outcome, details = score(initial, intended, {**initial, **final}, cut_off)
    assert (got_reward, got_outcome) == (reward, outcome)
    assert details["intended"] == intended


def test_addresses_compare_loosely() -> None:
    task = next(t for t in EVAL if t.data["template"] == "update_address")
    customer = generate_shop(task.data["shop_seed"]).customer_by_email(task.data["email"])
    sloppy = "  " + task.data["address"].upper().replace(" ", "  ") + " "
    results = _play(ENV, task, [_call("update_address", customer_id=customer.id, address=sloppy),
                                _finish()])  # fmt: skip
    assert (results[-1].outcome, results[-1].reward) == ("success", 1.0)


# ------------------------------------------------------------------------- whole episodes


def _refunds(task: Task) -> list[int]:
    """The order ids that `task` should refund, in order."""
    changes = intended_changes(generate_shop(task.data["shop_seed"]), task.data)
    return sorted(int(key.split(":")[1]) for key in changes)


def test_every_outcome_is_reachable() -> None:
    task = _task_where(lambda changes: len(changes) == 2, "refund_placed")
    first, second = _refunds(task)
    bystander = next(o.id for o in generate_shop(task.data["shop_seed"]).orders
                     if o.status in ("shipped", "delivered"))  # fmt: skip
    refund = [_call("refund_order", f"r{i}", order_id=i) for i in (first, second, bystander)]
    looks = [_call("get_order", f"g{i}", order_id=first) for i in range(6)]
    short = WorkflowEnv(max_turns=5)
    cases = {
        "success": (ENV, demonstrations(ENV, task), 1.0),
        "partial": (ENV, [refund[0], _finish()], 0.5),
        "no_change": (ENV, [_finish()], 0.0),
        "wrong_side_effect": (ENV, [*refund, _finish()], 0.5),  # 1 - 0.5
        "turn_limit": (short, looks, -0.5),  # 0 - 0.5
    }
    for outcome, (env, messages, reward) in cases.items():
        last = _play(env, task, messages)[-1]
        assert (last.done, last.outcome, last.reward) == (True, outcome, reward)
    assert set(cases) | set(PARSE_FAILURES) == set(ENV.outcomes)
    results = _play(short, task, [*refund[:2], *looks])
    assert len(results) == 5 and results[-1].done and not results[-2].done
    assert (results[-1].outcome, results[-1].reward) == ("turn_limit", 0.5)  # all done, no finish
    assert results[-1].messages[0].tool_call_id == "g2"  # the last turn's calls still run


def test_step_reward_is_the_score_if_cut_off_now() -> None:
    task = _task_where(lambda changes: len(changes) == 2, "refund_placed")
    first, second = _refunds(task)
    refunds = [_call("refund_order", order_id=first), _call("refund_order", order_id=second)]
    results = _play(ENV, task, [*refunds, _finish()])
    assert [(r.done, r.reward) for r in results] == [(False, 0.0), (False, 0.5), (True, 1.0)]
    assert results[0].info["correct"] == 1 and results[1].info["turns"] == 2


def test_refunding_a_delivered_order_is_a_wrong_side_effect() -> None:
    task = _task_where(lambda changes: not changes, "refund_if_undelivered")
    refund = _call("refund_order", order_id=task.data["order_id"])
    assert _tool_result(_play(ENV, task, [refund])[0]) == {
        "id": task.data["order_id"],
        "status": "refunded",
    }  # the API allows it: deciding is the agent's job
    last = _play(ENV, task, [refund, _finish()])[-1]
    assert (last.outcome, last.reward) == ("wrong_side_effect", -0.5)
    assert _play(ENV, task, [_finish()])[-1].outcome == "success"


@pytest.mark.parametrize("failure", PARSE_FAILURES)
def test_parse_failures_end_the_episode(failure: str) -> None:
    env = WorkflowEnv()
    env.reset(EVAL[1])
    env.step(_call("get_order", order_id=101))
    result = env.step(Message("assistant", parse_failure=failure, parse_detail="x"))
    assert (result.done, result.outcome, result.reward, result.messages) == (
        True,
        failure,
        -1.0,
        [],
    )
    with pytest.raises(EnvError, match="step"):
        env.step(_finish())  # the episode is over


def test_odd_messages() -> None:
    env = WorkflowEnv(tool_choice="auto")
    assert _play(env, EVAL[0], [Message("assistant", "hello")])[-1].outcome == "no_tool_call"
    assert _play(env, EVAL[0], [_call("drop_table")])[-1].outcome == "unknown_tool"
    env.reset(EVAL[0])
    with pytest.raises(EnvError, match="parse_failure"):
        env.step(Message("assistant", parse_failure="gibberish"))
    with pytest.raises(EnvError, match="without an episode"):
        WorkflowEnv().step(_finish())


def test_tool_errors_are_tool_results() -> None:
    task = _task_where(lambda changes: len(changes) == 1, "refund_if_undelivered")
    order_id = task.data["order_id"]
    env = WorkflowEnv(max_turns=20)
    env.reset(task)
    cases = [
        (_call("get_order", order_id=9999), "no order with id 9999"),
        (_call("find_customer", email="nobody@example.com"), "no customer with email"),
        (_call("list_orders", customer_id=77), "no customer with id 77"),
        (_call("update_address", customer_id=1, address="   "), "non-empty"),
        (_call("refund_order", order_id="101"), "no order with id 101"),  # odd types
        (_call("list_orders", customer_id=True), "no customer with id True"),
        (Message("assistant", tool_calls=[ToolCall("get_order", None)]), "JSON object"),
        (_call("refund_order", order_id=order_id), None),
        (_call("refund_order", order_id=order_id), "already refunded"),
    ]
    for message, error in cases:
        result = env.step(message)
        assert not result.done
        (reply,) = result.messages
        assert (reply.role, reply.name) == ("tool", message.tool_calls[0].name)
        assert reply.tool_call_id == message.tool_calls[0].id
        if error is not None:
            assert error in json.loads(reply.content)["error"]
    assert result.info["correct"] == 1 and result.info["wrong"] == 0


def test_tool_results() -> None:
    task = next(t for t in EVAL if t.data["template"] == "latest_undelivered")
    shop = generate_shop(task.data["shop_seed"])
    customer = shop.customer_by_email(task.data["email"])
    env = WorkflowEnv()
    env.reset(task)
    found = _tool_result(env.step(_call("find_customer", email=task.data["email"].upper())))
    assert found == {"id": customer.id, "name": customer.name, "email": customer.email,
                     "address": customer.address}  # fmt: skip
    orders = _tool_result(env.step(_call("list_orders", customer_id=customer.id)))
    assert [o["id"] for o in orders] == [o.id for o in shop.orders_of(customer.id)]
    assert set(orders[0]) == {"id", "placed_at", "total", "status"}
    order = _tool_result(env.step(_call("get_order", order_id=orders[-1]["id"])))
    assert order["customer_id"] == customer.id and set(order["shipment"] or {}) <= {
        "carrier",
        "status",
        "updated_at",
    }


def test_several_calls_in_one_message_run_in_order_until_finish() -> None:
    task = _task_where(lambda changes: len(changes) == 2, "refund_placed")
    first, second = _refunds(task)
    calls = [
        ToolCall("refund_order", {"order_id": first}, "a"),
        ToolCall("finish", {}, "b"),
        ToolCall("refund_order", {"order_id": second}, "c"),
    ]
    result = _play(WorkflowEnv(tool_choice="auto"), task, [Message("assistant", tool_calls=calls)])
    (last,) = result
    assert [m.tool_call_id for m in last.messages] == ["a", "b"]  # "c" never ran
    assert (last.done, last.outcome, last.reward) == (True, "partial", 0.5)
    assert last.info["changed"] == {f"order:{first}": "refunded"}


def test_rewards_stay_in_range_for_random_agents() -> None:
    env, rng = WorkflowEnv(tool_choice="auto"), random.Random(0)
    outcomes = Counter()
    for task in EVAL + env.tasks("train", n=100, seed=9):
        env.reset(task)
        for _ in range(env.max_turns):
            name = rng.choice([t["function"]["name"] for t in TOOLS] + ["oops"])
            args = {"order_id": rng.randint(100, 140), "customer_id": rng.randint(0, 11),
                    "email": task.data.get("email", "x"), "address": "1 New St, Ely"}  # fmt: skip
            result = env.step(_call(name, **args))
            low, high = env.reward_range
            assert low <= result.reward <= high
            if result.done:
                assert result.outcome in env.outcomes
                outcomes[result.outcome] += 1
                break
    assert {"turn_limit", "wrong_side_effect", "unknown_tool"} <= set(outcomes)


# ------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tool_choice": "sometimes"}, "tool_choice='sometimes'.*auto, required"),
        ({"eval_size": 0}, "eval_size=0"),
        ({"max_turns": 4}, "max_turns=4"),
        ({"max_turns": "6"}, "max_turns='6'"),
        ({"templates": []}, "templates=\\[\\]"),
        ({"templates": "refund_placed"}, "templates='refund_placed'"),
        ({"templates": ["refund_everything"]}, "refund_everything"),
        ({"system_prompt": 3}, "system_prompt=3"),
    ],
)
def test_constructor_validation(kwargs: dict, needle: str) -> None:
    with pytest.raises(EnvError, match=needle):
        WorkflowEnv(**kwargs)


def test_bad_tasks_and_custom_prompt() -> None:
    env = WorkflowEnv(tool_choice="auto", system_prompt="Be brief.")
    obs = env.reset(EVAL[0])
    assert obs.tool_choice == "auto" and obs.messages[0].content == "Be brief."
    good = EVAL[0].data
    for data in (
        {},
        {**good, "template": "nope"},
        {**good, "email": "ghost@example.com"},
        {"template": "refund_if_undelivered", "shop_seed": 1, "order_id": 5},
    ):
        with pytest.raises(EnvError):
            env.reset(Task("bad", data))
