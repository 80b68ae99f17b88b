"""A data file as an environment (`dataset`): each row a task, scored by named scorers.

    env:
      name: dataset
      args:
        path: examples/bookings/train.jsonl   # .jsonl, .csv, .parquet, a save_to_disk folder,
                                              # or org/name on the hub (split, revision, subset)
        eval_path: examples/bookings/eval.jsonl   # or eval_split, or eval_fraction: 0.2 of `path`
        answer_form: tool_call                # text | tool_call | json
        tools: [...]                          # or a `tools` column, one list per row
        scorers: tool_call                    # see envs/data/scorers.py

A row holds a `prompt` (text) or `messages` (a chat), optionally a `system` prompt, the
`answer`, per-row `tools` and an `info` object that scorers receive; `columns` maps these
names to the file's own (`eval_columns` to the eval file's, when it names them otherwise).
A relative path is looked up in the config file's folder and in the current folder
(data_files.py `find_file`). The answer forms:
- `text`: the reply's text is scored (default scorer `normalized`);
- `tool_call`: one forced call of the row's tools; the answer is `{name, arguments}` (or,
  with one tool, its arguments alone); default scorer `tool_call` (per-field credit);
- `json`: one JSON reply under `response_schema` (forced by the grammar); default scorer
  `json_fields`.

Reward: the weighted mean of the scores, in [0, 1]; a reply that cannot be scored (a parse
failure) earns `failure_reward` (-1 by default: below any wrong answer). Outcomes: `correct`
(every scorer gave 1), `partial`, `wrong`, and the parse failures. Each score, its label and
the per-field credit are in the episode's `info`.

The held-out split is `eval_path`, the `eval_split` of `path`, or a seeded `eval_fraction`
of the rows; either way a train row whose prompt equals a held-out row's is dropped (so they
never overlap), and a warning says how many; train prompts asked twice are kept, with a
warning. Rows
with an answer are demonstrations (`sft.enabled`). Everything is read and checked once, when
the first instance is made: a malformed row, a missing column, an answer that does not fit
its tools or schema, or a scorer that raises on a row's own answer is one EnvError naming the
file, the row and the field.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from looprl.chat.parsers import strip_fence
from looprl.envs.common import (
    check_choice,
    check_failure_reward,
    check_fraction,
    check_int,
    in_progress,
    reward_label,
    sample_items,
    unscored,
)
from looprl.envs.data.data_files import find_file
from looprl.envs.data.dataset_rows import COLUMNS, check_schema, check_tools, checked_rows, valid
from looprl.envs.data.score_types import Score, as_text, labelled
from looprl.envs.data.scorers import Scorer, combine, make_scorers
from looprl.errors import EnvError
from looprl.types import (
    ENV_ERROR,
    PARSE_FAILURES,
    Message,
    Observation,
    StepResult,
    Task,
    ToolCall,
)

FORMS = ("text", "tool_call", "json")
DEFAULT_SCORER = {"text": "normalized", "tool_call": "tool_call", "json": "json_fields"}


class Dataset:
    """Tasks from a data file, scored by named scorers (module docstring)."""

    name: ClassVar[str] = "dataset"
    description: ClassVar[str] = (
        "Your data file (JSONL, CSV, Parquet, datasets folder) scored by named scorers."
    )
    solved_outcomes: ClassVar[tuple[str, ...]] = ("correct",)
    # `looprl envs check` without names skips an env that cannot run without arguments
    needs_args: ClassVar[str] = "path=FILE (a data file of your own)"
    # the arguments that name files: a config's are looked up in its folder first
    path_args: ClassVar[tuple[str, ...]] = ("path", "eval_path")

    def __init__(
        self,
        path: str | None = None,
        eval_path: str | None = None,
        eval_fraction: float = 0.1,
        split_seed: int = 0,
        columns: dict[str, str] | None = None,
        eval_columns: dict[str, str] | None = None,
        split: str = "train",
        eval_split: str | None = None,
        revision: str | None = None,
        subset: str | None = None,
        answer_form: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str = "required",
        response_schema: dict[str, Any] | None = None,
        system_prompt: str | None = None,
        scorers: Any = None,
        failure_reward: float = -1.0,
    ) -> None:
        if not path:
            raise EnvError("dataset: env.args.path is required (a .jsonl, .csv or .parquet file)")
        check_fraction("eval_fraction", eval_fraction)
        check_failure_reward(failure_reward)
        _check_columns("columns", columns)
        _check_columns("eval_columns", eval_columns)
        if eval_columns is not None and not eval_path:
            raise EnvError(
                "eval_columns maps the columns of eval_path's file, and there is no eval_path: "
                "the held-out rows come from path, mapped by columns"
            )
        for key, value in (("split", split), ("eval_split", eval_split)):
            if value is not None and (not isinstance(value, str) or not value):
                raise EnvError(f"{key}={value!r} is invalid: expected a split's name (train)")
        form = answer_form or ("tool_call" if tools or _has_tools_column(columns) else "text")
        self.form = check_choice("answer_form", form, FORMS)
        if self.form == "json" and response_schema is not None:
            check_schema(response_schema, "response_schema")
        if tools is not None:
            check_tools(tools, "tools")
        self.tool_choice = tool_choice
        self.response_schema = response_schema
        self.failure_reward = float(failure_reward)
        self.reward_range = (self.failure_reward, 1.0)
        self.max_turns = 1
        self.scorers = make_scorers(scorers if scorers is not None else DEFAULT_SCORER[self.form])
        self.outcomes = _outcomes(self.form, self.scorers)
        # a scorer function of the user's, or a judge, may give only 0 or 1 (envs check)
        custom = any(":" in s.name or s.remote for s in self.scorers)
        self.uncertain_outcomes = ("partial",) if custom else ()
        self.spec = {
            "path": find_file(str(path), None, "env.args.path"),
            "eval_path": eval_path and find_file(str(eval_path), None, "env.args.eval_path"),
            "eval_fraction": float(eval_fraction),
            "split_seed": check_int("split_seed", split_seed),
            "columns": columns or {},
            "eval_columns": eval_columns,
            "split": split,
            "eval_split": eval_split,
            "revision": revision,
            "subset": subset,
            "form": self.form,
            "tools": tools,
            "tool_choice": tool_choice,
            "system_prompt": system_prompt,
            "scorers": scorers,
            "response_schema": response_schema,
            "failure_reward": self.failure_reward,
        }
        self.rows = checked_rows(self.spec, self)
        self._task: Task | None = None

    # ------------------------------------------------------------------ protocol

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        """Eval: every held-out row, or a seeded sample of `n` of them (never more than
        there are). Train: `n` rows, every row used before any is repeated."""
        check_choice("dataset: split", split, ("train", "eval"))
        pool = list(self.rows.train if split == "train" else self.rows.eval)
        if split == "eval" and n is not None and n >= len(pool):
            n = None  # all of them, in the file's order
        return sample_items(pool, n, seed)

    def reset(self, task: Task) -> Observation:
        self._task = task
        data = task.data
        messages = [Message(m["role"], m["content"]) for m in data["messages"]]
        if self.form == "tool_call":
            return Observation(messages, tools=data["tools"], tool_choice=self.tool_choice)
        fmt = None
        if self.form == "json":
            schema = self.response_schema
            fmt = (
                {"type": "json_object"}
                if schema is None
                else {
                    "type": "json_schema",
                    "json_schema": {"name": "answer", "schema": schema},
                }
            )
        return Observation(messages, tools=[], tool_choice="none", response_format=fmt)

    def step(self, message: Message) -> StepResult:
        task, self._task = in_progress("dataset", self._task), None
        response, failure = self.response(message, task)
        if failure is not None:
            return unscored(message, failure, self.failure_reward)
        reward, outcome, info = self.score(response, task)
        return StepResult([], done=True, reward=reward, outcome=outcome, info=info)

    def demonstrations(self, task: Task) -> list[Message]:
        """The row's answer as the assistant's reply (a call, JSON or text); none for a
        row without an answer."""
        if "answer" not in task.data:
            return []
        answer = task.data["answer"]
        if self.form == "tool_call":
            return [
                Message("assistant", tool_calls=[ToolCall(answer["name"], answer["arguments"])])
            ]
        if self.form == "json":  # as the grammar writes JSON: ", " and ": " separators
            return [Message("assistant", json.dumps(answer, ensure_ascii=False))]
        return [Message("assistant", as_text(answer))]

    # ------------------------------------------------------------------ scoring

    def score_groups(self, episodes: list[Any]) -> None:
        """Fill in a group judge's scores: each task's pending episodes (its group) are
        judged together, then their reward and outcome recomputed. A judge that keeps
        failing makes that group's episodes `env_error` (dropped and counted)."""
        group_scorers = [s for s in self.scorers if s.group]
        groups: dict[str, list[Any]] = {}
        for e in episodes:
            if e.info.get("pending_group") and e.outcome != ENV_ERROR:
                groups.setdefault(e.task.id, []).append(e)
        for members in groups.values():
            task = members[0].task
            replies = [[m for m in e.messages if m.role == "assistant"][-1] for e in members]
            responses = [self.response(reply, task)[0] for reply in replies]
            prompt = "\n\n".join(
                m["content"] for m in task.data["messages"] if m["role"] != "system"
            )
            try:
                for scorer in group_scorers:
                    values = scorer.fn.rank(prompt, task.data.get("answer"), responses)
                    for i, (e, value) in enumerate(zip(members, values)):
                        e.info["scores"][scorer.name] = value
                        e.info["labels"][scorer.name] = labelled(value).label
                        e.info["judge"] = {
                            **scorer.fn.last,
                            "calls": scorer.fn.last["calls"] if i == 0 else 0,
                            "seconds": scorer.fn.last["seconds"] if i == 0 else 0.0,
                        }
            except Exception as err:
                for e in members:
                    e.outcome, e.reward, e.error = ENV_ERROR, 0.0, f"group judge: {err}"
                continue
            for e in members:
                scores = [
                    Score(e.info["scores"][s.name], e.info["labels"][s.name]) for s in self.scorers
                ]
                e.reward, e.outcome = _verdict(self.scorers, scores)
                del e.info["pending_group"]

    def response(self, message: Message, task: Task) -> tuple[Any, str | None]:
        """What the scorers see in the reply, or the parse-failure label."""
        if self.form == "tool_call":
            if message.parse_failure is not None:
                return None, message.parse_failure
            if not message.tool_calls:
                return None, "no_tool_call"
            call = message.tool_calls[0]
            return {"name": call.name, "arguments": call.arguments}, None
        if self.form == "json":
            try:
                value = json.loads(strip_fence(message.content))
            except json.JSONDecodeError:
                return None, "bad_json"
            if self.response_schema is not None and not valid(value, self.response_schema):
                return None, "bad_arguments"
            return value, None
        return message.content, None

    def score(
        self, response: Any, task: Task, scorers: list[Scorer] | None = None
    ) -> tuple[float, str, dict[str, Any]]:
        """(reward, outcome, info) of a response to `task` by `scorers` (default: all);
        raises what a scorer raises."""
        scorers = self.scorers if scorers is None else scorers
        shown = [m["content"] for m in task.data["messages"] if m["role"] != "system"]
        row = {**task.data.get("info", {}), "task_id": task.id, "prompt_text": "\n\n".join(shown)}
        answer = task.data.get("answer")
        # a group judge scores the task's replies together, after the group is played
        # (score_groups): until then its score is 0 and the episode is marked pending
        scores: list[Score] = [
            Score(0.0, "pending") if s.group else s(response, answer, row) for s in scorers
        ]
        reward, outcome = _verdict(scorers, scores)
        info: dict[str, Any] = {
            "scores": {s.name: sc.value for s, sc in zip(scorers, scores)},
            "labels": {s.name: sc.label for s, sc in zip(scorers, scores)},
        }
        if any(s.group for s in scorers):
            info["pending_group"] = True
        judged = [s.fn.last for s in scorers if s.remote and getattr(s.fn, "last", None)]
        if judged:  # the verdicts' reasons, seconds and calls (summed in the metrics)
            info["judge"] = judged[0] if len(judged) == 1 else judged
        fields = {k: v for sc in scores for k, v in sc.fields.items()}
        if fields:
            info["fields"] = fields
        return reward, outcome, info


