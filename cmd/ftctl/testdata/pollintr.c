/* pollintr: waits in poll() without timeout on stdin while a signal without SA_RESTART interrupts it (as CRIU's
 * dump does to hydra_pmi_proxy); prints what poll returned: "ready" or "eintr". TestMPICHLibPoll runs it. */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* says it ran: by then the interrupted poll has returned (or, retried, waits again) */
static void on_usr1(int sig)
{
    (void)sig;
    write(1, "signal\n", 7);
}

int main(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1; /* no SA_RESTART: poll returns EINTR unless retried */
    sigaction(SIGUSR1, &sa, NULL);
    printf("waiting\n");
    fflush(stdout);
    struct pollfd p = {.fd = 0, .events = POLLIN};
    int n = poll(&p, 1, -1);
    printf("%s\n", n == 1 ? "ready" : (n < 0 && errno == EINTR) ? "eintr" : "other");
    return 0;
}
