"""The README stays short and its maps and links stay true.

The README is at most 300 lines; its folder map names only paths that exist and names every
top-level folder with Python code and every service; the file-by-file map of docs/architecture.md
names only modules that exist; every relative link in README.md and docs/*.md points at a file
that exists, and an anchor into a Markdown file at one of its headings.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300

# Folders at the top of the repository that hold no code of ours even when Python files land there.
NOT_CODE = {"docs", "runs", "build"}

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`]+)`")


def _section(text: str, heading: str) -> str:
    """The body of the `## heading` section of a Markdown text, up to the next `## ` heading."""
    lines = text.splitlines()
    try:
        start = lines.index(f"## {heading}")
    except ValueError:
        pytest.fail(f"no '## {heading}' section")
    body = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        body.append(line)
    return "\n".join(body)


def _table_rows(section: str) -> list[list[str]]:
    """The cells of each body row of the first Markdown table in a section."""
    rows = []
    for line in section.splitlines():
        if not line.startswith("|") or set(line.replace("|", "").strip()) <= set("-: "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append(cells)
    return rows[1:]  # the header row


def readme_map_paths(text: str) -> list[str]:
    """Every path the README's folder map names in its first column."""
    paths = []
    for cells in _table_rows(_section(text, "Folder map")):
        paths += _CODE.findall(cells[0])
    return paths


def _is_ignored_or_hidden(name: str) -> bool:
    return name.startswith((".", "_")) or name in NOT_CODE or name.endswith(".egg-info")


def code_folders(root: Path) -> list[str]:
    """Top-level folders of the repository that hold Python code (hidden and build folders left out)."""
    folders = []
    for child in sorted(root.iterdir()):
        if not child.is_dir() or _is_ignored_or_hidden(child.name):
            continue
        if any(not any(part.startswith(".") for part in p.relative_to(child).parts) for p in child.rglob("*.py")):
            folders.append(child.name)
    return folders


def services(root: Path) -> list[str]:
    """The service packages: folders under services/ with an __init__.py."""
    return sorted(p.parent.name for p in (root / "services").glob("*/__init__.py"))


def _names_folder(paths: list[str], folder: str) -> bool:
    return any(p.rstrip("/") == folder or p.startswith(folder + "/") for p in paths)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    """The anchors of every heading of a Markdown file (outside code blocks), duplicates numbered."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6} (.*)", line)
        if fenced or not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(md: Path) -> list[str]:
    """The relative links of a Markdown file that lead nowhere: no such file, or no such heading."""
    broken = []
    fenced = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        for m in _LINK.finditer(line):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                broken.append(f"{md.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{md.name}: {target} (no such heading)")
    return broken


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_readme_is_at_most_300_lines():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_every_path_in_the_folder_map_exists():
    paths = readme_map_paths(README.read_text())
    assert len(paths) >= 10, paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"the README's folder map names paths that do not exist: {missing}"


def test_the_folder_map_names_every_top_level_code_folder():
    paths = readme_map_paths(README.read_text())
    folders = code_folders(ROOT)
    assert {"sparrow", "kernels", "services", "trainer", "sparrow_cli", "bench"} <= set(folders)
    unnamed = [f for f in folders if not _names_folder(paths, f)]
    assert not unnamed, f"top-level folders with Python code missing from the README's folder map: {unnamed}"


def test_the_folder_map_names_every_service():
    paths = readme_map_paths(README.read_text())
    unnamed = [s for s in services(ROOT) if not _names_folder(paths, f"services/{s}")]
    assert not unnamed, f"services missing from the README's folder map: {unnamed}"


_FILE_NAME = re.compile(r"[\w*-]+(/[\w*-]+)*(/|\.(py|toml|proto|json|yaml|cpp|md))")


def architecture_map_misses(text: str, root: Path) -> list[str]:
    """The folders and files the file-by-file map of docs/architecture.md names that do not exist.

    A row's first cell is a folder; the code spans of its second cell that look like file or folder
    names (`step.py`, `plugin/`, `*_cmd.py`) are looked up in that folder and below it, or from the
    repository's root (`docker-compose.yml`).
    """
    missing = []
    for cells in _table_rows(_section(text, "Folder map")):
        (folder,) = _CODE.findall(cells[0])
        base = root / folder
        if not base.is_dir():
            missing.append(folder)
            continue
        for name in _CODE.findall(cells[1]):
            if not _FILE_NAME.fullmatch(name):
                continue
            found = (base / name).exists() or (root / name).exists() or any(base.rglob(name.rstrip("/")))
            if not found:
                missing.append(f"{folder}{name}")
    return missing


def test_every_module_in_the_architecture_map_exists():
    text = (DOCS / "architecture.md").read_text()
    assert len(_table_rows(_section(text, "Folder map"))) >= 10
    missing = architecture_map_misses(text, ROOT)
    assert not missing, f"docs/architecture.md's folder map names files that do not exist: {missing}"


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: p.name)
def test_every_relative_link_leads_somewhere(md):
    assert not broken_links(md)


# The checks above must be able to fail: each one against a text or tree that is wrong.


def test_a_missing_map_path_or_an_unnamed_folder_is_found(tmp_path):
    text = "## Folder map\n\n| path | what |\n|---|---|\n| `sparrow/` | core |\n| `nowhere/` | gone |\n"
    assert readme_map_paths(text) == ["sparrow/", "nowhere/"]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("")
    (tmp_path / "notes").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "b.py").write_text("")
    assert code_folders(tmp_path) == ["pkg"]
    assert not _names_folder(readme_map_paths(text), "pkg")
    assert _names_folder(["services/generator/plugin/"], "services/generator")


def test_a_module_the_architecture_map_names_but_the_tree_lacks_is_found(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("")
    (tmp_path / "pkg" / "sub" / "x_cmd.py").write_text("")
    text = (
        "## Folder map\n\n| folder | what |\n|---|---|\n"
        "| `pkg/` | `a.py`, `sub/`, `*_cmd.py`, `gone.py`, `--flag`, `sparrow up` |\n| `nope/` | `b.py` |\n"
    )
    assert architecture_map_misses(text, tmp_path) == ["pkg/gone.py", "nope/"]


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "there.md").write_text("# Title\n\n## The tail: p5 (`exact`)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#the-tail-p5-exact) [web](https://example.org/x)\n"
        "[gone](missing.md) [bad](there.md#nope) ![img](nope.png)\n"
        "```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: there.md#nope (no such heading)",
        "page.md: nope.png (no such file)",
    ]
