"""torchrun, with the agent's view of failed ranks kept: `python -m autotune.backends.real._torchrun ARGS`.

Runs torch's own launcher (`torch.distributed.run.main`) unchanged; when ranks fail it also
writes, to the file named by $AUTOTUNE_AGENT_FAILURES, each failed rank's exit code or signal
as the elastic agent observed it. That tells a rank that died without a Python exception
(segfault, os._exit, kill) from one the agent stopped, without reading stderr.
"""

from __future__ import annotations

import json
import os
import sys

def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from autotune.backends.real._launcher import AGENT_FAILURES_ENV

    try:
        torchrun_main(argv if argv is not None else sys.argv[1:])
    except ChildFailedError as exc:
        failures = [dict(rank=rank, local_rank=failure.local_rank, exitcode=failure.exitcode,
                         signal=failure.signal_name() if failure.exitcode < 0 else None,
                         timestamp=failure.timestamp, error_file=failure.error_file)
                    for rank, failure in exc.failures.items()]
        target = os.environ.get(AGENT_FAILURES_ENV)
        if target:
            with open(target + ".tmp", "w") as handle:
                json.dump(failures, handle)
            os.replace(target + ".tmp", target)
        sys.exit(1)


if __name__ == "__main__":
    main()