# ---------------------------------------------------------------------- reading and checks


def _verdict(scorers: list[Scorer], scores: list[Score]) -> tuple[float, str]:
    """The weighted mean of the scores, and the outcome: correct when every score is 1."""
    reward = combine(scorers, scores)
    labels = {sc.label for sc in scores}
    return reward, reward_label(reward, solved=labels == {"correct"})


def _outcomes(form: str, scorers: list[Scorer]) -> tuple[str, ...]:
    """The labels `step` can give: `partial` where scores can fall between 0 and 1 (several
    scorers, per-field credit or a function of yours), parse failures where a reply can
    fail to parse (a JSON reply: bad_json, or JSON that breaks the schema)."""
    all_or_nothing = ("exact", "normalized", "numeric", "regex", "contains")
    graded = len(scorers) > 1 or any(s.name not in all_or_nothing for s in scorers)
    failures = {"text": (), "json": ("bad_json", "bad_arguments"), "tool_call": PARSE_FAILURES}
    return ("correct", *(("partial",) if graded else ()), "wrong", *failures[form])


def _check_columns(key: str, columns: Any) -> None:
    if columns is None:
        return
    if not isinstance(columns, dict) or not all(isinstance(v, str) for v in columns.values()):
        raise EnvError(f"{key}={columns!r}: expected {{name: your column}}, e.g. {{prompt: q}}")
    unknown = set(columns) - set(COLUMNS)
    if unknown:
        raise EnvError(f"{key}: unknown names {sorted(unknown)}; known: {', '.join(COLUMNS)}")


def _has_tools_column(columns: dict[str, str] | None) -> bool:
    return "tools" in (columns or {})


ENVIRONMENTS: dict[str, type] = {"dataset": Dataset}

__all__ = ["Dataset", "Scorer"]
