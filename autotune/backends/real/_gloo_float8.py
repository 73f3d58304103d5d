"""float8 all-gathers on gloo, whose collectives have no float8 dtypes, as the bytes they are.

Under tensorwise float8 with tensor parallelism, torchao's Float8ColwiseParallel and
Float8RowwiseParallel redistribute torchao's Float8TrainingTensor through DTensor (in backward, the float8
gradient of a sequence-sharded output is all-gathered), and torchao's own override of the functional
all-gather (`float8_ops.allgather_fp8`) gathers the subclass's raw float8 data. NCCL moves it as bytes;
gloo refuses it ("Invalid scalar type"). `gather_float8_as_bytes()` replaces that override, in torchao's
op table, by one that gathers the same data viewed as uint8 and views the result back: one output of the
size NCCL's would be, allocated by the same collective, so a CPU trial's tensor peak does not change with
the route; the wait is taken at once (a CPU trial's timing is not what is compared; torchao's later wait
then finds nothing to wait for). FSDP2's float8 all-gather needs none of this (it gathers into a uint8
buffer itself).

The collective is called through its OpOverload, which releases the GIL while gloo queues the work. (A
CPU kernel registered from Python for `_c10d_functional::all_gather_into_tensor` calls it holding the
GIL, and gloo's work thread, which takes the GIL to release finished work, then hangs both ranks: seen,
and read in gdb, on torch 2.13.) Only CPU trial processes call it.
"""

from __future__ import annotations

import torch

_INSTALLED = False


def gather_float8_as_bytes() -> bool:
    """Replace torchao's float8 all-gather override in this process (once); False where torchao is not
    importable (no float8 trial can run then)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        from torchao.float8 import float8_ops
        from torchao.float8.float8_training_tensor import Float8TrainingTensor
    except ImportError:
        return False

    def allgather_fp8_as_bytes(aten_op, args, kwargs=None):
        fp8_input = args[0]
        if not isinstance(fp8_input, Float8TrainingTensor):
            raise TypeError(f"expecting a Float8TrainingTensor for allgather but found {type(fp8_input)}")
        data = fp8_input._data.contiguous()
        gathered = aten_op(data.view(torch.uint8), *args[1:], **(kwargs or {}))
        gathered = torch.ops._c10d_functional.wait_tensor.default(gathered)
        return Float8TrainingTensor(gathered.view(data.dtype), fp8_input._scale, fp8_input._orig_dtype,
                                    fp8_input._linear_mm_config, fp8_input._gemm_input_role)

    table = float8_ops.FLOAT8_OPS_TABLE
    for op in [op for op, func in table.items() if func is float8_ops.allgather_fp8]:
        table[op] = allgather_fp8_as_bytes
    _INSTALLED = True
    return True
