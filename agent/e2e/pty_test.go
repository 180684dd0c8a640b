package e2e

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// ptyCounterScript holds a pseudo-terminal open for its whole life (as Open MPI's orted does for each
// rank's output), says its name on stderr, then counts on stdout like counterArgv.
const ptyCounterScript = `
import os, pty, sys, time
m, s = pty.openpty()
print(os.ttyname(s), file=sys.stderr, flush=True)
i = 0
while True:
    print(i, flush=True)
    i += 1
    time.sleep(0.05)
`

// TestRestoredPtyIndexIsFree: a job holding a pty fails over to a host where the pty's index is taken on
// the host's devpts. CRIU restores a pty only at its original index; the job has a devpts instance of its
// own (shim.privateDevpts), so the restore succeeds. On the old code (the job on the host's devpts) it
// failed with "tty: Unable to open dev/ptmx with specified index N", as TestMPIFailover did in CI while
// another test's mpirun held that index.
func TestRestoredPtyIndexIsFree(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	ctx := context.Background()
	j, err := c.Client("node1").StartJob(ctx, agent.JobSpec{Name: "pty", Argv: []string{"/usr/bin/python3", "-c", ptyCounterScript},
		Env: []string{"PATH=/usr/bin:/bin"}})
	if err != nil {
		t.Fatal(err)
	}
	var tty string
	poll(t, 30*time.Second, "the job's pty name and first line", func() bool {
		e, _ := os.ReadFile(j.StderrPath())
		o, _ := os.ReadFile(j.StdoutPath())
		tty = strings.TrimSpace(string(e))
		return tty != "" && len(o) > 0
	})
	t.Logf("the job's pty: %s", tty)
	if tty != "/dev/pts/0" {
		t.Errorf("the job's pty is %s, want /dev/pts/0: the first pty of a devpts instance of its own", tty)
	}
	replicate(t, c, "node1", "node2", j)
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	// The crash freed the job's pty. Take every free index of the machine's devpts (which all lab hosts
	// share) up to past the job's before spare1 restores it: on the old code, the job's index is among them.
	upTo := 8
	if k, err := strconv.Atoi(strings.TrimPrefix(tty, "/dev/pts/")); err == nil && k >= upTo {
		upTo = k + 1
	}
	for range 1024 {
		fd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatalf("open /dev/ptmx: %v", err)
		}
		t.Cleanup(func() { unix.Close(fd) })
		if n, err := unix.IoctlGetInt(fd, unix.TIOCGPTN); err != nil || n >= upTo {
			break
		}
	}
	requireStages(t, waitFailure(t, c, "node1", 5*time.Minute))
	requireOneIncarnation(t, c, j, 20)
}
