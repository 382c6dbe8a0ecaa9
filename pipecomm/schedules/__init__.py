"""Schedules as data, free of torch: the action IR, the named schedules, validation, timing, list scheduling, local search, the planner."""
