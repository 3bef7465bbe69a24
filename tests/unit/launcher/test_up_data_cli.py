"""`sparrow up` with a user's data and reward refuses bad input in one line, exit 2, before anything starts."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.unit.launcher.test_up_cli import _one_line_error, _up


def _verl(path, rows=3, role="user", answers=True):
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "data_source": "toy",
                    "prompt": [{"role": role, "content": f"lek sub ; ? lek {i} :"}],
                    "reward_model": {"style": "rule", "ground_truth": "sub" if answers else None},
                }
                for i in range(rows)
            ]
        ),
        path,
    )
    return path


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("missing", "missing.parquet: no such data file or folder"),
        ("csv", "unknown data file type '.csv'"),
        ("no prompt column", "no prompt column 'prompt' (columns: question, answer)"),
        ("bad role", "has role 'narrator'; chat templates take system, user, assistant, tool"),
        ("no chat template", "has no chat template"),
        ("all too long", "no prompt left after templating (3 over max_prompt_tokens = 4"),
        ("unknown reward", "unknown reward 'exact'"),
        ("unimportable reward", "cannot import"),
        ("reward of no shape", "score must take (response, ground_truth, extras); verl's (data_source"),
        ("reward server down", "/score: no server answers at 127.0.0.1:"),
        ("trl reward without its column", "takes solution, which not every row of source toy has (columns every"),
        ("eval without answers", "no row has an answer"),
    ],
)
def test_bad_data_and_rewards(tmp_path, case, fragment):
    train = _verl(tmp_path / "train.parquet")
    args, config = ["--data", train], None
    if case == "missing":
        args = ["--data", tmp_path / "missing.parquet"]
    elif case == "csv":
        (tmp_path / "train.csv").write_text("prompt,answer\nx,1\n")
        args = ["--data", tmp_path / "train.csv"]
    elif case == "no prompt column":
        path = tmp_path / "q.jsonl"
        path.write_text(json.dumps({"question": "x", "answer": 1}) + "\n")
        args = ["--data", path]
    elif case == "bad role":
        args = ["--data", _verl(tmp_path / "roles.parquet", role="narrator")]
    elif case == "no chat template":
        config = '[trainer.data]\nchat_template = "tokenizer"\n'
    elif case == "all too long":
        config = "[trainer.data]\nmax_prompt_tokens = 4\n"
    elif case == "unknown reward":
        args += ["--reward", "exact"]
    elif case == "unimportable reward":
        (tmp_path / "my_reward.py").write_text("import no_such_module_anywhere\n")
        args += ["--reward", f"{tmp_path / 'my_reward.py'}:score"]
    elif case == "reward of no shape":
        (tmp_path / "my_reward.py").write_text("def score(text, answer, meta):\n    return 1.0\n")
        args += ["--reward", f"{tmp_path / 'my_reward.py'}:score"]
    elif case == "reward server down":
        from tests.servers import free_port

        args += ["--reward", f"http://127.0.0.1:{free_port()}/score"]
    elif case == "trl reward without its column":
        (tmp_path / "my_reward.py").write_text("def score(completions, solution, **kwargs):\n    return [1.0]\n")
        args += ["--reward", f"{tmp_path / 'my_reward.py'}:score"]
    elif case == "eval without answers":
        args += ["--eval-data", _verl(tmp_path / "test.parquet", answers=False)]
    result, run_dir = _up(tmp_path, *args, config=config)
    _one_line_error(result, fragment)
    assert not run_dir.exists()


def test_print_config_shows_the_shorthands(tmp_path):
    train = _verl(tmp_path / "train.parquet")
    result, _ = _up(tmp_path, "--data", train, "--eval-data", train, "--reward", "math", "--print-config")
    assert result.returncode == 0, result.stderr
    trainer = json.loads(result.stdout)["trainer"]
    assert trainer["data"] == {"train_files": [str(train)], "eval_files": [str(train)]}
    assert trainer["reward"] == {"name": "math"}
