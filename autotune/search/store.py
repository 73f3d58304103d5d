"""The Optuna study: every trial of a tuning problem, on SQLite or a shared database.

Trials are written to the study whole, in one insert each (`study.add_trial` of a finished
trial), so an interrupted run never leaves a half-recorded trial behind; rerunning the same
command finds the study by name and reuses its finished trials. A storage that stops answering
is waited for (outages), then given up on. Each run's own files are autotune/results/run_folder.py's.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autotune.problem import knobs
from autotune.problem.config import OWN_STEPS
from autotune.search.records import Step, TuneRequest, config_key
from autotune.util.cache import code_digest
from autotune.util.errors import StorageUnavailable, UsageError

STUDY_DB = "autotune.db"
_REUSED = "reused:"  # study attribute prefix: reused:<run_id>:<step> -> the trial a run's step reused


def default_storage(runs_dir: Path) -> str:
    return f"sqlite:///{(runs_dir / STUDY_DB).resolve()}"


def study_name(request: TuneRequest, backend: str) -> str:
    """Same command, same study: the name hashes everything that changes a trial's outcome."""
    identity = json.dumps({
        "model": request.model.config_dict, "model_type": request.model.model_type,
        "cluster": request.cluster.to_dict(), "seq_len": request.seq_len,
        "target": request.target_tokens, "headroom": request.headroom,
        "tolerance": request.tolerance, "backend": backend,
        # A GRPO problem never resumes an SFT study: its limit and its peaks differ.
        **({"workload": request.workload.to_dict()} if request.workload.kind != "sft" else {}),
        # Nor a LoRA fine-tune a full one (older full studies keep their names).
        **({"finetuning": request.finetuning.to_dict()} if request.finetuning.lora else {}),
        # Nor another stack's step autotune's own (older studies keep their names).
        **({"stack": request.stack} if request.stack != "fsdp2" else {}),
        # Nor a skewed-routing problem a balanced one.
        **({"routing_skew": request.routing_skew.to_dict()} if not request.routing_skew.balanced else {}),
        # Nor packed token-budget batches rows of whole sequences (autotune/problem/packing.py).
        **({"packing": request.packing.to_dict()} if request.packing is not None else {}),
        # Nor a torchtitan (LitGPT) study whose trials ran its own step one whose trials could not
        # (its package not importable where it ran: autotune's step; config.stack_step).
        **({f"{request.stack}_step": OWN_STEPS[request.stack].importable()} if request.stack in OWN_STEPS else {}),
        # Nor another attention implementation (--attention) the model's default.
        **({"attention": request.model.attention} if request.model.attention is not None else {}),
        # Nor a multimodal model's language model alone (--text-only) the whole model.
        **({"text_only_of": request.model.text_tower_of["model_type"]} if request.model.text_tower_of else {}),
    }, sort_keys=True, default=str)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.model.name)
    return f"{name}-{request.cluster.num_gpus}x{request.cluster.gpu.name}-{backend}-{digest}"


# What a worker sees when another one creates the same new database's schema or study at the same
# moment (SQLite and PostgreSQL both; alembic's version row, Optuna's tables and enum types).
_CREATION_RACE = ("already exists", "unique constraint failed", "duplicate key", "uniqueviolation",
                  "alembic_version", "studydirection")
_CREATION_ATTEMPTS = 8


SQLITE_BUSY_TIMEOUT_S = 60  # workers sharing one SQLite file wait for its lock instead of failing


