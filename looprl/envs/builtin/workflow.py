"""Workflow: a customer-support agent working on a real SQLite database.

Each episode gets its own in-memory SQLite shop (customers, orders, shipments; see
`workflow_db`), generated from the task. The user message is one support request, from
one of four templates:

- `latest_undelivered`: refund the most recent undelivered (placed or shipped) order of
  the customer with email X;
- `update_address`: change the address of the customer with email X to Y;
- `refund_if_undelivered`: refund order N if it is not delivered, else change nothing
  (half of these tasks have nothing to do);
- `refund_placed`: refund every order of the customer with email X that has not shipped.

Tools: `find_customer(email)`, `list_orders(customer_id)`, `get_order(order_id)`,
`refund_order(order_id)`, `update_address(customer_id, address)` and `finish()`. Each
call is answered by a tool message of compact JSON; a bad request (unknown id, an order
already refunded) is answered `{"error": ...}` and the episode goes on. All calls of one
assistant message run in order; `finish` ends the episode and any calls after it are
ignored. With tool_choice "required" the decoder writes exactly one call per message.

Reward, from the final database state against the expected one (order statuses and
addresses, addresses compared case- and whitespace-insensitively):

    progress = intended changes made / intended changes   (no intended change: 1 if the
               state is untouched, else 0)
    reward   = clamp(progress - 0.5 * wrong - 0.5 * [turn limit hit], -1, 1)

where `wrong` counts values that differ from both the initial and the expected state
(a wrong refund, a wrong address). The episode ends at `finish` or, without it, at the
`max_turns`-th assistant message (outcome `turn_limit`). Outcomes: `success`, `partial`,
`no_change`, `wrong_side_effect`, `turn_limit`, and a parse failure (`no_tool_call`,
`bad_json`, `unknown_tool`, `bad_arguments`), which ends the episode with -1. Before the
end, `StepResult.reward` is what the episode would score if cut off now.
"""

from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import dataclass
from typing import Any, ClassVar

from looprl.envs.builtin.workflow_db import (
    TOOL_FUNCTIONS,
    UNDELIVERED,
    Shop,
    generate_shop,
    normalise_address,
    open_db,
    random_address,
    snapshot,
)
from looprl.envs.common import check_choice, check_int, task_indices
from looprl.errors import EnvError
from looprl.types import PARSE_FAILURES, Message, Observation, StepResult, Task, ToolCall

WRONG_CHANGE_PENALTY = 0.5
TURN_LIMIT_PENALTY = 0.5
LONGEST_PLAN = 5  # expert calls of the longest task: lookup, list, 2 refunds, finish


