"""What one training step is: the parallelization a trial applies (parallel/: FSDP2, TP, CP, PP, EP,
checkpointing, compile, float8, on one ParallelDims mesh) and the step each stack runs (training, titan,
litgpt_step). The simulator traces these functions and the exporters describe them."""