def rdb_storage(url: str, *, heartbeat_s: float | None = None, retries: int = 0):
    """Optuna's RDBStorage for `url`: SQLite waits for a busy database (several workers on one
    file). With `heartbeat_s`, trials carry heartbeats, a trial silent for 3 beats is stale, and
    Optuna's own retry callback queues a stale trial again, `retries` times at most."""
    import warnings

    import optuna

    # SQLite: wait for the lock. Servers: test a pooled connection before use, so connections
    # that died with a restarted server are replaced instead of failing the next call.
    engine_kwargs = ({"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}} if url.startswith("sqlite")
                     else {"pool_pre_ping": True})
    heartbeat: dict[str, Any] = {}
    if heartbeat_s:
        # Stale after 3 missed beats, and never under 10 s: a busy machine (a worker importing torch,
        # SQLite waiting on its lock) can hold one beat back a few seconds.
        heartbeat = dict(heartbeat_interval=max(1, round(heartbeat_s)), grace_period=max(10, round(3 * heartbeat_s)))
    with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna 5.0, and what we need
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if heartbeat and retries:
            heartbeat["heartbeat_stale_trial_callback"] = optuna.storages.RetryHeartbeatStaleTrialCallback(
                max_retry=retries)
        storage = _patient_storage_class()(url, engine_kwargs=engine_kwargs, **heartbeat)
    if url.startswith("sqlite"):
        _serialize_sqlite_transactions(storage.engine)
    return storage


def _serialize_sqlite_transactions(engine) -> None:
    """Every transaction takes SQLite's write lock when it begins (BEGIN IMMEDIATE).

    Python's sqlite3 starts a transaction only at the first write, so Optuna's read-check-write
    (a WAITING trial set RUNNING only if still WAITING: how a sweep worker claims a problem and
    how Optuna pops an enqueued trial) is not atomic: two processes both read WAITING and both
    win (measured: 4 workers on 48 queued problems ran 4-5 of them twice). PostgreSQL and MySQL
    lock the row (SELECT ... FOR UPDATE) and need nothing. This is SQLAlchemy's documented recipe
    for pysqlite; connections made before it (schema set-up) are dropped so all get it."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _no_implicit_transactions(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" below issues BEGIN itself

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()


STORAGE_OUTAGE_ENV = "AUTOTUNE_STORAGE_OUTAGE_S"
DEFAULT_STORAGE_OUTAGE_S = 120.0


def _is_outage(exc: BaseException) -> bool:
    """A lost or refused connection (the server restarting, a network blip, SQLite's lock), as
    opposed to a bad write. Optuna wraps commit failures in StorageInternalError; the cause says."""
    import sqlalchemy.exc as sa

    seen: BaseException | None = exc
    for _ in range(8):  # the chain of causes (Optuna wraps, SQLAlchemy wraps the driver)
        if seen is None:
            return False
        # PendingRollbackError: the session still holds the transaction the lost connection broke.
        if isinstance(seen, (sa.OperationalError, sa.InterfaceError, sa.DisconnectionError, sa.PendingRollbackError)):
            return True
        if isinstance(seen, sa.DBAPIError) and seen.connection_invalidated:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _wait_through_outages(call, url: str):
    """call(), retried with backoff while the storage is unreachable: for up to
    $AUTOTUNE_STORAGE_OUTAGE_S (default 120 s), said once on stderr, then StorageUnavailable.
    `call` is a retry-safe storage operation (it starts a fresh session each time)."""
    import sys
    import time

    from autotune.util.secrets import mask

    limit = float(os.environ.get(STORAGE_OUTAGE_ENV, DEFAULT_STORAGE_OUTAGE_S))
    start, pause, said = time.monotonic(), 0.5, False
    while True:
        try:
            return call()
        except Exception as exc:
            if not _is_outage(exc):
                raise
            waited = time.monotonic() - start
            cause = mask(str(exc.__cause__ or exc).splitlines()[0])
            if waited > limit:
                raise StorageUnavailable(f"storage {mask(url)!r} unreachable for {waited:.0f} s "
                                         f"({cause}); finished trials are in it, rerun to resume") from None
            if not said:
                print(f"autotune: storage unreachable ({cause}); retrying for up to {limit:.0f} s",
                      file=sys.stderr, flush=True)
                said = True
        time.sleep(pause)
        pause = min(pause * 2, 5.0)


@functools.cache
def _patient_storage_class():
    """RDBStorage whose every call waits through a storage outage (_wait_through_outages).
    Only the outermost call retries (calls nest). A write whose commit reached the server just as
    the connection dropped can be applied twice (a rare duplicate trial, never a lost one)."""
    import inspect
    import threading

    import optuna

    depth = threading.local()

    def patient(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if getattr(depth, "n", 0):
                return method(self, *args, **kwargs)

            def once():
                depth.n = 1
                try:
                    return method(self, *args, **kwargs)
                except Exception:
                    with contextlib.suppress(Exception):
                        self.remove_session()  # a fresh session (and pooled connection) for a retry
                    raise
                finally:
                    depth.n = 0

            return _wait_through_outages(once, self.url)

        return call

    base = optuna.storages.RDBStorage
    # The storage interface: its public methods and the private ones Optuna's own caching layer and
    # heartbeat call directly. The constructor stays impatient: a wrong URL or a server that is
    # down at start fails at once.
    called_from_outside = ("_create_new_trial", "_set_trial_param", "_get_best_trial_id", "_get_trials",
                           "_get_stale_trial_ids")
    names = [name for name, value in vars(base).items()
             if inspect.isfunction(value) and (not name.startswith("_") or name in called_from_outside)]
    methods = {name: patient(getattr(base, name)) for name in names}
    return type("PatientRDBStorage", (optuna.storages.RDBStorage,), methods)


_OPENED: set[str] = set()
"""Storages this process has opened. Opening one the first time fails at once (a wrong URL, a
server down at start: the user's to fix); opening it again (a sweep worker starting its next
problem's study) waits through an outage like every other storage call."""

_SERVER_STORAGES: dict[tuple, Any] = {}
"""One storage per database server URL and options in this process, shared by its studies: every
storage is a SQLAlchemy engine with its own connection pool, and a sweep worker opens a study per
problem; a storage per study left each one's pooled connection open until the garbage collector
found it (measured: 30 studies opened from one URL, 25 PostgreSQL connections open), which a
long sweep of many workers on one server could take past its max_connections. SQLite files are
not shared: a file deleted and made again under the same path must not be written through a
connection to the old one."""


def _storage(url: str, options: dict):
    """The storage for `url`: the process's shared one for a server, else a new one (rdb_storage).
    The first open of a URL fails at once; a later one waits through an outage (_OPENED)."""
    key = (os.getpid(), url, repr(sorted(options.items())))  # a forked child makes its own: no shared sockets
    storage = _SERVER_STORAGES.get(key)
    if storage is None:
        def open_storage():
            return rdb_storage(url, **options)

        storage = _wait_through_outages(open_storage, url) if url in _OPENED else open_storage()
        if not url.startswith("sqlite"):
            _SERVER_STORAGES[key] = storage
    _OPENED.add(url)
    return storage


def create_study(url: str, name: str, *, storage_options: dict | None = None):
    """(study, created): optuna's study `name`, created or loaded, safe when workers start together
    on a new database: the loser of a schema or study creation race retries after a short random
    pause and then finds what the winner made. `created` is True for exactly one caller. Anything
    else is raised at once."""
    import random
    import time

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created" lines in our output
    for attempt in range(_CREATION_ATTEMPTS):
        try:
            storage = _storage(url, storage_options or {})
            try:
                return optuna.create_study(storage=storage, study_name=name, direction="maximize"), True
            except optuna.exceptions.DuplicatedStudyError:
                return optuna.load_study(storage=storage, study_name=name), False
        except Exception as exc:  # noqa: BLE001 - only the creation race is retried
            text = f"{type(exc).__name__} {exc}".lower()
            if attempt == _CREATION_ATTEMPTS - 1 or not any(mark in text for mark in _CREATION_RACE):
                raise
            time.sleep(random.uniform(0.1, 0.5) * (attempt + 1))
    raise AssertionError("unreachable")


@contextlib.contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """A storage that cannot be opened (no driver, bad URL, unreachable server, unreadable file)
    is the user's to fix: one line, the password masked."""
    from autotune.util.secrets import mask

    shown = mask(url)
    try:
        yield
    except (ImportError, ModuleNotFoundError) as exc:
        raise UsageError(f"storage {shown!r} needs a driver that is not installed: {mask(exc)}") from None
    except Exception as exc:
        if exc.__class__.__name__ in ("ArgumentError", "OperationalError", "NoSuchModuleError", "ValueError"):
            raise UsageError(f"cannot open storage {shown!r}: {mask(str(exc).splitlines()[0])}") from None
        if exc.__class__.__name__ == "DatabaseError" and "not a database" in str(exc):
            # A file that is not SQLite (corrupted, or something else under the name): nothing is written to it.
            raise UsageError(f"storage {shown!r} is not a study database (file is not a database): move the file "
                             "away, or pass --storage (or --runs-dir) elsewhere") from None
        raise


class TrialStore:
    """The Optuna study of one tuning problem."""

    def __init__(self, storage: str, name: str) -> None:
        from autotune.util.secrets import mask, with_password

        with storage_errors(storage):
            self.study, _ = create_study(with_password(storage), name)
        self.storage = mask(storage)  # what is printed and logged; the password only reaches the driver
        self.name = name

    def finished(self) -> dict[str, dict[str, Any]]:
        """Finished trials by configuration key, newest wins."""
        records: dict[str, dict[str, Any]] = {}
        for trial in self.study.get_trials(deepcopy=False):
            attrs = trial.user_attrs
            if "key" in attrs and "result" in attrs and attrs.get("stage") != "confirm":
                records[attrs["key"]] = {**attrs, "number": trial.number}
        return records

    def record(self, step: Step, *, run_id: str) -> int:
        """Add the step as one finished trial; returns its trial number. A step that reused a
        finished trial is recorded as a reference to it (a study attribute), not as a second trial:
        resuming never duplicates what the study holds."""
        if step.reused_from is not None:
            self.study.set_user_attr(f"{_REUSED}{run_id}:{step.step}",
                                     {"number": step.reused_from, "step": step.step, "stage": step.stage,
                                      "reason": step.reason})
            return step.reused_from
        import optuna
        from optuna.trial import TrialState

        record = step_record(step)
        record["run_id"] = run_id
        train = step.train
        # Fixed value spaces (a study refuses a parameter whose space changes between trials).
        params, distributions = knobs.optuna_params(train.knob_values())
        value = step.result.throughput
        if step.fits:
            state, values = TrialState.COMPLETE, [float(value) if value is not None else 0.0]
        elif step.result.status == "pruned":
            state, values = TrialState.PRUNED, None
        else:
            state, values = TrialState.FAIL, None
        frozen = optuna.trial.create_trial(state=state, values=values, params=params,
                                           distributions=distributions, user_attrs=record)
        self.study.add_trial(frozen)
        return len(self.study.get_trials(deepcopy=False)) - 1

    def trials(self, *, run_id: str | None = None) -> list[dict[str, Any]]:
        """Trial records (see `step_record`), optionally of one run, in order; a run's steps that
        reused earlier trials appear with that run's step, stage and reason."""
        trials = self.study.get_trials(deepcopy=False)
        out = []
        for trial in trials:
            attrs = dict(trial.user_attrs)
            if "result" not in attrs or (run_id is not None and attrs.get("run_id") != run_id):
                continue
            attrs["number"] = trial.number
            out.append(attrs)
        if run_id is not None:
            by_number = {trial.number: trial for trial in trials}
            for key, ref in self.study.user_attrs.items():
                if key.startswith(f"{_REUSED}{run_id}:") and ref["number"] in by_number:
                    attrs = dict(by_number[ref["number"]].user_attrs)
                    attrs.update(step=ref["step"], stage=ref["stage"], reason=ref["reason"], run_id=run_id,
                                 reused_from=ref["number"], number=ref["number"])
                    out.append(attrs)
            out.sort(key=lambda record: record["step"])
        return out


def step_record(step: Step) -> dict[str, Any]:
    """A step as plain data: the trial record stored in the study and drawn in the report."""
    return {
        "step": step.step,
        "stage": step.stage,
        "config": step.train.to_dict(),
        "grad_accum_steps": step.batch.grad_accum_steps,
        "global_tokens": step.batch.global_tokens,
        "status": step.result.status,
        "fits": step.fits,
        "backend": step.backend,
        "reason": step.reason,
        "result": step.result.to_dict(),
        "predicted": step.predicted.to_dict() if step.predicted else None,
        "reused_from": step.reused_from,
        "key": config_key(step.train, grad_accum_steps=step.batch.grad_accum_steps, backend=step.backend),
        "made_by": code_digest(),  # an estimate is reused only by the code that made it (controller.run)
    }
