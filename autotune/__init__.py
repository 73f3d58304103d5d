"""autotune: find the fastest PyTorch FSDP2 configuration that fits, and prove it.

The pipeline, in the order a run walks it (one folder or module each; docs/ARCHITECTURE.md draws
it, with the import layers tests/test_architecture.py checks):

    catalog/      models and GPUs the tool knows (plain data), where a model's decoder blocks are
    knobs.py      the tuned knobs, defined once (everything that lists them derives from it)
    config.py     what a trial is: model, cluster, the tuned knobs, the global batch
    parallel.py   the one device mesh (ParallelDims) and FSDP2 wrapping every trial, trace and export uses
    training.py   the training step every trial (real or traced) runs
    backends/     how a trial is evaluated: estimated, predicted (sim), measured (cpu/cuda)
    records.py    what a run was asked and each step it took (TuneRequest, Step)
    controller.py the memory-tuning decision graph over a backend
    store.py      the Optuna study: every trial, on SQLite or a shared database
    run_folder.py runs/<run-id>/: its name, status.json, autotune.log, trials.csv
    export/       the winner in the formats of other stacks
    report/       the HTML report
    options.py    the tune options, typed (TuneOptions), and the validators the CLI's flags use too
    api.py        the library: autotune.tune() runs the whole pipeline and returns the result document
    cli.py        the command line: parses flags into the library's options, prints, exits with a code
"""

import logging as _logging

from autotune.util.version import __version__

# torchao (the float8 extra) logs a warning for each CUDA kernel library a CPU build of torch cannot
# load, whenever it is imported (transformers' quantizers import it on every model build), and its
# enums' pytree registration makes torch warn that this is deprecated: noise to every user, dropped.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").addFilter(
    lambda record: "register_constant() on Enum subclasses" not in record.getMessage())


def tune(model: str, *, gpus: int, global_tokens: int | str, **options):
    """Tune one problem and return the result document (autotune/drivers/api.py; the `tune` command wraps it).
    `seq_len="max"`: the longest sequence length that fits, tuned (autotune/drivers/seqlen.py), the search's
    probes under the document's `sequence_length`."""
    if str(options.get("seq_len", "")).strip().lower() == "max":
        from autotune.results.console import Console
        from autotune.problem.options import tune_options
        from autotune.drivers.seqlen import tune_at_longest

        checked = tune_options(model=model, gpus=gpus, global_tokens=global_tokens, **{**options, "seq_len": None})
        return tune_at_longest(checked, Console(quiet=True))
    from autotune.drivers.api import tune as _tune

    return _tune(model, gpus=gpus, global_tokens=global_tokens, **options)
