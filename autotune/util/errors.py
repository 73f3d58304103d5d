"""One exception root. A UsageError is the user's to fix: the CLI prints it as one line, exit 2."""


class AutotuneError(Exception):
    """Root of every error autotune raises on purpose."""


class UsageError(AutotuneError, ValueError):
    """Bad input: the message says what was wrong and how to fix it."""


class UnsupportedModelError(UsageError):
    """The model has no repeated decoder blocks that FSDP can wrap one by one."""


class TrialError(AutotuneError):
    """A trial could not be evaluated (not an out-of-memory: that is a result, not an error)."""


class StorageUnavailable(AutotuneError):
    """The study's storage stayed unreachable longer than autotune waits (exit code 5)."""


class NothingFits(AutotuneError):
    """No configuration fits (autotune.tune; the CLI exits 3): the message says which limit and what to do;
    `binds` names it: "memory", or "global batch" where configurations fit but none keeps the batch."""

    def __init__(self, message: str, *, binds: str = "memory") -> None:
        super().__init__(message)
        self.binds = binds
