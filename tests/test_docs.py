"""The hand-kept lists in the docs stay true to the tree: architecture.md's layer table,
import graph and modules over 400 lines, testing.md's table of test files, the module
paths the pages name, every relative link (and its anchor) in docs/ and README.md, and the
README's short result, and the length of the loop's functions. Each check names what to
add or remove;
`test_the_checks_catch_what_they_guard` plants a mistake of each kind."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import test_layers

REPO = Path(__file__).resolve().parent.parent
LOOPRL = REPO / "looprl"
ARCHITECTURE = REPO / "docs" / "architecture.md"
TESTING = REPO / "docs" / "testing.md"
LONG_MODULE = 400  # lines, counted as `wc -l` counts them
LONG_LOOP_FUNCTION = 80  # lines, from `def` to the function's last line


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section (up to the next heading of level 1 or 2)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^#{{1,2}} |\Z)", text, re.M | re.S)
    assert match, f"docs: no '## {heading}' section"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the markdown tables in `text`, as lists of cells."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|[-| :]+\|", line.strip()):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in rows if row[0] not in ("rank", "file", "section")]


def code_names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# --- modules over 400 lines -----------------------------------------------------------


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n")  # what `wc -l` counts


def long_modules(root: Path = LOOPRL) -> dict[str, int]:
    return {
        str(p.relative_to(root.parent)): n
        for p in sorted(root.rglob("*.py"))
        if (n := line_count(p)) > LONG_MODULE
    }


def listed_long_modules(text: str) -> dict[str, str]:
    """Module path -> its reason, from the bullets of "Modules over 400 lines"."""
    listed: dict[str, str] = {}
    for bullet in re.split(r"^- ", section(text, "Modules over 400 lines"), flags=re.M)[1:]:
        head, _, reason = bullet.partition("):")
        for path in re.findall(r"`(looprl/[^`]+\.py)`", head):
            listed[path] = " ".join(reason.split())
    return listed


def long_module_problems(text: str, actual: dict[str, int]) -> list[str]:
    listed = listed_long_modules(text)
    problems = [
        f"add `{path}` (≈ {n} lines) and why to architecture.md's 'Modules over 400 lines'"
        for path, n in actual.items()
        if path not in listed
    ]
    problems += [
        f"remove `{path}` from architecture.md's 'Modules over 400 lines': "
        + ("it is gone" if not (REPO / path).is_file() else f"{line_count(REPO / path)} lines")
        for path in listed
        if path not in actual
    ]
    problems += [f"give `{p}` its reason after '(≈ N):'" for p, r in listed.items() if not r]
    return problems


def test_modules_over_400_lines_are_listed_with_a_reason():
    problems = long_module_problems(ARCHITECTURE.read_text(), long_modules())
    assert not problems, "\n".join(problems)


# --- functions of the loop under 80 lines --------------------------------------------


def long_functions(folder: Path = LOOPRL / "loop") -> list[str]:
    """Each function (or method) in `folder/*.py` of LONG_LOOP_FUNCTION lines or more."""
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines >= LONG_LOOP_FUNCTION:
                    found.append(
                        f"{path.name}: {node.name} is {lines} lines; split it into its "
                        f"parts (under {LONG_LOOP_FUNCTION})"
                    )
    return found


def test_loop_functions_are_under_80_lines():
    problems = long_functions()
    assert not problems, "\n".join(problems)


# --- layers and the import graph ------------------------------------------------------


def printed_graph() -> str:
    """What `python tests/test_layers.py` prints."""
    script = Path(test_layers.__file__)
    return subprocess.run(
        [sys.executable, script], capture_output=True, text=True, check=True
    ).stdout


def documented_graph(text: str) -> str:
    block = re.search(r"```\nrank package +imports\n(.*?)```", section(text, "Import graph"), re.S)
    assert block, "architecture.md: no import-graph block under '## Import graph'"
    return block.group(1)


def layer_table(text: str) -> list[list[str]]:
    return [row for row in table_rows(section(text, "Layers")) if row[0].isdigit()]


def package_of(name: str) -> str:
    """`looprl/config/` -> config, `looprl/errors.py` -> errors."""
    return name.removeprefix("looprl/").removesuffix("/").removesuffix(".py")


def documented_layers(text: str) -> set[tuple[int, str]]:
    return {
        (int(row[0]), package_of(name)) for row in layer_table(text) for name in code_names(row[1])
    }


def graph_problems(text: str, actual: str) -> list[str]:
    if documented_graph(text) == actual:
        return []
    return [
        "architecture.md's import graph is stale; replace the block under '## Import graph' "
        "with the output of `python tests/test_layers.py`:\n" + actual
    ]


def test_import_graph_block_is_what_test_layers_prints():
    problems = graph_problems(ARCHITECTURE.read_text(), printed_graph())
    assert not problems, problems[0]


def layer_problems(text: str) -> list[str]:
    actual = {(rank, p) for rank, parts in enumerate(test_layers.LAYERS) for p in parts}
    documented = documented_layers(text)
    return [
        f"add rank {r} `{p}` to architecture.md's layer table"
        for r, p in sorted(actual - documented)
    ] + [
        f"remove rank {r} `{p}` from architecture.md's layer table (not in test_layers.LAYERS)"
        for r, p in sorted(documented - actual)
    ]


def test_layer_table_is_test_layers_layers():
    problems = layer_problems(ARCHITECTURE.read_text())
    assert not problems, "\n".join(problems)


FILE_NAME = re.compile(r"[\w./]+\.(py|jinja)|\w+/")


def module_table_problems(text: str, root: Path = LOOPRL) -> list[str]:
    """Each package's row names every module of it (and its sub-packages, as `name/`),
    and no file that is not there."""
    problems = []
    for row in layer_table(text):
        for package in (package_of(n) for n in code_names(row[1])):
            folder = root / package
            if not folder.is_dir():
                continue
            named = {n for n in code_names(row[2]) if FILE_NAME.fullmatch(n)}
            present = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
            present |= {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()}
            problems += [
                f"name `{n}` in the '{package}' row of architecture.md's layer table"
                for n in sorted(present - named)
            ]
            problems += [
                f"remove `{n}` from the '{package}' row of architecture.md's layer table: "
                f"no such file in looprl/{package}/"
                for n in sorted(named)
                if not (folder / n).exists() and not (root.parent / n).exists()
            ]
    return problems


def test_layer_table_names_every_module():
    problems = module_table_problems(ARCHITECTURE.read_text())
    assert not problems, "\n".join(problems)


# --- testing.md's table of test files -------------------------------------------------


def missing_test_files(text: str, tests: Path = REPO / "tests") -> list[str]:
    listed = {
        name for row in table_rows(section(text, "Test files")) for name in code_names(row[0])
    }
    present = {f"tests/{p.name}" for p in tests.glob("test_*.py")}
    return [
        f"add a row for `{n}` to testing.md's 'Test files'" for n in sorted(present - listed)
    ] + [
        f"remove `{n}` from testing.md's 'Test files': no such file"
        for n in sorted(listed - present)
    ]


def test_testing_md_lists_every_test_file():
    problems = missing_test_files(TESTING.read_text())
    assert not problems, "\n".join(problems)


# --- relative links -------------------------------------------------------------------


def without_code(text: str) -> str:
    """The text with fenced code blocks and inline code blanked out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"[`*]", "", heading.strip())
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base, n = slug(heading), 0
        while (name := base if n == 0 else f"{base}-{n}") in found:
            n += 1
        found.add(name)
    found |= set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))
    return found


