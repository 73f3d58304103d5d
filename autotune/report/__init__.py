"""The run report: runs/<id>/report.html, one self-contained page that opens offline.

Per-GPU memory by category for each step of the decision graph against the GPU's capacity,
tokens/s against micro-batch per checkpointing/offload setting, the decision path, predicted
versus measured, the checkpoint advice and the trial table; every figure with its source.
"""

from autotune.report._page import render_report, write_report

__all__ = ["render_report", "write_report"]
