"""`sparrow up --compare`: the same job with dense rollouts, then sparse, and one report side by side.

This module runs the two jobs, each into its own run folder (RUN_DIR/dense/, RUN_DIR/sparse/), and has
`report.compare` write the comparison from their folders alone.
"""

from __future__ import annotations

from pathlib import Path

from report.compare import MODES, build_compare_report
from services.launcher.config import UpConfig
from services.launcher.plan import default_run_dir, make_plan, require_fresh_run_dir


def check_compare(up: UpConfig) -> tuple[Path, dict[str, UpConfig]]:
    """Check both runs' input before either starts (SetupError/ConfigError); (the root folder, each mode's config)."""
    root = Path(up.run_dir or default_run_dir()).resolve()
    require_fresh_run_dir(root)
    # The second run decodes as the config says (sparse, or speculative), the first densely.
    other = "sparse" if up.decode == "dense" else up.decode
    ups = {
        m: up.with_decode("dense" if m == "dense" else other).model_copy(
            update={"run_dir": str(root / m), "tracking": _tracking(up, root, m)}
        )
        for m in MODES
    }
    for mode in MODES:
        make_plan(ups[mode])
    return root, ups


def run_compare(up: UpConfig, progress_factory) -> tuple[int, dict]:
    """Run dense, then sparse, then write the comparison; (exit status, summary)."""
    from services.launcher.run import run_up

    root, ups = check_compare(up)
    summaries = {}
    for mode in MODES:
        code, summaries[mode] = run_up(ups[mode], progress_factory)
        if code != 0:
            return code, {"outcome": summaries[mode].get("outcome"), "error": summaries[mode].get("error"), **summaries}
    path, summary = build_compare_report(root)
    return 0, {"outcome": "completed", "error": None, "report": str(path), **summary}


def _tracking(up: UpConfig, root: Path, mode: str):
    """Each arm its own tracker run: <name>-dense and <name>-sparse, tagged with its mode, in its own folders."""
    t = up.tracking
    return t.model_copy(
        update={
            "run_name": f"{t.run_name or root.name}-{mode}",
            "tags": [*t.tags, mode],
            "tensorboard": t.tensorboard.model_copy(
                update={"dir": str(Path(t.tensorboard.dir) / mode) if t.tensorboard.dir else ""}
            ),
            "wandb": t.wandb.model_copy(update={"dir": str(Path(t.wandb.dir) / mode) if t.wandb.dir else ""}),
        }
    )
