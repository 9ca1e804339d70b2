"""The hooks other parts of dtrun follow a running job by (hang watch, straggler watch,
restarts, the PMIx session lock). Standard library only, so an observer's module pays
nothing for importing it."""
from __future__ import annotations


class JobObserver:
    """Hooks into a running job; every method is optional and runs on dtrun's threads.

    ``on_start`` hands over the ``JobSupervisor``: an observer that must end the job calls
    its ``stop(reason, detail)``, the one way a job is stopped. ``on_signal`` returns True
    when it handled the signal itself (the job is then not stopped).
    """

    def on_start(self, job) -> None:
        pass

    def on_output(self, stream: str, data: bytes) -> None:
        """Every chunk of the job's ``stdout`` or line of ``stderr`` (markers excluded)."""

    def on_rank_start(self, rank: str, host: str) -> None:
        pass

    def on_rank_exit(self, failure) -> None:
        pass

    def on_signal(self, signum: int) -> bool:
        return False

    def on_end(self, result) -> None:
        pass
