"""Signals become exceptions only where unwinding is safe (autotune/util/interrupts.py). The signals
here are real (os.kill of this process), delivered while torch is calling back into Python."""

from __future__ import annotations

import os
import signal
import time
import traceback

import pytest
import torch.utils._pytree as pytree

from autotune.util.interrupts import raised_where_safe


class Stop(KeyboardInterrupt):
    pass


def _signal_from_inside_torch(calls: list, *, signals: int = 1):
    """A function torch calls (tree_map): it signals this process, then keeps running bytecode,
    so Python runs the handler while torch's frames are on the stack."""

    def leaf(x):
        if x == 1:
            for _ in range(signals):
                os.kill(os.getpid(), signal.SIGUSR1)
                sum(range(1000))
        calls.append(x)
        return x

    return leaf


def test_a_signal_inside_torch_is_held_until_torch_returns_and_never_lost():
    calls: list = []

    def body():
        pytree.tree_map(_signal_from_inside_torch(calls), [1, 2, 3])
        calls.append("torch returned")
        time.sleep(5)  # the held signal is raised here, at the next retry (50 ms)

    start = time.monotonic()
    with pytest.raises(Stop) as info:
        with raised_where_safe({signal.SIGUSR1: Stop}, entry=body.__code__):
            body()
    assert calls == [1, 2, 3, "torch returned"]  # tree_map was not cut short
    assert time.monotonic() - start < 2
    raised_in = [frame.filename for frame in traceback.extract_tb(info.tb)]
    assert not any("torch" in name.split(os.sep) for name in raised_in), raised_in


def test_a_held_signal_is_raised_when_the_command_ends_first():
    calls: list = []

    def body():
        pytree.tree_map(_signal_from_inside_torch(calls), [1, 2, 3])

    with pytest.raises(Stop):
        with raised_where_safe({signal.SIGUSR1: Stop}, entry=body.__code__):
            body()
    assert calls == [1, 2, 3]


def test_a_second_signal_raises_at_once():
    calls: list = []

    def body():
        pytree.tree_map(_signal_from_inside_torch(calls, signals=2), [1, 2, 3])

    with pytest.raises(Stop):
        with raised_where_safe({signal.SIGUSR1: Stop}, entry=body.__code__):
            body()
    assert calls == []  # the user insisted: raised inside torch's call, before leaf(1) returned


def test_handlers_are_restored_afterwards():
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGALRM)
    with raised_where_safe({signal.SIGUSR1: Stop}):
        assert signal.getsignal(signal.SIGUSR1) is not before[0]
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGALRM)) == before
