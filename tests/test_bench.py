"""The benchmarks (bench/) reach looprl through its public entry points only, and each
one still starts.

A benchmark runs looprl through the CLI (bench/harness.py `looprl_run`) or imports
package-level names: `from looprl.envs import make_env`, where `looprl/envs` is a package,
plus the model loader `looprl.model.load` and the root modules `looprl.types`,
`looprl.seeds` and `looprl.errors`. It never imports a module object of looprl
(`import looprl.loop.update as update`) and never assigns to an attribute of anything it
imported (`train.player = ...`, `torch.Tensor.backward = ...`, `setattr(module, ...)`):
a refactor inside a package would otherwise change what it measures, or break it, with no
test noticing. The Python blocks of the shell checks (`<<'PY'` heredocs) are held to the
same rules.

AWAITING_EXPORT lists the names benchmarks still take from a module inside a package,
until that package exports them; then the import becomes `from looprl.<package> import
name` and the entry goes. An entry no benchmark uses fails the test, so the list only
shrinks. Each check is also run on planted bad code, so that it is known to fail.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
LOOPRL = REPO / "looprl"
PUBLIC_MODULES = {"looprl.model.load", "looprl.types", "looprl.seeds", "looprl.errors"}

# (module, name): taken from inside a package until the package exports the name.
AWAITING_EXPORT: set[tuple[str, str]] = {
    ("looprl.apps.loading", "load_chat_model"),
    ("looprl.apps.serve", "create_app"),
    ("looprl.apps.serve", "serving"),
    ("looprl.engine.hf", "HFEngine"),
    ("looprl.engine.vllm", "VLLMEngine"),
    ("looprl.engine.vllm_server", "LaunchSpec"),
    ("looprl.envs.check", "AgentStats"),
    ("looprl.envs.check", "play"),
    ("looprl.envs.builtin.tictactoe", "score_move"),
    ("looprl.envs.builtin.tictactoe", "TicTacToeMove"),
    ("looprl.envs.builtin.tictactoe_board", "expert_move"),
    ("looprl.forward.prefix", "shared_prefill"),
    ("looprl.forward.fast_linear", "enable"),
    ("looprl.forward.fast_linear", "enabled"),
    ("looprl.forward.score", "micro_batches"),
    ("looprl.forward.score", "prompt_length"),
    ("looprl.forward.score", "sequence_logprobs"),
    ("looprl.loop.groups", "Group"),
    ("looprl.loop.optim", "make_optimizer"),
    ("looprl.loop.play", "player"),
    ("looprl.loop.policy", "add_lora"),
    ("looprl.loop.policy", "load_policy"),
    ("looprl.loop.rollout", "run_episodes"),
    ("looprl.loop.snapshot", "start_snapshots"),
    ("looprl.loop.update", "UpdateState"),
    ("looprl.loop.batches", "minibatches"),
    ("looprl.loop.batches", "scoring_keys"),
    ("looprl.loop.update", "update_policy"),
    ("looprl.loop.dist", "start"),
    ("looprl.loop.dist", "stop"),
    ("looprl.loop.shard", "full_weights"),
    ("looprl.loop.shard", "start_replicas"),
    ("looprl.loop.shard", "wrap_units"),
    ("looprl.model.arch", "router_modules"),
    ("looprl.model.memory", "release_free_memory"),
    ("looprl.model.tiny", "TINY_ARCHITECTURES"),
    ("looprl.model.tiny", "build_tiny"),
    ("looprl.model.tiny", "perturb_adapters"),
}


def is_package(module: str) -> bool:
    return (REPO / module.replace(".", "/") / "__init__.py").is_file()


def is_module(module: str) -> bool:
    path = REPO / module.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def python_sources() -> dict[str, str]:
    """Every bench Python file, and every Python heredoc of its shell scripts."""
    sources = {str(p.relative_to(REPO)): p.read_text() for p in sorted(BENCH.rglob("*.py"))}
    for script in sorted(BENCH.rglob("*.sh")):
        blocks = re.findall(r"<<'PY'\n(.*?)\nPY\n", script.read_text(), flags=re.S)
        for i, block in enumerate(blocks):
            sources[f"{script.relative_to(REPO)} (python block {i + 1})"] = block
    return sources


def problems(source: str, used: set[tuple[str, str]] | None = None) -> list[str]:
    """What breaks the rules in one source; `used` collects the AWAITING_EXPORT entries
    it relies on."""
    tree = ast.parse(source)
    found: list[str] = []
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported.add((alias.asname or alias.name).split(".")[0])
                if alias.name.split(".")[0] == "looprl":
                    found.append(f"line {node.lineno}: `import {alias.name}` (a module object)")
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.update(alias.asname or alias.name for alias in node.names)
            if node.module.split(".")[0] == "looprl":
                found += from_import_problems(node, used)
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
        ):
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for target in targets:
            root = target
            while isinstance(root, ast.Attribute | ast.Subscript):
                root = root.value
            if target is not root and isinstance(root, ast.Name) and root.id in imported:
                found.append(f"line {node.lineno}: assigns to `{ast.unparse(target)}` of an import")
    return found


def from_import_problems(node: ast.ImportFrom, used: set[tuple[str, str]] | None) -> list[str]:
    module, found = node.module or "", []
    for alias in node.names:
        if is_module(f"{module}.{alias.name}"):
            found.append(f"line {node.lineno}: `from {module} import {alias.name}` (a module)")
        elif is_package(module) or module in PUBLIC_MODULES:
            continue
        elif (module, alias.name) in AWAITING_EXPORT:
            if used is not None:
                used.add((module, alias.name))
        else:
            found.append(
                f"line {node.lineno}: `from {module} import {alias.name}`: import it from the "
                "package (`from looprl.<package> import name`)"
            )
    return found


def test_benchmarks_use_public_entry_points_only():
    used: set[tuple[str, str]] = set()
    found = {name: problems(source, used) for name, source in python_sources().items()}
    assert {name: p for name, p in found.items() if p} == {}
    assert AWAITING_EXPORT - used == set(), "exported now or no longer used: drop from the list"


@pytest.mark.parametrize(
    "bad",
    [
        "import looprl.loop.train as train",
        "from looprl.loop.update import update_state_of_the_art",
        "from looprl.loop import update",
        "from looprl import loop",
        "from looprl.envs import make_env\nmake_env.cache = {}",
        "from looprl.loop.policy import load_policy\nload_policy.__defaults__ = ()",
        "import torch\ntorch.Tensor.backward = print",
        "from looprl.envs import make_env\nsetattr(make_env, 'x', 1)",
        "def f():\n    from looprl.engine.hf import generate_fast",
    ],
)
def test_the_rules_catch_planted_code(bad):
    assert problems(bad)


def test_the_rules_pass_public_code():
    good = (
        "from looprl.envs import make_env\nfrom looprl.model.load import load_tokenizer\n"
        "from looprl.seeds import step_seed\nfrom looprl.engine.hf import HFEngine\n"
        "env = make_env('tictactoe-move')\nenv.seed = 3\n"
    )
    assert problems(good) == []


def scripts() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if "__main__" in p.read_text())


def test_every_script_is_found():
    names = {str(p.relative_to(BENCH)) for p in scripts()}
    assert {"speed/rollout.py", "speed/step.py", "checks/compat.py", "learning/run.py"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("script", scripts(), ids=lambda p: str(p.relative_to(BENCH)))
def test_script_help_runs(script, tmp_path):
    """`--help` from another folder: the script's imports (looprl's and the harness's) hold."""
    done = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
