"""Benchmark output without the noise of the tools it measures with.

torch's profiler (the CPU memory peak of `bench.layer.peak_step_bytes`) prints from C++ straight to
the process's file descriptors — kineto's `profiler_start`/`profiler_stop` lines and the
CPUAllocator's "allocated before the profiling started" warning — which Python's `sys.stdout`
redirection cannot catch: `native_output_silenced` points descriptors 1 and 2 at /dev/null for the
duration. `transformers_quiet` lowers Hugging Face's log level while its block is timed.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def native_output_silenced() -> Iterator[None]:
    """Discard what native code writes to stdout and stderr inside the block (Python's own
    output is flushed first, so nothing of it is lost or reordered)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        for fd in saved:
            os.close(fd)


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    """Hugging Face's notices (e.g. about its experts interface) at error level only."""
    try:
        from transformers.utils import logging
    except ImportError:
        yield
        return
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