def _tool(name: str, description: str, **properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


_ID = {"type": "integer", "minimum": 1}
TOOLS: list[dict[str, Any]] = [
    _tool(
        "find_customer",
        "Find a customer by email.",
        email={"type": "string", "maxLength": 80},
    ),
    _tool("list_orders", "List a customer's orders, oldest first.", customer_id=_ID),
    _tool("get_order", "Get an order and its shipment.", order_id=_ID),
    _tool("refund_order", "Refund an order.", order_id=_ID),
    _tool(
        "update_address",
        "Set a customer's address.",
        customer_id=_ID,
        address={"type": "string", "minLength": 1, "maxLength": 100},
    ),
    _tool("finish", "Call when the request is done."),
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)

DEFAULT_PROMPT = (
    "You are a support agent for an online shop. Use the tools to look up customers and "
    "orders and to make changes. Order status is placed, shipped, delivered or refunded. "
    "Make only the changes the request asks for, then call finish."
)

# ------------------------------------------------------------------------------ templates

PROMPTS = {
    "latest_undelivered": "Refund the most recent order of the customer with email {email} "
    "that has not been delivered yet.",
    "update_address": "The customer with email {email} has moved. Change their address "
    "to: {address}",
    "refund_if_undelivered": "A customer asks about order {order_id}. Refund it if it has "
    "not been delivered yet; otherwise change nothing.",
    "refund_placed": "Refund every order of the customer with email {email} that has not "
    "shipped yet.",
}
TEMPLATES = tuple(PROMPTS)
# What the expert looks up before making the changes.
_LOOKUPS = {
    "latest_undelivered": ("find_customer", "list_orders"),
    "update_address": ("find_customer",),
    "refund_if_undelivered": ("get_order",),
    "refund_placed": ("find_customer", "list_orders"),
}


def _pick(template: str, shop: Shop, rng: random.Random) -> dict[str, Any] | None:
    """The task's target in `shop` (JSON data), or None when this shop has none."""
    customers = shop.customers
    if template == "latest_undelivered":
        fits = [c for c in customers if any(o.status in UNDELIVERED for o in shop.orders_of(c.id))]
    elif template == "refund_placed":  # 1-2 orders keep the expert within LONGEST_PLAN
        fits = [c for c in customers if 1 <= _placed_count(shop, c.id) <= 2]
    elif template == "update_address":
        customer = rng.choice(customers)
        address = random_address(rng)
        same = normalise_address(address) == normalise_address(customer.address)
        return None if same else {"email": customer.email, "address": address}
    else:
        delivered = rng.random() < 0.5  # half of these tasks need no change at all
        orders = [
            o for o in shop.orders if o.status in (("delivered",) if delivered else UNDELIVERED)
        ]
        return {"order_id": rng.choice(orders).id} if orders else None
    return {"email": rng.choice(fits).email} if fits else None


def _placed_count(shop: Shop, customer_id: int) -> int:
    return sum(o.status == "placed" for o in shop.orders_of(customer_id))


def intended_changes(shop: Shop, data: dict[str, Any]) -> dict[str, str]:
    """State key -> new value for every change the request asks for."""
    template = data["template"]
    if template == "refund_if_undelivered":
        order = next((o for o in shop.orders if o.id == data["order_id"]), None)
        if order is None:
            raise EnvError(f"order {data['order_id']} is not in the shop")
        return {f"order:{order.id}": "refunded"} if order.status in UNDELIVERED else {}
    customer = shop.customer_by_email(data["email"])
    if customer is None:
        raise EnvError(f"no customer with email {data['email']!r} in the shop")
    if template == "update_address":
        return {f"address:{customer.id}": normalise_address(data["address"])}
    wanted = UNDELIVERED if template == "latest_undelivered" else ("placed",)
    orders = [o for o in shop.orders_of(customer.id) if o.status in wanted]
    if template == "latest_undelivered":
        orders = orders[-1:]  # orders are oldest first
    if not orders:
        raise EnvError(f"the customer with email {data['email']!r} has no order to refund")
    return {f"order:{o.id}": "refunded" for o in orders}


def score(
    initial: dict[str, str], intended: dict[str, str], final: dict[str, str], cut_off: bool
) -> tuple[float, str, dict[str, Any]]:
    """(reward, outcome, details) of a final state; the formula is in the module docstring."""
    changed = {k: v for k, v in final.items() if v != initial.get(k)}
    correct = sum(final.get(k) == v for k, v in intended.items())
    wrong = sum(intended.get(k) != v for k, v in changed.items())
    progress = correct / len(intended) if intended else float(not changed)
    raw = progress - WRONG_CHANGE_PENALTY * wrong - TURN_LIMIT_PENALTY * cut_off
    reward = max(-1.0, min(1.0, raw))
    if cut_off:
        outcome = "turn_limit"
    elif wrong:
        outcome = "wrong_side_effect"
    elif progress == 1.0:
        outcome = "success"
    else:
        outcome = "partial" if correct else "no_change"
    details = {"intended": intended, "changed": changed, "correct": correct, "wrong": wrong}
    return reward, outcome, details


# ---------------------------------------------------------------------------- environment


@dataclass
class _Episode:
    data: dict[str, Any]
    db: sqlite3.Connection
    initial: dict[str, str]
    intended: dict[str, str]
    turns: int = 0
    done: bool = False


def _shop(task: Task) -> Shop:
    data = task.data
    if data.get("template") not in TEMPLATES or not isinstance(data.get("shop_seed"), int):
        raise EnvError(f"task {task.id!r}: data needs a known 'template' and an int 'shop_seed'")
    return generate_shop(data["shop_seed"])


def _failure(message: Message) -> str | None:
    """The parse-failure label of `message`, or None when it has calls to run."""
    if message.parse_failure is not None:
        if message.parse_failure not in PARSE_FAILURES:
            raise EnvError(f"unknown parse_failure {message.parse_failure!r}")
        return message.parse_failure
    if not message.tool_calls:
        return "no_tool_call"
    known = all(call.name in TOOL_NAMES for call in message.tool_calls)
    return None if known else "unknown_tool"


class WorkflowEnv:
    """Customer support over a per-episode SQLite shop; graded on the final database."""

    name: ClassVar[str] = "workflow"
    description: ClassVar[str] = "Customer-support tool calls on a per-episode SQLite shop."
    outcomes: ClassVar[tuple[str, ...]] = (
        "success",
        "partial",
        "no_change",
        "wrong_side_effect",
        "turn_limit",
        *PARSE_FAILURES,
    )
    solved_outcomes: ClassVar[tuple[str, ...]] = ("success",)
    reward_range: ClassVar[tuple[float, float]] = (-1.0, 1.0)

    def __init__(
        self,
        tool_choice: str = "required",
        eval_size: int = 64,
        max_turns: int = 6,
        templates: list[str] | None = None,
        system_prompt: str | None = None,
    ) -> None:
        self.tool_choice = check_choice("tool_choice", tool_choice, ("auto", "required"))
        self.eval_size = check_int("eval_size", eval_size, 1)
        # Fewer turns than the longest expert plan would make some tasks unwinnable.
        self.max_turns = check_int("max_turns", max_turns, LONGEST_PLAN, 50)
        chosen = list(TEMPLATES) if templates is None else templates
        if not isinstance(chosen, list | tuple) or not chosen:
            raise EnvError(f"templates={templates!r} is invalid: expected a non-empty list")
        self.templates = tuple(check_choice("templates item", t, TEMPLATES) for t in chosen)
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise EnvError(f"system_prompt={system_prompt!r} is invalid: expected a string")
        self.system_prompt = system_prompt or DEFAULT_PROMPT
        self._episode: _Episode | None = None

    # -------------------------------------------------------------------------- tasks

    def _task(self, split: str, index: int) -> Task:
        # Eval seeds are even and train seeds odd, so the splits never share a task.
        seed = 2 * index + (split == "train")
        template = self.templates[index % len(self.templates)]
        rng = random.Random(seed)
        for attempt in range(1000):  # a shop without a fitting target is rare: try the next
            shop_seed = 1000 * seed + attempt  # distinct for every task and attempt
            target = _pick(template, generate_shop(shop_seed), rng)
            if target is not None:
                data = {"template": template, "shop_seed": shop_seed, **target}
                return Task(id=f"workflow-{split}-{index}", data=data, seed=seed)
        raise EnvError(f"no shop fits template {template!r} for task {index}")  # pragma: no cover

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        """Eval: indices 0..eval_size-1. Train: an unbounded stream, so `n` is required."""
        indices = task_indices(self.name, split, n, seed, self.eval_size)
        return [self._task(split, i) for i in indices]

    # ------------------------------------------------------------------------ episode

    def reset(self, task: Task) -> Observation:
        shop = _shop(task)
        try:
            intended = intended_changes(shop, task.data)
            request = PROMPTS[task.data["template"]].format(**task.data)
        except (KeyError, EnvError) as err:
            raise EnvError(f"task {task.id!r} does not fit its shop: {err}") from None
        if self._episode is not None:
            self._episode.db.close()
        db = open_db(shop)
        self._episode = _Episode(dict(task.data), db, snapshot(db), intended)
        messages = [Message("system", self.system_prompt), Message("user", request)]
        return Observation(messages, tools=TOOLS, tool_choice=self.tool_choice)

    def step(self, message: Message) -> StepResult:
        episode = self._episode
        if episode is None or episode.done:
            raise EnvError(f"{self.name}: step() called without an episode in progress")
        episode.turns += 1
        failure = _failure(message)
        if failure is not None:
            return self._end(episode, [], reward=-1.0, outcome=failure, details={})
        replies, finished = [], False
        for call in message.tool_calls:
            finished = call.name == "finish"
            replies.append(self._answer(episode.db, call))
            if finished:
                break  # calls after finish are not run
        # An unfinished episode is scored as if cut off now; at max_turns it is.
        reward, outcome, details = score(
            episode.initial, episode.intended, snapshot(episode.db), cut_off=not finished
        )
        if finished or episode.turns >= self.max_turns:
            return self._end(episode, replies, reward, outcome, details)
        info = {"template": episode.data["template"], "turns": episode.turns, **details}
        return StepResult(replies, done=False, reward=reward, info=info)

    def _answer(self, db: sqlite3.Connection, call: ToolCall) -> Message:
        if call.name == "finish":
            result: Any = {"finished": True}
        elif isinstance(call.arguments, dict):
            result = TOOL_FUNCTIONS[call.name](db, call.arguments)
        else:
            result = {"error": "arguments must be a JSON object"}
        text = json.dumps(result, separators=(",", ":"))
        return Message("tool", text, tool_call_id=call.id, name=call.name)

    def _end(
        self,
        episode: _Episode,
        replies: list[Message],
        reward: float,
        outcome: str,
        details: dict[str, Any],
    ) -> StepResult:
        episode.done = True
        episode.db.close()
        info = {"template": episode.data["template"], "turns": episode.turns, **details}
        return StepResult(replies, done=True, reward=reward, outcome=outcome, info=info)

    # ------------------------------------------------------------------------- expert

    def demonstrations(self, task: Task) -> list[Message]:
        """One call per message: the template's lookups, each intended change, finish.
        Ids come from the shop, which the task's `shop_seed` regenerates exactly."""
        shop = _shop(task)
        data = task.data
        customer = shop.customer_by_email(data.get("email", ""))
        lookup_args = {
            "find_customer": {"email": data.get("email")},
            "list_orders": {"customer_id": customer.id if customer else None},
            "get_order": {"order_id": data.get("order_id")},
        }
        calls = [ToolCall(name, lookup_args[name]) for name in _LOOKUPS[data["template"]]]
        for key in intended_changes(shop, data):
            kind, _, ident = key.partition(":")
            if kind == "order":
                calls.append(ToolCall("refund_order", {"order_id": int(ident)}))
            else:
                args = {"customer_id": int(ident), "address": data["address"]}
                calls.append(ToolCall("update_address", args))
        calls.append(ToolCall("finish", {}))
        return [Message("assistant", tool_calls=[call]) for call in calls]


ENVIRONMENTS: dict[str, type] = {"workflow": WorkflowEnv}
