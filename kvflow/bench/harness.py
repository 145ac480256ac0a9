"""The one harness every ``kvflow bench …`` uses.

A benchmark measures its subject and its baseline *in the same run*, interleaved (A, B, A, B …)
after warm-up rounds, so machine noise hits both alike; it reports medians with their spread, and
ratios against the baseline. Output: a table on the terminal and, with ``--json FILE``,
``{"benchmark", "figures", "baseline", "ratios", "environment", "details"}`` (docs/architecture.md#benchmark-json),
every figure a number with its unit in its name.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass
class Samples:
    """Repeated measurements of one quantity (seconds, or any number)."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def spread(self) -> float:
        """Half the range, relative to the median (0.05 = ±5 %)."""
        if len(self.values) < 2 or self.median == 0:
            return 0.0
        return (max(self.values) - min(self.values)) / 2 / abs(self.median)

    def as_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": min(self.values), "max": max(self.values),
                "n": len(self.values), "values": self.values}


def interleaved(subjects: dict[str, Callable[[], float | None]], *, warmup: int = 1,
                repeats: int = 5) -> dict[str, Samples]:
    """Run each subject ``warmup`` times, then ``repeats`` rounds of all of them in turn.

    A subject returns the quantity it measured, or None to be timed by wall clock.
    """
    def once(fn: Callable[[], float | None]) -> float:
        t0 = time.perf_counter()
        v = fn()
        return time.perf_counter() - t0 if v is None else v

    for _ in range(warmup):
        for fn in subjects.values():
            once(fn)
    out: dict[str, list[float]] = {name: [] for name in subjects}
    for _ in range(repeats):
        for name, fn in subjects.items():
            out[name].append(once(fn))
    return {name: Samples(v) for name, v in out.items()}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def percentile_ms(seconds: list[float], q: float) -> float:
    """The q-th percentile of durations in seconds, in milliseconds."""
    return percentile(seconds, q) * 1000


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parents[2],
        ).stdout.strip()
    return env


@dataclass
class BenchResult:
    benchmark: str
    figures: dict[str, float] = field(default_factory=dict)
    baseline: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    goals: dict[str, str] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=environment)

    def as_dict(self) -> dict[str, Any]:
        return {"benchmark": self.benchmark, "figures": self.figures, "baseline": self.baseline,
                "ratios": self.ratios, "goals": self.goals, "environment": self.environment,
                "details": self.details}

    def write_json(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.as_dict(), indent=2) + "\n")

    def print(self, console: Console | None = None) -> None:
        console = console or Console()
        table = Table(title=f"kvflow {self.benchmark}" if self.benchmark == "sim" else f"kvflow bench {self.benchmark}")
        table.add_column("kind")
        table.add_column("name")
        table.add_column("value", justify="right")
        table.add_column("goal")
        for kind, group in (("figure", self.figures), ("baseline", self.baseline), ("ratio", self.ratios)):
            for name, value in group.items():
                table.add_row(kind, name, _fmt(value), self.goals.get(name, ""))
        console.print(table)


def _fmt(v: float) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.4g}"
        return f"{v:,.4f}".rstrip("0").rstrip(".")
    return str(v)
