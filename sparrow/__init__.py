"""Sparrow core: schedules, acceptance statistics, cost model, model and hardware presets, config."""
