"""What a run folder says, read from its files alone: the metrics history, the report and its plots, evaluation
rounds, where each step's time went, and a `--compare` folder side by side (`sparrow report RUN_DIR`)."""
