"""looprl's worker for a verifiers environment, run with verifiers' own Python:

    <python> worker.py --target <module[:name]> --args <json>
                       [--eval-fraction 0.1] [--split-seed 0]

verifiers pins `openai<3` (and `mcp==2.0.0`; its classic 0.1 API `datasets<4.7`), which
cannot share looprl's environment, so it runs here, in its own (`make setup-verifiers`),
and looprl (envs/adapters/verifiers_env.py) speaks to it over stdin/stdout, one JSON object a
line.
The installed version picks the API: 0.4 and later the v1 tasksets (vf_v1.py, in
`.venv-verifiers`), 0.1.x the classic environments (vf_classic.py, `.venv-verifiers-classic`).
Nothing here imports looprl.

The first line it writes is the environment's description (or why it cannot be loaded):

    {"ok": true, "result": {"api": "v1"|"classic", "weights": {fn: weight}, "tools": bool,
                            "train": [task], "eval": [task]}}
                                           task: {"index", "name", "prompt"}

then it answers each request `{"id": n, "op": ..., **params}` with `{"id": n, "ok": true,
"result": ...}` or `{"id": n, "ok": false, "error": text, "unsupported": bool}`:

    reset {episode, index}          -> {messages, tools}        (OpenAI function schemas)
    call  {episode, name, arguments} -> {content, error}         (one tool's result)
    score {episode, messages, stop} -> {rewards: {fn: [score, weight]}, metrics}

An episode is named by the caller; many are in flight at once, one request at a time.
Anything the script prints goes to stderr, which looprl keeps for its error messages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import traceback
from typing import Any

from vf_common import Unsupported, held_out_split, without_duplicates

# a dataset or model the taskset fetches from the Hugging Face hub fails at once, with a
# message naming the hub, instead of downloading in the middle of a run
HUB_MARKERS = ("OfflineModeIsEnabled", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "huggingface.co")


def load(target: str, config: dict[str, Any]) -> Any:
    """The loader for the installed verifiers, by its version: the v1 API (0.4 and later)
    or the classic API (0.1.x: `vf.Environment`; its package also has an older, different
    `verifiers.v1`, so the version decides, not what imports)."""
    import verifiers

    version = getattr(verifiers, "__version__", "0")
    major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if major_minor >= (0, 4):
        from vf_v1 import V1Tasks

        return V1Tasks(target, config)
    if major_minor[:2] == (0, 1):
        from vf_classic import ClassicTasks

        return ClassicTasks(target, config)
    raise Unsupported(
        f"verifiers {version} is neither the v1 API (>=0.4, make setup-verifiers: "
        ".venv-verifiers) nor the classic API looprl runs (0.1.x: .venv-verifiers-classic)"
    )


def describe(env: Any, eval_fraction: float, seed: int) -> dict[str, Any]:
    """The environment's reward weights and its two splits (the environment's own eval
    set where it has one, else a seeded held-out share)."""
    prompts = [env.prompt(i) for i in range(len(env.tasks))]
    held = env.eval_indices()
    if held is None:
        train, held = held_out_split(prompts, eval_fraction, seed)
    else:
        heldset = set(held)
        train = without_duplicates(
            prompts, [i for i in range(len(prompts)) if i not in heldset], held
        )
    return {
        "api": env.api,
        "weights": env.weights(),
        "tools": env.has_tools(),
        "train": [env.describe(i) for i in train],
        "eval": [env.describe(i) for i in held],
    }


def failure(err: BaseException) -> dict[str, Any]:
    if isinstance(err, Unsupported):
        return {"ok": False, "error": str(err), "unsupported": True}
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    if any(marker in text for marker in HUB_MARKERS):
        return {
            "ok": False,
            "unsupported": True,
            "error": "the environment fetches from the "
            "Hugging Face hub, which looprl does not reach while it runs (the worker "
            f"runs with HF_HUB_OFFLINE=1): {type(err).__name__}: {err}",
        }
    return {"ok": False, "error": text[-3000:], "unsupported": False}


def serve(env: Any, loop: asyncio.AbstractEventLoop, out: Any) -> None:
    ops = {"reset": env.reset, "call": env.call, "score": env.score}
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        rid, op = request.pop("id"), request.pop("op")
        try:
            reply = {"ok": True, "result": loop.run_until_complete(ops[op](**request))}
        except Exception as err:
            reply = failure(err)
        out.write(json.dumps({"id": rid, **reply}) + "\n")
        out.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--args", default="{}")
    parser.add_argument("--eval-fraction", type=float, default=0.1)
    parser.add_argument("--split-seed", type=int, default=0)
    options = parser.parse_args()
    out, sys.stdout = sys.stdout, sys.stderr  # the protocol owns stdout; prints go to stderr
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # a classic env's maps
    if os.getcwd() not in sys.path:  # the caller's modules import, as with `python -m`
        sys.path.insert(1, os.getcwd())
    loop = asyncio.new_event_loop()
    try:
        env = load(options.target, json.loads(options.args))
        loop.run_until_complete(env.start())
        reply = {"ok": True, "result": describe(env, options.eval_fraction, options.split_seed)}
    except Exception as err:
        reply = failure(err)
    out.write(json.dumps(reply) + "\n")
    out.flush()
    if reply["ok"]:
        serve(env, loop, out)


if __name__ == "__main__":
    main()
