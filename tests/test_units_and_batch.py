"""Token-count parsing and the global batch arithmetic."""

import pytest

from autotune.problem.batch import check_reachable, check_target, plan_global_batch, within_tolerance
from autotune.util.errors import UsageError
from autotune.util.units import format_bytes, format_count, parse_bytes, parse_count


@pytest.mark.parametrize("text, expected", [
    ("4M", 4_000_000), ("4Mi", 4_194_304), ("4_000_000", 4_000_000), ("4000000", 4_000_000),
    ("64K", 64_000), ("64Ki", 65_536), ("1G", 10**9), ("1Gi", 2**30), ("1.5K", 1500), ("2m", 2_000_000),
    ("4,000,000", 4_000_000),
])
def test_parse_count(text, expected):
    assert parse_count(text) == expected


@pytest.mark.parametrize("text", ["", "four", "4X", "-4M", "0.3", "4MM", "1.0001K"])
def test_parse_count_refuses(text):
    with pytest.raises(UsageError):
        parse_count(text, what="--global-tokens")


def test_parse_bytes_accepts_b_suffix():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512Mi") == 512 * 2**20


def test_global_batch_hits_target_exactly_when_divisible():
    # 4Mi tokens on 8 GPUs at seq 4096: 128 sequences per GPU per step.
    for micro in (1, 2, 4, 8, 16, 32, 64, 128):
        batch = plan_global_batch(target_tokens=4 * 2**20, num_gpus=8, seq_len=4096, micro_batch_size=micro)
        assert batch.global_tokens == 4 * 2**20
        assert batch.micro_batch_size * 8 * batch.grad_accum_steps * 4096 == batch.global_tokens
        assert batch.deviation == 0


def test_global_batch_never_drifts_with_micro_batch():
    # 4M (decimal) is not a multiple of 8 x 4096: the closest accumulation is chosen, and the
    # achieved global batch stays within a few percent whatever the micro-batch.
    for micro in range(1, 9):
        batch = plan_global_batch(target_tokens=4_000_000, num_gpus=8, seq_len=4096, micro_batch_size=micro)
        per_step = micro * 8 * 4096
        alternatives = [n * per_step for n in (batch.grad_accum_steps - 1, batch.grad_accum_steps + 1) if n >= 1]
        assert all(abs(batch.global_tokens - 4_000_000) <= abs(t - 4_000_000) for t in alternatives)
    one = plan_global_batch(target_tokens=4_000_000, num_gpus=8, seq_len=4096, micro_batch_size=1)
    assert one.grad_accum_steps == 122 and one.global_tokens == 3_997_696
    assert within_tolerance(one, 0.01)
    four = plan_global_batch(target_tokens=4_000_000, num_gpus=8, seq_len=4096, micro_batch_size=4)
    assert not within_tolerance(four, 0.01)  # 30 or 31 steps of 131,072 tokens: 1.7% / 1.6% off


def test_target_smaller_than_one_sequence_per_gpu_is_refused():
    with pytest.raises(UsageError, match="smaller than one sequence per GPU"):
        check_target(target_tokens=8 * 4096 - 1, num_gpus=8, seq_len=4096)


def test_a_configuration_past_the_batch_wall_misses_the_tolerance():
    """Past the wall (tensor parallelism lets a tune get there), one micro-step already overshoots:
    the batch is planned, one accumulation step, and says how far off it is."""
    batch = plan_global_batch(target_tokens=4 * 4096, num_gpus=8, seq_len=4096, micro_batch_size=1)
    assert (batch.grad_accum_steps, batch.global_tokens) == (1, 8 * 4096)
    assert batch.deviation == 1.0 and not within_tolerance(batch, 0.01)


def test_unreachable_target_is_refused_with_the_nearest_values():
    # 2 GPUs x 64 tokens: batches come in steps of 128; 2,000 is 2.4% from 2,048.
    with pytest.raises(UsageError, match="use 1,920, 2,048"):
        check_reachable(target_tokens=2000, num_gpus=2, seq_len=64, tolerance=0.01)
    check_reachable(target_tokens=2000, num_gpus=2, seq_len=64, tolerance=0.03)
    check_reachable(target_tokens=4_000_000, num_gpus=8, seq_len=4096, tolerance=0.01)


def test_formatting_scales_units():
    assert format_bytes(36.64 * 2**30) == "36.64 GiB"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(812) == "812 B"
    assert format_count(6_738_415_616) == "6.74 B"
    assert format_count(950) == "950"
