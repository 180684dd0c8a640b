/*
 * ring: a small deterministic MPI program for fail-over tests (TestMPICHFailover).
 *
 * Each rank holds a block of a periodic 1-D array of 64-bit integers. Every iteration it trades halos with
 * both neighbours on the ring (MPI_Sendrecv), passes a token once around the ring, updates its block with
 * an integer stencil (repeated `work` times, the compute between messages) and joins an MPI_Allreduce of
 * the blocks' hashes. Rank 0 prints that global hash every `every` iterations and at the end. Integer
 * arithmetic only: the output is the same in every correct run, and depends on every byte the ranks
 * exchanged.
 *
 * usage: ring [iterations [work [every]]]
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 16384 /* cells per rank */
#define HALO 512    /* cells per halo message: 4 KiB */

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
}

static uint64_t hash(const uint64_t *a, int n)
{
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < n; i++)
        h = (h ^ a[i]) * 1099511628211ULL;
    return h;
}

int main(int argc, char **argv)
{
    int iters = argc > 1 ? atoi(argv[1]) : 300;
    int work = argc > 2 ? atoi(argv[2]) : 20;
    int every = argc > 3 ? atoi(argv[3]) : 10;
    int rank, size;

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int left = (rank + size - 1) % size, right = (rank + 1) % size;

    /* cells [HALO, HALO+BLOCK) are this rank's; the HALO cells either side are copies of the neighbours' */
    uint64_t *a = calloc(BLOCK + 2 * HALO, sizeof *a), *b = calloc(BLOCK + 2 * HALO, sizeof *b);
    if (!a || !b) {
        fprintf(stderr, "ring: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int i = 0; i < BLOCK; i++)
        a[HALO + i] = mix((uint64_t)rank * BLOCK + i + 1);

    for (int it = 1; it <= iters; it++) {
        /* halos: my first cells go left, my last cells go right */
        MPI_Sendrecv(a + HALO, HALO, MPI_UINT64_T, left, 1, a + HALO + BLOCK, HALO, MPI_UINT64_T, right, 1,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Sendrecv(a + BLOCK, HALO, MPI_UINT64_T, right, 2, a, HALO, MPI_UINT64_T, left, 2, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);

        /* a token once around the ring, each rank folding in its first cell */
        uint64_t token;
        if (rank == 0) {
            token = mix(it) ^ a[HALO];
            MPI_Send(&token, 1, MPI_UINT64_T, right, 3, MPI_COMM_WORLD);
            MPI_Recv(&token, 1, MPI_UINT64_T, left, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else {
            MPI_Recv(&token, 1, MPI_UINT64_T, left, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            token = mix(token ^ a[HALO]);
            MPI_Send(&token, 1, MPI_UINT64_T, right, 3, MPI_COMM_WORLD);
        }
        MPI_Bcast(&token, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);

        for (int w = 0; w < work; w++) {
            for (int i = HALO; i < HALO + BLOCK; i++)
                b[i] = mix(a[i - 1] + 3 * a[i] + a[i + 1] + token + w);
            memcpy(a + HALO, b + HALO, BLOCK * sizeof *a);
        }

        uint64_t mine = hash(a + HALO, BLOCK), all;
        MPI_Allreduce(&mine, &all, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
        if (rank == 0 && (it % every == 0 || it == iters)) {
            printf("iter %d sum %016llx\n", it, (unsigned long long)all);
            fflush(stdout);
        }
    }
    if (rank == 0) {
        printf("done %d iterations on %d ranks\n", iters, size);
        fflush(stdout);
    }
    free(a);
    free(b);
    MPI_Finalize();
    return 0;
}
