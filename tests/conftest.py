"""Test-session settings.

The persistent prediction cache (autotune/util/cache.py) is off for the suite: tests look at how a
prediction was made (traced depths, micro-batches) and must not be answered by an earlier test.
tests/test_cache.py turns it on, in a folder of its own, to test it.
"""

import os

import pytest

os.environ["AUTOTUNE_CACHE"] = "off"

# The modules that hold a worker for minutes (real launches, sweeps, plans), longest first, as
# measured by --durations on this 2-core VM (docs/BENCHMARKS.md). `make test` runs pytest-xdist
# with --dist loadfile, which hands whole modules to the workers in collection order: the long
# ones go first and the short ones fill in at the end, so neither worker idles while the other
# finishes a long module (longest-processing-time-first scheduling).
SLOWEST_FIRST = ("test_costmodel.py", "test_cli.py", "test_model_families.py", "test_export.py", "test_real.py",
                 "test_plan.py", "test_sim_accuracy_knobs.py", "test_multinode.py", "test_sim_accuracy.py",
                 "test_sim.py", "test_sweep_postgres.py", "test_compile.py", "test_finetune.py", "test_sweep.py",
                 "test_cache.py", "test_sweep_slurm.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its order


@pytest.fixture(scope="module")
def cpu_sim():
    """A simulator predicting the cpu backend's gloo runs, shared by one test module."""
    from autotune.backends.sim import SimBackend

    sim = SimBackend(device_kind="cpu")
    yield sim
    sim.close()


@pytest.fixture(scope="module")
def cpu_sim_whole():
    """The same, tracing every model at full depth: what an extrapolation must equal."""
    from autotune.backends.sim import SimBackend

    sim = SimBackend(device_kind="cpu", extrapolate=False)
    yield sim
    sim.close()


@pytest.fixture(scope="session")
def gloo_runs(request, tmp_path_factory):
    """The real 2-rank gloo trials the comparing modules share: one launch (tests/shared_runs.py)."""
    from tests.shared_runs import SharedRuns

    wanted = {item.module.__name__ for item in request.session.items if "gloo_runs" in item.fixturenames}
    folder = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under pytest-xdist (make test: `-n 3 --dist loadfile`) every worker collects every test, so
        # `wanted` is the same in each; the parent of a worker's base folder is common to all of them.
        folder = folder.parent
    return SharedRuns(wanted_modules=wanted, folder=folder / "shared-gloo-runs")
