"""Every rank exchanges a vector with every other rank each iteration and adds what it receives to its
accumulator in the order the messages complete (MPI_Waitany over one receive per peer). Floating-point
addition does not associate, so the accumulator, and so everything the rank sends next, depends on the
arrival order, which differs from run to run. Debian's mpi4py over Open MPI.

    python3 waitany.py ITERS SLEEP_MS [waitany|anysource]
    python3 waitany.py --check RANKS ITERS < output

Rank 0 gathers every rank's order and accumulator and prints, per iteration (flushed), "it I P,Q:HEX ..."
(one field per rank: the peers in the order it read them, then its accumulator), and "done" at the end:
one writer, so that mpirun never interleaves the lines. --check reads a whole run's output and recomputes
it from the printed orders: it prints "consistent" and exits 0 only if every iteration was printed once and
every accumulator is what its rank's printed order gives from what the peers sent, i.e. the run is one a
failure-free execution could have printed.
"""

import math
import sys
import time

VALUES = 512  # floats per message: a few KiB pickled, below irecv's 64 KiB buffer


def vector(rank, acc):
    # Magnitudes from 1e-6 to 1e6: the sum's rounding depends on the order of addition.
    return [math.sin(acc + rank * 7 + k) * 10.0 ** (k % 13 - 6) for k in range(VALUES)]


def fold(acc, vectors):
    for vec in vectors:
        for v in vec:
            acc += v
    return math.fmod(acc, 1e7)


def run(iters, sleep, mode):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    peers = [p for p in range(size) if p != rank]
    acc = float(rank + 1)
    for it in range(iters):
        sends = [comm.isend(vector(rank, acc), dest=p, tag=it) for p in peers]
        order, got = [], []
        if mode == "anysource":
            st = MPI.Status()
            for _ in peers:
                got.append(comm.recv(source=MPI.ANY_SOURCE, tag=it, status=st))
                order.append(st.Get_source())
        else:
            recvs = [comm.irecv(bytearray(1 << 16), source=p, tag=it) for p in peers]
            for _ in peers:
                i, vec = MPI.Request.waitany(recvs)
                order.append(peers[i])
                got.append(vec)
        acc = fold(acc, got)
        # Compute before anything that depends on the order just read is sent (the gather, the next
        # vectors): a rank whose sends follow its receives at once has a window in which a crash takes
        # determinants the protector has not yet received (docs/receive-order.md, orphans).
        time.sleep(sleep)
        MPI.Request.waitall(sends)
        rows = comm.gather(f"{','.join(map(str, order))}:{acc.hex()}", root=0)
        if rank == 0:
            print(f"it {it} {' '.join(rows)}", flush=True)
    if rank == 0:
        print("done", flush=True)


def check(ranks, iters, lines):
    rows, done = {}, False
    for line in lines:
        f = line.split()
        if f == ["done"]:
            done = True
        elif len(f) == ranks + 2 and f[0] == "it":
            it = int(f[1])
            if it in rows:
                return f"iteration {it} printed twice"
            rows[it] = [(field.split(":")[0], float.fromhex(field.split(":")[1])) for field in f[2:]]
    acc = [float(r + 1) for r in range(ranks)]
    for it in range(iters):
        if it not in rows:
            return f"iteration {it} never printed"
        sent = [vector(r, acc[r]) for r in range(ranks)]
        for r, (order, printed) in enumerate(rows[it]):
            order = [int(p) for p in order.split(",")]
            if sorted(order) != [p for p in range(ranks) if p != r]:
                return f"rank {r} iteration {it}: order {order} is not one message from each peer"
            acc[r] = fold(acc[r], [sent[p] for p in order])
            if acc[r] != printed:
                return f"rank {r} iteration {it}: printed {printed.hex()}, its order {order} gives {acc[r].hex()}"
    if not done:
        return "no done line"
    return None


def main():
    if sys.argv[1] == "--check":
        err = check(int(sys.argv[2]), int(sys.argv[3]), sys.stdin.read().splitlines())
        if err:
            print(f"inconsistent: {err}")
            sys.exit(1)
        print("consistent")
        return
    run(int(sys.argv[1]), int(sys.argv[2]) / 1000, sys.argv[3] if len(sys.argv) > 3 else "waitany")


main()
