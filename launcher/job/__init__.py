"""The job supervisor: mpirun (or srun, mpiexec) run as a child, from its start to dtrun's exit code.

* ``supervisor`` — ``run_job`` and ``JobSupervisor``: signals, time limits, a failed rank;
  the one ``stop(reason, detail)`` every cause goes through; observers (``JobObserver``).
* ``result`` — the typed records: ``StopReason``, ``StopState``, ``RankFailure``, ``JobResult``
  and the exit code they give.
* ``pumps`` — mpirun's stdout and stderr copied through dtrun.
* ``markers`` — the rank wrapper's start, exit and end-of-output markers (``launcher.remote.wire``).
* ``parsers`` — what Open MPI and MPICH print about a failed job.
* ``summary`` — every message about a job's end, rendered in one place.
* ``kill`` — ending processes: this host's mpirun session, and asking the host agents to
  end a stopped job's leftovers on every host.
"""
