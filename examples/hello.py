"""The demo job: every rank reports its rank, the job size and its host."""
import os
import socket

from mpi4py import MPI

comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank)  # a real collective, so a broken network shows here
print(f"rank {comm.rank}/{comm.size} on {socket.gethostname()} "
      f"(local rank {os.environ.get('DTRUN_LOCAL_RANK', '?')}/{os.environ.get('DTRUN_LOCAL_SIZE', '?')}); "
      f"sum of ranks = {total}", flush=True)
