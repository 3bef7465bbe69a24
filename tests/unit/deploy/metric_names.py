"""Every metric name the dashboards and alert rules may use: the deployment's side of the metrics contract.

The trainer and generator names are the ones agreed with the services' authors (the brief of issue
9); the controller's come from services/controller/metrics.py. Counters carry `_total`, histograms
are named without `_bucket`/`_sum`/`_count`.
"""

TRAINER_METRICS = (
    "sparrow_trainer_alpha",
    "sparrow_trainer_alpha_p5",
    "sparrow_trainer_alpha_tokens",
    "sparrow_trainer_alpha_p1",
    "sparrow_trainer_alpha_under_half",
    "sparrow_trainer_alpha_exact",
    "sparrow_trainer_alpha_exact_p5",
    "sparrow_trainer_alpha_exact_p1",
    "sparrow_trainer_alpha_exact_under_half",
    "sparrow_trainer_alpha_exact_tokens",
    "sparrow_trainer_schedule_version",
    "sparrow_trainer_alpha_steps_total",
    "sparrow_trainer_reward_mean",
    "sparrow_trainer_accuracy_ratio",
    "sparrow_trainer_response_length_tokens",
    "sparrow_trainer_alpha_mean",
    "sparrow_trainer_tis_clip_ratio",
    "sparrow_trainer_kl_rollout_dense",
    "sparrow_trainer_step_seconds",
    "sparrow_trainer_steps_total",
    "sparrow_trainer_policy_version",
    "sparrow_trainer_world_size",
    "sparrow_trainer_staleness_versions",
    "sparrow_trainer_dropped_stale_total",
    "sparrow_trainer_trajectories_total",
    "sparrow_trainer_groups_dead_total",
    "sparrow_trainer_last_step_timestamp_seconds",
    "sparrow_trainer_queue_outstanding_groups",
    "sparrow_trainer_reward_errors_total",
    "sparrow_trainer_eval_avg_reward",
    "sparrow_trainer_eval_pass_ratio",
    "sparrow_trainer_phase_seconds_total",
)
GENERATOR_METRICS = (
    "sparrow_generator_tokens_total",
    "sparrow_generator_attended_kv_tokens_total",
    "sparrow_generator_context_kv_tokens_total",
    "sparrow_generator_kv_budget_tokens",
    "sparrow_generator_queue_lag_entries",
    "sparrow_generator_queue_pending_entries",
    "sparrow_generator_queue_wait_seconds",
    "sparrow_generator_in_flight_sequences",
    "sparrow_generator_policy_version",
    "sparrow_generator_policy_fetch_bytes_total",
    "sparrow_generator_policy_fetch_failures_total",
    "sparrow_generator_policy_sync_seconds",
    "sparrow_generator_adapter_version",
    "sparrow_generator_schedule_version",
    "sparrow_generator_swaps_total",
    "sparrow_generator_trajectories_total",
    "sparrow_generator_groups_total",
    "sparrow_generator_probe_sequences_total",
    "sparrow_generator_step_seconds",
    "sparrow_generator_phase_seconds_total",
    "sparrow_generator_draft_tokens_total",
    "sparrow_generator_accepted_draft_tokens_total",
    "sparrow_generator_speculative_cycles_total",
    "sparrow_generator_draft_alpha",
    "sparrow_generator_draft_seconds_total",
    "sparrow_generator_verify_seconds_total",
    "sparrow_generator_timed_cycles_total",
)
CONTROLLER_METRICS = (
    "sparrow_controller_budget_tokens",
    "sparrow_controller_alpha_p5",
    "sparrow_controller_alpha_target",
    "sparrow_controller_predicted_speedup",
    "sparrow_controller_schedule_version",
    "sparrow_controller_blind",
    "sparrow_controller_paused",
    "sparrow_controller_decisions_total",
    "sparrow_controller_ticks_total",
    "sparrow_controller_trainer_steps_unseen_total",
    "sparrow_controller_draft_alpha",
    "sparrow_controller_bin_predicted_gain",
    "sparrow_controller_step_overhead",
    "sparrow_controller_draft_fixed_seconds",
)


HISTOGRAMS = (
    "sparrow_trainer_alpha",
    "sparrow_trainer_alpha_exact",
    "sparrow_trainer_step_seconds",
    "sparrow_generator_queue_wait_seconds",
    "sparrow_generator_step_seconds",
    "sparrow_generator_draft_alpha",
)
ALL_METRICS = TRAINER_METRICS + GENERATOR_METRICS + CONTROLLER_METRICS


def series_names(metric: str) -> set[str]:
    """The series names Prometheus stores for `metric` (a histogram's _bucket, _sum and _count)."""
    if metric in HISTOGRAMS:
        return {f"{metric}_bucket", f"{metric}_sum", f"{metric}_count"}
    return {metric}
