"""mpi4py's ``MPI`` module, imported (which runs MPI_Init) with Open MPI's osc/ucx turned off.

Open MPI 5 prints "OSC UCX component priority set inside component query failed" on
hosts without UCX devices when the first window (our shared-memory one) is created.
Shared-memory windows are served by osc/sm anyway. The choice must be made before
MPI_Init, through the environment, so ``OMPI_MCA_osc=^ucx`` is set for the length of
the import and removed again once MPI is up: ``os.environ`` is left as it was, and
child processes (another mpirun started by the program) do not inherit it. A user's
own ``OMPI_MCA_osc`` wins and is never touched. If MPI was already imported, or
mpi4py is told not to initialise (``mpi4py.rc.initialize = False``), nothing is set
or, in the second case, the setting stays until the program calls MPI_Init itself.

Every module of this package that needs MPI imports it from here.
"""

from __future__ import annotations

import os
import sys

_SET = "mpi4py.MPI" not in sys.modules and "OMPI_MCA_osc" not in os.environ
if _SET:
    os.environ["OMPI_MCA_osc"] = "^ucx"
try:
    from mpi4py import MPI
finally:
    if _SET and ("mpi4py.MPI" not in sys.modules or sys.modules["mpi4py.MPI"].Is_initialized()):
        if os.environ.get("OMPI_MCA_osc") == "^ucx":
            del os.environ["OMPI_MCA_osc"]

__all__ = ["MPI"]
