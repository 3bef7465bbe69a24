"""The house rules, read from the source (AST): one budget rule, one page size, one reproducibility rule.

Each test names the place that breaks a rule, file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The project's own packages (tests, generated gRPC stubs and vendored code aside).
PACKAGES = ("sparrow", "sparrow_cli", "services", "trainer", "offline", "report", "kernels", "bench", "models")
GENERATED = ("services/api/",)

# The rules of `sparrow.budget`: nowhere else may a function of these names be defined.
BUDGET_RULES = {
    "kept_budget",
    "step_budget",
    "in_pages",
    "whole_pages",
    "replay_pages",
    "reproducible",
    "page_mismatch",
}
# Earlier names of the same rules, gone for good.
RETIRED = {"usable"}
# Where page arithmetic (a division or remainder by the page size) may be written: the kernels, the
# budget rule, and the plugin's views of the engine's cache blocks as pages (layout, not budgets).
PAGE_ARITHMETIC = ("kernels/", "sparrow/budget.py", "services/generator/plugin/page_centroids.py",
                   "services/generator/plugin/sparse_impl.py")  # fmt: skip
# The rooms that deal in budgets, where the page arithmetic is checked.
BUDGET_ROOMS = ("sparrow/", "trainer/", "services/generator/", "services/trainer/")


def project_files() -> list[tuple[str, ast.Module]]:
    """(path relative to the root, parsed module) for every Python file of the project's packages."""
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(GENERATED):
                out.append((rel, ast.parse(path.read_text(), rel)))
    return out


FILES = project_files()


def _names_page(node: ast.expr) -> bool:
    """Whether `node` is the page size: `PAGE_SIZE`, `<x>.page_size`, `page_size` or a bare 16."""
    if isinstance(node, ast.Constant):
        return node.value == 16 and type(node.value) is int
    if isinstance(node, ast.Name):
        return node.id in ("PAGE_SIZE", "page_size")
    return isinstance(node, ast.Attribute) and node.attr in ("PAGE_SIZE", "page_size")


def _is_kernel_page(node: ast.expr) -> bool:
    """Whether `node` is the kernels' page size itself (`PAGE_SIZE` or a bare 16), not a schedule's field."""
    if isinstance(node, ast.Constant):
        return _names_page(node)
    return (node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)) == "PAGE_SIZE"


def test_the_project_files_are_found():
    paths = {p for p, _ in FILES}
    assert {"sparrow/budget.py", "kernels/pages.py", "trainer/exact_alpha.py"} <= paths


def test_the_page_size_is_defined_once():
    found = []
    for rel, tree in FILES:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [f"{rel}:{node.lineno}" for t in targets if isinstance(t, ast.Name) and t.id == "PAGE_SIZE"]
    assert len(found) == 1 and found[0].startswith("kernels/pages.py:"), f"PAGE_SIZE defined at {found}"


def test_the_budget_rules_are_defined_once():
    found: dict[str, list[str]] = {}
    for rel, tree in FILES:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = getattr(node, "name", None)
                if name in BUDGET_RULES | RETIRED:
                    found.setdefault(name, []).append(f"{rel}:{node.lineno}")
    assert not [n for n in found if n in RETIRED], found
    twice = {name: where for name, where in found.items() if len(where) > 1 or not where[0].startswith("sparrow/")}
    assert not twice, f"a budget rule defined outside sparrow/budget.py or twice: {twice}"
    assert set(found) == BUDGET_RULES, f"missing from sparrow/budget.py: {BUDGET_RULES - set(found)}"
    assert {w[0].split(":")[0] for w in found.values()} == {"sparrow/budget.py"}


def test_page_arithmetic_stays_in_the_budget_rule():
    """A budget turned into pages, or checked against the page, by hand is a second copy of the rule."""
    found = []
    for rel, tree in FILES:
        if not rel.startswith(BUDGET_ROOMS) or rel.startswith(PAGE_ARITHMETIC):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv | ast.Mod) and _names_page(node.right):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Compare) and any(_is_kernel_page(c) for c in [node.left, *node.comparators]):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "page arithmetic outside sparrow.budget (call its rules):\n" + "\n".join(found)


