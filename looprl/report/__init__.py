"""Reports: a run's report (`write.py`, `html.py`, `plots.py`), `looprl compare`
(`compare*.py`), and the paired statistics both use (`stats.py`), which benchmarks read
run folders with."""

from __future__ import annotations

from looprl.report.comparisons import load_eval
from looprl.report.stats import Paired, paired_stats
from looprl.report.write import read_metrics

__all__ = ["Paired", "load_eval", "paired_stats", "read_metrics"]
