"""The controller service: reads the tail statistic per length bin from Prometheus, retunes the
sparsity schedule, publishes it to Redis, and serves an admin API (see docs/controller.md)."""
