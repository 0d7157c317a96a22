"""Numeric settings from the environment, read one way everywhere.

Policies (progress engine, watchdog, sync pump, CUDA waits) take their
knobs from `ASYNCLOCK_*` variables; an empty value means the default, and a
value that is not a number names the variable instead of a bare float()
error from deep inside start-up.
"""

from __future__ import annotations

import os

__all__ = ["env_float"]


def env_float(name: str, default: float) -> float:
    """`float(os.environ[name])`, or `default` when unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None
