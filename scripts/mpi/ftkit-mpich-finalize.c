/*
 * libftkit-mpich.so: preloaded into every MPICH rank by `ftctl mpirun --impl mpich` (LD_PRELOAD), so that
 * MPI_Finalize cannot hang with MPICH 4.0 (ch4:ucx) over UCX's TCP transport. See docs/mpi.md, "MPICH".
 *
 * Why: MPICH 4.0.2's finalize (src/mpid/ch4/netmod/ucx/ucx_init.c, MPIDI_UCX_mpi_finalize_hook) calls
 * ucp_disconnect_nb on every endpoint, progresses its UCX worker until those closes complete, and only then
 * enters the PMI barrier, a blocking read that progresses nothing. A close flushes the endpoint, and UCX
 * 1.13's TCP transport flushes an endpoint that sent anything by sending a zero-length PUT and waiting for
 * the peer's acknowledgement (src/uct/tcp/tcp_ep.c, uct_tcp_ep_flush: UCT_TCP_EP_FLAG_NEED_FLUSH, set by
 * every active message). A peer whose own closes completed first, which is common when the ranks leave the
 * last collective at different times, already sits in the PMI barrier and never acknowledges: the other
 * rank spins in ucp_worker_progress forever. MPICH removed that barrier after the disconnects in 4.2.0
 * (pmodels/mpich#6596: "Having the process stuck in PMI_barrier may prevent other processes to complete
 * the previous ucp_disconnect_nb"); no UCX or MPICH variable changes either step in 4.0.2.
 *
 * What: ucp_disconnect_nb closes nothing and reports the close done, so no rank waits for a peer before the
 * PMI barrier. The endpoints are destroyed, without a flush, by ucp_worker_destroy right after the barrier
 * (UCX destroys the endpoints a worker still has). No MPI message is lost: a rank enters MPI_Finalize only
 * after its communication completed (the MPI standard requires it), so once every rank passed the barrier
 * none waits for a byte. MPICH 4.0.2 calls ucp_disconnect_nb only from that finalize hook, and no other
 * library a rank loads should: a program that uses UCX itself must not get this library.
 */
#include <stddef.h>

__attribute__((visibility("default"))) void *ucp_disconnect_nb(void *ep)
{
    (void)ep;
    return NULL; /* UCS_OK: the close completed */
}
