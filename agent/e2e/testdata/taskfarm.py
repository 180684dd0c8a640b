"""A task farm over MPI (Debian's mpi4py): the master (rank 0) hands the next task to whichever worker
answers first (MPI.ANY_SOURCE), each worker spends about 8 ms on a task and returns a hash of it. The result,
"tasks N sum S", does not depend on which worker did which task; the order of the master's receives does.

    python3 taskfarm.py [TASKS]

The master prints "progress K" every 100 results (flushed), for a test to follow the run.
"""

import hashlib
import sys
import time

from mpi4py import MPI

STOP = -1


def work(task):
    time.sleep(0.008)
    return int(hashlib.sha256(str(task).encode()).hexdigest()[:12], 16)


def master(comm, tasks):
    workers = comm.Get_size() - 1
    nxt, done, total = 0, set(), 0
    for w in range(1, workers + 1):
        comm.send(nxt if nxt < tasks else STOP, dest=w)
        nxt += 1
    st = MPI.Status()
    while len(done) < tasks:
        task, h = comm.recv(source=MPI.ANY_SOURCE, status=st)
        if task in done:
            raise SystemExit(f"task {task} returned twice")
        done.add(task)
        total += h
        comm.send(nxt if nxt < tasks else STOP, dest=st.Get_source())
        nxt += 1
        if len(done) % 100 == 0:
            print(f"progress {len(done)}", flush=True)
    print(f"tasks {len(done)} sum {total}", flush=True)


def worker(comm):
    while True:
        task = comm.recv(source=0)
        if task == STOP:
            return
        comm.send((task, work(task)), dest=0)


def main():
    tasks = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        master(comm, tasks)
    else:
        worker(comm)


main()
