"""The chain task as a dataset in verl's row shape, so it takes the same data path as a user's dataset.

Each row: `prompt` as one user message, `data_source = "chain"` (which selects the `chain` reward),
`reward_model = {style: "rule", ground_truth: answer}`, `extra_info` with the split, index, pairs and hops.
"""

from __future__ import annotations

from pathlib import Path

from sparrow.tasks.chain import ChainTask, ExampleStream

DATA_SOURCE = "chain"


def chain_rows(task: ChainTask, count: int, seed: int = 0, split: str = "train") -> list[dict]:
    """`count` examples of `split` as verl rows, deterministic for (task, seed, split)."""
    stream = ExampleStream(task, seed, split)
    rows = []
    for index in range(count):
        ex = stream.next()
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": ex.prompt}],
                "ability": "chain",
                "reward_model": {"style": "rule", "ground_truth": ex.answer},
                "extra_info": {"split": split, "index": index, "pairs": ex.pairs, "hops": ex.hops},
            }
        )
    return rows


def write_parquet(rows: list[dict], out: str | Path) -> Path:
    """Write verl rows to a Parquet file (folders made as needed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
