"""What the attention layers of one worker share during a step: the batch's request ids and the step's plan.

One `DecodeContext` per worker (the worker extension hands it to every attention layer of its model,
`SparrowWorkerExtension._sparrow_impls`); a layer made on its own (a test, `bench/cuda_check`) has
one of its own until it is given another. Nothing of it lives on a class or in a module, so two
workers in one process, or two tests in a row, never see each other's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

RowIds = Callable[[], Sequence[str | None]]


@dataclass(eq=False)
class DecodeContext:
    """The state a worker's attention layers share.

    `probe_row_ids`: the request ids of the running batch's rows, in row order, while a probe plan
    is set (None: no plan). `dense_row_ids`: the same ids, always, once the worker tracks rows
    (None: no row is told apart as dense). `last_plan`: the last step's host plan, worked out by the
    first layer of a step and read by the others (`ScheduledDecode.host_plan`).
    """

    probe_row_ids: RowIds | None = None
    dense_row_ids: RowIds | None = None
    last_plan: tuple | None = None

    def current_probe_row_ids(self) -> Sequence[str | None] | None:
        """The running batch's request ids in row order while a probe plan is set, else None."""
        return None if self.probe_row_ids is None else self.probe_row_ids()

    def current_dense_row_ids(self) -> Sequence[str | None] | None:
        """The running batch's request ids in row order once the worker tracks them (for dense rows), else None."""
        return None if self.dense_row_ids is None else self.dense_row_ids()