def link_problems(page: Path) -> list[str]:
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        where = f"{page.relative_to(REPO)}: ({target})"
        if not linked.exists():
            problems.append(f"{where}: no file {file_part}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{where}: no heading with the anchor #{anchor} in {linked.name}")
    return problems


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


PACKAGES = "|".join(p.name for p in LOOPRL.iterdir() if (p / "__init__.py").is_file())
MODULE_PATH = re.compile(rf"`((?:looprl/)?(?:{PACKAGES})/[\w/]+\.py)`")


def stale_module_paths(page: Path) -> list[str]:
    """Module paths a page names in code spans (`looprl/loop/train.py`, `loop/train.py`)
    that are not in the tree."""
    named = sorted(set(MODULE_PATH.findall(page.read_text())))
    return [
        f"{page.relative_to(REPO)}: `{name}` is not in looprl/; name where it is now"
        for name in named
        if not (LOOPRL / name.removeprefix("looprl/")).is_file()
    ]


def test_module_paths_in_the_docs_exist():
    problems = [p for page in doc_pages() for p in stale_module_paths(page)]
    assert not problems, "\n".join(problems)


def test_relative_links_point_at_files_and_headings():
    problems = [p for page in doc_pages() for p in link_problems(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


# --- the checks themselves ------------------------------------------------------------


def test_the_checks_catch_what_they_guard(tmp_path):
    """A missing and a stale entry of each list, a wrong graph and a broken link are named."""
    text = ARCHITECTURE.read_text()
    extra = dict(long_modules(), **{"looprl/loop/huge.py": 812})
    assert "add `looprl/loop/huge.py` (≈ 812 lines)" in "\n".join(long_module_problems(text, extra))
    listed = "looprl/loop/was_long.py"  # listed, and no longer over (or gone)
    stale = text.replace(
        "`tests/test_docs.py` holds\nthis list to the tree).",
        f"`tests/test_docs.py` holds\nthis list to the tree).\n\n- `{listed}` (≈ 420): a reason.",
    )
    assert listed in listed_long_modules(stale)
    assert any(f"remove `{listed}`" in p for p in long_module_problems(stale, long_modules()))

    planted = text.replace("`looprl/config/`", "`looprl/config/`, `looprl/nowhere/`", 1)
    assert "remove rank 1 `nowhere`" not in "\n".join(layer_problems(text))
    assert "remove rank 1 `nowhere`" in "\n".join(layer_problems(planted))
    graph = documented_graph(text)
    assert graph_problems(text, graph) == []
    assert graph_problems(text.replace("─► cli\n", "─► cli, loop\n", 1), graph)

    (tmp_path / "long.py").write_text(
        "def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 79
    )
    assert long_functions(tmp_path) == [
        "long.py: long is 80 lines; split it into its parts (under 80)"
    ]

    (tmp_path / "config").mkdir()
    for name in (
        "__init__.py",
        "sections.py",
        "evaluation.py",
        "algo.py",
        "base.py",
        "run.py",
        "load.py",
        "extra.py",
    ):
        (tmp_path / "config" / name).write_text("")
    stale = text.replace("`load.py`", "`loader.py`", 1)
    assert module_table_problems(stale, tmp_path) == [
        "name `extra.py` in the 'config' row of architecture.md's layer table",
        "name `load.py` in the 'config' row of architecture.md's layer table",
        "remove `loader.py` from the 'config' row of architecture.md's layer table: "
        "no such file in looprl/config/",
    ]

    (tmp_path / "test_new.py").write_text("")
    testing = "## Test files\n\n| file | covers |\n|---|---|\n| `tests/test_old.py` | x |\n"
    assert missing_test_files(testing, tmp_path) == [
        "add a row for `tests/test_new.py` to testing.md's 'Test files'",
        "remove `tests/test_old.py` from testing.md's 'Test files': no such file",
    ]

    page = REPO / "docs" / "_docs_probe.md"
    page.write_text("`loop/train.py`, `looprl/loop/gone.py`, `bench/learning/run.py`\n")
    try:
        assert stale_module_paths(page) == [
            "docs/_docs_probe.md: `looprl/loop/gone.py` is not in looprl/; name where it is now"
        ]
    finally:
        page.unlink()
    page.write_text(
        "# Probe\n\n## A `code` heading, too\n\n[a](#a-code-heading-too) [b](#nope) "
        "[c](missing.md) [d](architecture.md#layers) `[e](inline.md)`\n"
    )
    try:
        assert link_problems(page) == [
            "docs/_docs_probe.md: (#nope): no heading with the anchor #nope in _docs_probe.md",
            "docs/_docs_probe.md: (missing.md): no file missing.md",
        ]
    finally:
        page.unlink()


def test_readme_result_is_short():
    """The README's result: at most 15 lines, a picture and a link to the demo's page."""
    readme = (REPO / "README.md").read_text()
    result = section(readme, "The demo's result").strip("\n").splitlines()
    assert len(result) <= 14, (
        f"README's 'The demo's result' has {len(result) + 1} lines; 15 at most"
    )
    assert any(line.startswith("![") for line in result), "README's result: add its picture"
    assert "(docs/learning/demo.md)" in "\n".join(result), "README's result: link the demo's page"
    lines = len(readme.splitlines())
    assert lines <= 250, f"README.md has {lines} lines; keep it at 250 or fewer"


# --- who reads each config section ----------------------------------------------------

READERS_HEADING = "Where each config section is consumed"
CONFIG_PACKAGES = ("loop", "report", "plan", "apps", "cli")  # the packages that import it


def config_sections() -> dict[str, type]:
    """Section name -> its pydantic model, in the config's order (`model`, `env`, ...)."""
    from looprl.config import Config

    return {
        name: field.annotation
        for name, field in Config.model_fields.items()
        if hasattr(field.annotation, "model_fields")
    }


def config_reads(root: Path = LOOPRL) -> dict[str, dict[str, set[str]]]:
    """Section -> module (relative to looprl/) -> the fields it reads: as
    `<config>.<section>.<field>` (`cfg.rollout.top_p`, `self.cfg.algo.loss_on`), or through
    a parameter annotated with the section's type (`algo: AlgoConfig` ... `algo.eps_low`)."""
    import ast

    sections = config_sections()
    by_type = {model.__name__: name for name, model in sections.items()}
    reads: dict[str, dict[str, set[str]]] = {name: {} for name in sections}
    for path in sorted(root.rglob("*.py")):
        module = str(path.relative_to(root))
        if not module.startswith(CONFIG_PACKAGES):
            continue
        tree = ast.parse(path.read_text())
        typed: dict[str, str] = {}  # parameter name -> section, over the whole module
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.annotation is not None:
                kind = ast.unparse(node.annotation).strip("'\"")
                if kind in by_type:
                    typed[node.arg] = by_type[kind]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            inner = node.value
            if isinstance(inner, ast.Attribute) and inner.attr in sections:
                name = inner.attr
            elif isinstance(inner, ast.Name) and inner.id in typed:
                name = typed[inner.id]
            else:
                continue
            if node.attr in sections[name].model_fields:
                reads[name].setdefault(module, set()).add(node.attr)
    return reads


def readers_markdown(reads: dict[str, dict[str, set[str]]]) -> str:
    """The table architecture.md holds: per section, the modules that read the same fields
    in one row (modules in path order, fields in the section's order)."""
    sections = config_sections()
    lines = ["| section | read by | fields |", "|---|---|---|"]
    for name, modules in reads.items():
        order = list(sections[name].model_fields)
        rows: dict[tuple[str, ...], list[str]] = {}
        for module, fields in sorted(modules.items()):
            rows.setdefault(tuple(sorted(fields, key=order.index)), []).append(module)
        for i, (fields, readers) in enumerate(sorted(rows.items(), key=lambda r: r[1][0])):
            head = f"`{name}`" if i == 0 else ""
            who = ", ".join(f"`{m}`" for m in readers)
            lines.append(f"| {head} | {who} | {', '.join(f'`{f}`' for f in fields)} |")
    return "\n".join(lines) + "\n"


def documented_readers(text: str) -> str:
    body = section(text, READERS_HEADING)
    return "\n".join(line for line in body.splitlines() if line.startswith("|")) + "\n"


def readers_problems(text: str, reads: dict[str, dict[str, set[str]]]) -> list[str]:
    actual = readers_markdown(reads)
    if documented_readers(text) == actual:
        return []
    return [
        f"architecture.md's '{READERS_HEADING}' table is stale; replace it with the output "
        "of `python tests/test_docs.py`:\n" + actual
    ]


def test_config_readers_table_is_what_the_code_reads():
    problems = readers_problems(ARCHITECTURE.read_text(), config_reads())
    assert not problems, problems[0]


def test_the_config_readers_check_catches_a_new_and_a_gone_reader(tmp_path):
    text = ARCHITECTURE.read_text()
    reads = config_reads()
    assert (
        readers_problems(text.replace(documented_readers(text), readers_markdown(reads)), reads)
        == []
    )
    planted = {**reads, "rollout": {**reads["rollout"], "loop/new.py": {"top_p"}}}
    assert "`loop/new.py` | `top_p`" in readers_markdown(planted)
    assert readers_problems(
        text.replace(documented_readers(text), readers_markdown(reads)), planted
    )
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "probe.py").write_text(
        "def f(cfg, algo: AlgoConfig):\n    return cfg.rollout.top_p, algo.eps_low, algo.nope\n"
    )
    found = config_reads(tmp_path)
    assert found["rollout"] == {"loop/probe.py": {"top_p"}}
    assert found["algo"] == {"loop/probe.py": {"eps_low"}}


if __name__ == "__main__":
    print(readers_markdown(config_reads()), end="")
