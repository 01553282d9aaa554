"""Schedules: the order and overlap of the dispatch → experts → combine block (`schedule` axis)."""
