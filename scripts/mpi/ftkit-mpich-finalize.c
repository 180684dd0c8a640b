/*
 * libftkit-mpich.so: `ftctl mpirun --impl mpich` preloads it (LD_PRELOAD) into the whole MPICH run: mpiexec,
 * every hydra_pmi_proxy and every rank. It works around two bugs of MPICH 4.0 (Debian bookworm's 4.0.2,
 * ch4:ucx, UCX 1.13.1), both fixed in later MPICH releases; each interposer below changes nothing in a
 * process it is not meant for. See docs/mpi.md, "MPICH".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

/*
 * 1. MPI_Finalize hangs in about half of the runs over UCX's TCP transport.
 *
 * MPICH 4.0.2's finalize (src/mpid/ch4/netmod/ucx/ucx_init.c, MPIDI_UCX_mpi_finalize_hook) calls
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
 * Here ucp_disconnect_nb closes nothing and reports the close done, so no rank waits for a peer before the
 * PMI barrier. The endpoints are destroyed, without a flush, by ucp_worker_destroy right after the barrier
 * (UCX destroys the endpoints a worker still has). No MPI message is lost: a rank enters MPI_Finalize only
 * after its communication completed (the MPI standard requires it), so once every rank passed the barrier
 * none waits for a byte. MPICH 4.0.2 calls ucp_disconnect_nb only from that finalize hook; a program that
 * uses UCX itself must not run under `ftctl mpirun --impl mpich`.
 */
EXPORT void *ucp_disconnect_nb(void *ep)
{
    (void)ep;
    return NULL; /* UCS_OK: the close completed */
}

/*
 * 2. A snapshot of a host's job can leave its hydra_pmi_proxy waiting forever: the run never starts.
 *
 * CRIU resumes a process it dumped while it slept in poll() with poll returning EINTR (compel cannot
 * restart a syscall that uses the kernel's restart block: "Will restore PID with interrupted system call"
 * in the dump log), and the agent snapshots every new job at once. MPICH 4.0.2's proxy (src/pm/hydra/pm/
 * pmiserv/pmip.c, main) treats any return of its event loop's poll as an event, and leaves the loop when
 * none of its processes' stdout or stderr is open. Before it has launched them none is, so an EINTR in that
 * window makes it launch the rank later and then block in waitpid(), never serving the rank's PMI
 * requests: every rank waits in MPI_Init. MPICH 4.1 skips that check until the processes are launched
 * (commit 7d7823455e, "processes haven't been launched yet"). The proxy handles its signals in their
 * handlers and needs nothing from an interrupted wait, so in hydra_pmi_proxy only, a poll() without timeout
 * that EINTR interrupts is waited again.
 */
static int (*real_poll)(struct pollfd *, nfds_t, int);
static int is_proxy = -1; /* unknown yet */

EXPORT int poll(struct pollfd *fds, nfds_t nfds, int timeout)
{
    if (real_poll == NULL)
        real_poll = (int (*)(struct pollfd *, nfds_t, int))dlsym(RTLD_NEXT, "poll");
    if (is_proxy < 0)
        is_proxy = strcmp(program_invocation_short_name, "hydra_pmi_proxy") == 0;
    for (;;) {
        int n = real_poll(fds, nfds, timeout);
        if (n >= 0 || errno != EINTR || !is_proxy || timeout >= 0)
            return n;
    }
}
