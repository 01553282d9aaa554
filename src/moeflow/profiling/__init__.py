"""Measuring the live backend: the profiler that fits a cost model, and the pipeline chunk profile."""
