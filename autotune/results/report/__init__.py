"""The run report: runs/<id>/report.html, one self-contained page that opens offline.

Per-GPU memory by category for each step of the decision graph against the GPU's capacity,
tokens/s against micro-batch per checkpointing/offload setting, the decision path, predicted
versus measured, the checkpoint advice and the trial table; every figure with its source.
`autotune plan` writes plan.html the same way (_plan).
"""

from autotune.results.report._page import render_report, write_report
from autotune.results.report._plan import render_plan, write_plan_report

__all__ = ["render_plan", "render_report", "write_plan_report", "write_report"]
