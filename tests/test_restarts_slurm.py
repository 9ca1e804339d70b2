"""A restart inside a Slurm allocation when a node is lost (tests/slurmcluster.py): the node is
left out of the next srun step (its --nodelist) and the job goes on with the nodes left. The
allocation is made with --no-kill: without it Slurm revokes the whole allocation when a node fails."""
import re
import subprocess
import threading

import pytest

from tests.dtrun_helpers import DTRUN, PYTHON, REPO
from tests.test_restarts_cluster import EXAMPLE, lose, read_until
from tests.test_slurm import env_of, make_cluster_module, slurm  # noqa: F401 (module fixtures)

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]


def test_node_lost_inside_an_allocation_is_left_out_of_the_next_step(slurm, tmp_path):  # noqa: F811
    nodes = slurm.nodes
    argv = slurm.head_argv(["salloc", "--no-kill", "-N3", "-n6", DTRUN, "-np", "4", "--max-restarts", "1", "--hang-timeout", "5",
                            "--on-hang", "restart", "--no-tag-output", PYTHON, EXAMPLE, "--checkpoint",
                            str(tmp_path / "ckpt"), "--steps", "30", "--step-time", "0.2"])
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_of(slurm),
                         cwd=REPO, stdin=subprocess.DEVNULL)
    err = []
    reader = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
    reader.start()
    read_until(p.stdout, r"^step 6 ")
    lose(slurm.cluster.hosts[1], silent_first=True)  # slurmd, the step's processes, all its traffic
    try:
        out = p.stdout.read()  # until the job ends (pytest's own timeout bounds it)
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(10)
    err = "".join(err)
    assert rc == 0, err
    # 4 ranks filled nodes 1 and 2 (2 slots each); node 3 was the spare
    assert re.search(rf"^dtrun: attempt 2 of 2: {nodes[1]} left out \(Slurm could not start a step on {nodes[1]}"
                     rf"[^)]*\); .+; 4 ranks on {nodes[0]}, {nodes[2]} \(spare\)$", err, re.M), err
    assert re.search(r"attempt 1: 4 ranks, resumed from step \d+", out), out
    assert "final w" in out
