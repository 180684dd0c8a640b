package main

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/internal/cli"
)

// A job named with --job that runs on none of the hosts asked is not silently left out: with several
// agents each is asked only for the named jobs it runs, and a typo (or a job that ended) must fail the
// command as the single agent's refusal does (exit 3), not exit 0 with the other jobs' snapshots.
func TestCheckpointNamedJobRunsNowhere(t *testing.T) {
	fc := startFakeCluster(t, "node1", "node2")
	cfg := writeClusterConfig(t, fc.ca, 0o600, fmt.Sprintf("[[agent]]\nname = \"node1\"\naddress = %q\n", fc.addrs["node1"]))
	os.Unsetenv(clusterEnv)
	for _, tc := range []struct {
		jobs []string
		code int
	}{
		{[]string{"job-on-node1"}, cli.ExitOK},
		{[]string{"job-on-node1", "typo-00000001"}, cli.ExitNotFound},
		{[]string{"typo-00000001"}, cli.ExitNotFound},
	} {
		args := []string{"checkpoint", "--cluster", cfg, "--json"}
		for _, j := range tc.jobs {
			args = append(args, "--job", j)
		}
		_, code, err := runFtctl(t, args...)
		if code != tc.code {
			t.Errorf("checkpoint --job %v: exit %d (%v), want %d", tc.jobs, code, err, tc.code)
		}
		if tc.code != cli.ExitOK && (err == nil || !strings.Contains(err.Error(), "typo-00000001")) {
			t.Errorf("checkpoint --job %v: error %v, want the missing job named", tc.jobs, err)
		}
		for len(fc.agents["node1"].ckpts) > 0 {
			<-fc.agents["node1"].ckpts
		}
	}
}

// migrate asks every host which runs the job: one that did not answer may be the job's, and is named with
// exit 4, not dropped for "runs on none of the hosts" (exit 1), which says the job is nowhere.
func TestMigrateUnreachableHostNamed(t *testing.T) {
	fc := startFakeCluster(t, "node1", "node2")
	cfg := writeClusterConfig(t, fc.ca, 0o600, fmt.Sprintf("[[agent]]\nname = \"node1\"\naddress = %q\n", fc.addrs["node1"]))
	os.Unsetenv(clusterEnv)
	// The view still lists node2 alive: its agent went away since.
	fc.servers["node2"].Close()
	_, code, err := runFtctl(t, "migrate", "--cluster", cfg, "--job", "job-on-node2", "--to", "node1")
	if code != cli.ExitUnavailable || err == nil || !strings.Contains(err.Error(), "node2") {
		t.Errorf("migrate of a job of an unreachable host: exit %d, %v; want %d naming node2", code, err, cli.ExitUnavailable)
	}
}