def test_the_guard_sees_a_second_rule():
    """The checks above find what they look for (a test that cannot fail guards nothing)."""
    tree = ast.parse("def reproducible(r):\n    return all(b % 16 == 0 for b in r)\nx = b // s.page_size\n")
    ops = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and _names_page(n.right)]
    assert len(ops) == 2
    assert [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)] == ["reproducible"]


# -- no import circles ---------------------------------------------------------------------------------


def module_name(rel: str) -> str:
    """`services/generator/plugin/__init__.py` -> `services.generator.plugin`."""
    parts = rel[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(rel): rel for rel, _ in FILES}


def imported_modules(rel: str, tree: ast.Module) -> set[str]:
    """The project's modules that `rel` imports anywhere: at the top, inside functions, under TYPE_CHECKING."""
    here = module_name(rel)
    package = here if rel.endswith("__init__.py") else here.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from a import b` imports the module a.b when there is one, else a name of a.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != here:
                out.add(target)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


GRAPH = {module_name(rel): imported_modules(rel, tree) for rel, tree in FILES}


def test_the_import_graph_is_read():
    assert "kernels.pages" in GRAPH["sparrow.budget"]
    assert "trainer.exact_alpha" in GRAPH["trainer.rl_update"]  # an import inside a function counts
    assert "sparrow.schedule" in GRAPH["trainer.sparse_attention"]  # and one under TYPE_CHECKING
    assert "kernels.layout" in GRAPH["kernels.select"]  # and a relative one


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_import_circle():
    found = circles(GRAPH)
    ties = [" <-> ".join(c) + ": " + "; ".join(f"{m} -> {sorted(GRAPH[m] & set(c))}" for m in c) for c in found]
    assert not found, "import circles:\n" + "\n".join(ties)


def test_kernels_import_nothing_of_ours_and_the_core_no_service():
    ours = {name.split(".")[0] for name in MODULES}
    for name, targets in GRAPH.items():
        roots = {t.split(".")[0] for t in targets}
        if name.split(".")[0] == "kernels":
            assert roots <= {"kernels"}, f"{name} imports {sorted(targets)}"
        if name.split(".")[0] == "sparrow":
            assert roots & ours <= {"sparrow", "kernels"}, f"{name} imports {sorted(targets)}"


def test_reporting_reads_run_folders_and_nothing_that_runs():
    """`report` builds what a run folder says (`sparrow report RUN_DIR`): it needs the core and nothing that
    starts, supervises or serves (the launcher calls it at the end of a run, never the other way round)."""
    assert any(name.startswith("report.") for name in GRAPH)
    for name, targets in GRAPH.items():
        if name.split(".")[0] == "report":
            roots = {t.split(".")[0] for t in targets}
            assert roots <= {"report", "sparrow"}, f"{name} imports {sorted(targets)}"
    assert "report.compare" in GRAPH["services.launcher.compare"]


def test_the_core_names_no_service_even_in_a_string():
    """An import string (`"services.sandbox.reward:code_score"`) is a service import all the same: services
    register what the core should know (services/__init__.py), the core never names them."""
    found = []
    for rel, tree in FILES:
        if not rel.startswith("sparrow/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" not in node.value:
                if node.value.startswith("services.") or node.value.startswith("services/"):
                    found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, "the core names a service:\n" + "\n".join(found)


def test_test_modules_outside_packages_have_unique_names():
    # pytest imports a test file of a folder without __init__.py by its bare name: a second file of that name
    # anywhere else is an "import file mismatch" error at collection, which only the full run shows.
    seen: dict[str, str] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if (path.parent / "__init__.py").exists():
            continue
        rel = path.relative_to(ROOT).as_posix()
        if path.name in seen:
            clashes.append(f"{rel} and {seen[path.name]}")
        seen.setdefault(path.name, rel)
    assert not clashes, clashes
