"""The search space: a declarative TOML file that bounds what the controller may vary."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.problem.knobs import COMPILE_SEARCH, FLOAT8_SEARCH, OP_POLICIES, OPTIMIZER_IMPLS, PRECISIONS, SHARD_PLACEMENTS
from autotune.util.errors import UsageError

DEFAULT_SPACE = Path(__file__).resolve().parents[2] / "search_spaces" / "default.toml"

# key -> (type, validator description). Everything the file may contain, nothing else.
_SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "baseline": {"precision": str, "reshard_after_forward": bool, "optimizer_impl": str, "shard_placement": str},
    "checkpointing": {"enabled": bool, "lighter_every": list, "op_level": list},
    "hsdp": {"enabled": bool},
    "offload": {"enabled": bool, "activations": bool},
    "micro_batch": {"max": int, "refine": bool},
    "explore": {"no_reshard": bool, "checkpointed_larger_micro_batch": bool, "expert_parallel": bool,
                "tensor_parallel": bool, "async_tensor_parallel": bool, "loss_parallel": bool,
                "context_parallel": bool,
                "pipeline_parallel": bool},
    "compile": {"mode": str},
    "float8": {"mode": str},
}


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The bounds of a tuning run. Defaults equal search_spaces/default.toml (a test checks)."""

    precision: str = "bf16"
    reshard_after_forward: bool = True
    optimizer_impl: str = "fused"
    shard_placement: str = "auto"
    """auto: `largest` where some parameter's first dimension is smaller than the shard group, else
    `dim0`; or one of autotune.problem.knobs.SHARD_PLACEMENTS for every trial."""
    checkpointing: bool = True
    lighter_every: tuple[int, ...] = (2, 4)
    op_level: tuple[str, ...] = ("alt-mm",)
    """Op-level selective checkpointing policies tried where full checkpointing was needed."""
    hsdp: bool = True
    """On several nodes, try sharding within node groups and replicating across them."""
    offload: bool = True
    offload_activations: bool = True
    """When checkpointing alone does not fit, try activation offload before parameter offload."""
    max_micro_batch: int = 64
    refine: bool = True
    explore_no_reshard: bool = True
    explore_checkpointed_larger_micro_batch: bool = True
    expert_parallel: bool = True
    """A MoE model: try expert parallelism over 2, 4, ... GPUs of a node after the graph (--ep)."""
    tensor_parallel: bool = True
    """Try tensor parallelism over 2, 4, 8 GPUs of a node (--tp) where FSDP alone holds nothing, misses the
    global batch, or the estimate says a mesh may win."""
    async_tensor_parallel: bool = True
    """Try async TP (--async-tp) on the fastest fitting compiled tensor-parallel configurations, on GPUs."""
    loss_parallel: bool = True
    """Tensor-parallel meshes with loss parallelism (--loss-parallel) where the model and its step allow it."""
    context_parallel: bool = True
    """Try context parallelism over 2, 4, 8 GPUs of a node (--cp) where tensor parallelism is tried."""
    pipeline_parallel: bool = False
    """Try pipeline parallelism over 2, 4, 8, 16 stages (--pp) where tensor parallelism is tried. Off by default:
    each pipeline rank is traced on two shallow copies and extrapolated in depth (exact), but every trace still
    runs all the micro-batches of two steps, about a CPU-minute a candidate on a 70B model (docs/PIPELINE.md)."""
    compile: str = "auto"
    """torch.compile in the search: one of COMPILE_SEARCH (the tune command's --compile overrides it)."""
    float8: str = "auto"
    """float8 training in the search: one of FLOAT8_SEARCH (the tune command's --float8 overrides it)."""
    source: str = "built-in defaults"

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def load_space(path: str | Path | None = None) -> SearchSpace:
    """Read and validate a search-space file; errors name the key and why."""
    if path is None:
        if not DEFAULT_SPACE.exists():  # installed without the repo: the same defaults, built in
            return SearchSpace()
        path = DEFAULT_SPACE
    path = Path(path)
    where = str(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"search space {where!r} not found: pass an existing TOML file to --space") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"search space {where!r} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot read search space {where!r}: {exc.strerror}") from None

    for section, body in data.items():
        if section not in _SCHEMA:
            raise UsageError(f"search space {where!r}: unknown section [{section}]; "
                             f"allowed: {', '.join(_SCHEMA)}")
        if not isinstance(body, dict):
            raise UsageError(f"search space {where!r}: '{section}' must be a table ([{section}])")
        for key, value in body.items():
            expected = _SCHEMA[section].get(key)
            if expected is None:
                raise UsageError(f"search space {where!r}: unknown key {section}.{key}; "
                                 f"allowed: {', '.join(_SCHEMA[section])}")
            # bool is an int subclass: refuse true where a number is wanted, and vice versa.
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise UsageError(f"search space {where!r}: {section}.{key} must be "
                                 f"{expected.__name__}, got {value!r}")

    def get(section: str, key: str, default):
        return data.get(section, {}).get(key, default)

    precision = get("baseline", "precision", "bf16")
    if precision not in PRECISIONS:
        raise UsageError(f"search space {where!r}: baseline.precision must be one of "
                         f"{', '.join(PRECISIONS)}, got {precision!r}")
    optimizer_impl = get("baseline", "optimizer_impl", "fused")
    if optimizer_impl not in OPTIMIZER_IMPLS:
        raise UsageError(f"search space {where!r}: baseline.optimizer_impl must be one of "
                         f"{', '.join(OPTIMIZER_IMPLS)}, got {optimizer_impl!r}")
    shard_placement = get("baseline", "shard_placement", "auto")
    if shard_placement not in ("auto", *SHARD_PLACEMENTS):
        raise UsageError(f"search space {where!r}: baseline.shard_placement must be one of auto, "
                         f"{', '.join(SHARD_PLACEMENTS)}, got {shard_placement!r}")
    lighter = get("checkpointing", "lighter_every", [2, 4])
    if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 2 for k in lighter):
        raise UsageError(f"search space {where!r}: checkpointing.lighter_every must be a list of "
                         f"integers >= 2, got {lighter!r}")
    op_level = get("checkpointing", "op_level", ["alt-mm"])
    if not all(p in OP_POLICIES for p in op_level):
        raise UsageError(f"search space {where!r}: checkpointing.op_level must be a list of "
                         f"{', '.join(OP_POLICIES)} (or empty), got {op_level!r}")
    compile_search = get("compile", "mode", "auto")
    if compile_search not in COMPILE_SEARCH:
        raise UsageError(f"search space {where!r}: compile.mode must be one of {', '.join(COMPILE_SEARCH)}, "
                         f"got {compile_search!r}")
    float8_search = get("float8", "mode", "auto")
    if float8_search not in FLOAT8_SEARCH:
        raise UsageError(f"search space {where!r}: float8.mode must be one of {', '.join(FLOAT8_SEARCH)}, "
                         f"got {float8_search!r}")
    max_mb = get("micro_batch", "max", 64)
    if max_mb < 1:
        raise UsageError(f"search space {where!r}: micro_batch.max must be >= 1, got {max_mb}")
    return SearchSpace(
        precision=precision,
        reshard_after_forward=get("baseline", "reshard_after_forward", True),
        optimizer_impl=optimizer_impl,
        shard_placement=shard_placement,
        checkpointing=get("checkpointing", "enabled", True),
        lighter_every=tuple(sorted(set(lighter))),
        op_level=tuple(dict.fromkeys(op_level)),
        hsdp=get("hsdp", "enabled", True),
        offload=get("offload", "enabled", True),
        offload_activations=get("offload", "activations", True),
        max_micro_batch=max_mb,
        refine=get("micro_batch", "refine", True),
        explore_no_reshard=get("explore", "no_reshard", True),
        explore_checkpointed_larger_micro_batch=get("explore", "checkpointed_larger_micro_batch", True),
        expert_parallel=get("explore", "expert_parallel", True),
        tensor_parallel=get("explore", "tensor_parallel", True),
        async_tensor_parallel=get("explore", "async_tensor_parallel", True),
        loss_parallel=get("explore", "loss_parallel", True),
        context_parallel=get("explore", "context_parallel", True),
        pipeline_parallel=get("explore", "pipeline_parallel", False),
        compile=compile_search,
        float8=float8_search,
        source=where,
    )
