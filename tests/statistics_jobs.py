"""One small statistics job for the tests that need its YAML: heart-disease's age (binned) and sex."""

from __future__ import annotations


def statistics_job_text(*, secure: bool = False, min_max: bool = False, dp: str = "") -> str:
    """The job's round config; `dp`: a statistics.dp mapping in flow style, or "" for none."""
    return (f"name: stats\nkind: statistics\ndata: {{dataset: heart-disease}}\nstatistics:\n  columns:\n"
            f"    - {{name: age, range: [0, 100], bins: 4}}\n    - {{name: sex, categories: [F, M]}}\n"
            f"  min_max: {str(min_max).lower()}\n" + (f"  dp: {dp}\n" if dp else "")
            + f"sites: {{min: 3, deadline_s: 60}}\nprivacy: {{secure_aggregation: {str(secure).lower()}}}\n")
