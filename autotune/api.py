"""The library entry point: `autotune.tune(...)` runs what `autotune tune` runs and returns the
result document (best.json's content) instead of printing it.

    import autotune
    result = autotune.tune("llama-7b", gpus=8, global_tokens="4M", backend="sim")
    result["fsdp"], result["micro_batch_size"], result["tokens_per_sec"]

Options are the `tune` command's, by their flag names with underscores (`nodes=8`,
`seq_len=4096`, `runs_dir="runs"`, `export="fsdp2,torchtitan"`, ...), validated exactly as on the
command line (a bad value raises UsageError with the CLI's one-line message). The run is
recorded in the study and runs/ like any other. Raises NothingFits when no configuration fits.
"""

from __future__ import annotations

from typing import Any

from autotune.errors import NothingFits, UsageError


def tune(model: str, *, gpus: int, global_tokens: int | str, **options: Any) -> dict[str, Any]:
    from autotune.cli import EXIT_OK, command_options, parse_args, run_tune
    from autotune.console import Console

    argv = ["tune", "--model", str(model), "--gpus", str(gpus), "--global-tokens", str(global_tokens)]
    known = {dest: action for dest, action in command_options("tune").items() if dest != "json"}
    for name, value in options.items():
        action = known.get(name)
        if action is None:
            raise UsageError(f"autotune.tune() has no option {name!r}; options are the tune command's flags "
                             f"with underscores: {', '.join(sorted(known))}")
        flag = action.option_strings[-1]
        if value is None or value is False:
            continue
        argv += [flag] if value is True else [flag, str(value)]

    class _Quiet(Console):
        """Nothing on stdout; the last error line is kept for the exception."""

        last_error = ""

        def error_line(self, text: str) -> None:
            _Quiet.last_error = text

    console = _Quiet(quiet=True)
    args = parse_args(argv)  # the CLI's validation: a bad value is its one-line UsageError
    code, document = run_tune(args, console)
    if code != EXIT_OK or document is None:
        raise NothingFits(_Quiet.last_error or "no configuration fits")
    return document
