"""``spmd.CompileOptions``: how a compiled step keeps its signatures and shares its compiles, as one value."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .errors import SpmdConfigError


@dataclass(frozen=True)
class CompileOptions:
    """Settings of one compiled step, given as ``spmd.compile(..., options=spmd.CompileOptions(...))``.

    ``cache_size``: compiled signatures kept; the least recently used one is dropped first.
    ``retrace_warning_at``: traces after which a step that keeps retracing is warned about, once.
    ``one_compile_per_job``: on several ranks with the compile cache on, one rank compiles each step and
    the others load what it made (``spmd.step.job_compile``); False: each rank compiles.
    ``compile_wait_s``: how long a rank waits for the rank that compiles a step for the job.

    Example::

        step = spmd.compile(options=spmd.CompileOptions(cache_size=4))(train_step)
    """

    cache_size: int = 16
    retrace_warning_at: int = 8
    one_compile_per_job: bool = True
    compile_wait_s: float = 1800.0

    def __post_init__(self) -> None:
        wanted = {"cache_size": int, "retrace_warning_at": int, "one_compile_per_job": bool,
                  "compile_wait_s": (int, float)}
        for f in fields(self):
            value = getattr(self, f.name)
            ok = isinstance(value, wanted[f.name]) and (f.name == "one_compile_per_job" or not isinstance(value, bool))
            if not ok or (f.name != "one_compile_per_job" and value <= 0):
                kind = "True or False" if f.name == "one_compile_per_job" else "a positive number"
                raise SpmdConfigError(f"spmd.CompileOptions: {f.name} must be {kind}, got {type(value).__name__} "
                                      f"{value!r}; e.g. spmd.CompileOptions({f.name}={f.default!r}).")
