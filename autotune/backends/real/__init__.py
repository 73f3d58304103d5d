"""Real trials: short distributed FSDP2 training steps launched with torchrun, on GPUs or CPUs.

See docs/REAL_TRIALS.md. `RealBackend(device="cpu"|"cuda")` is the entry point; the worker
module (`autotune.backends.real.worker`) is what each rank runs.
"""

from autotune.backends.real._backend import RealBackend, predicted_host_need
from autotune.backends.real._faults import FAULT_ENV, parse_faults

__all__ = ["FAULT_ENV", "RealBackend", "parse_faults", "predicted_host_need"]
