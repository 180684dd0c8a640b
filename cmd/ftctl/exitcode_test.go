package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/internal/cli"
)

// bouncedBackend's migrations fail on the target: the job is restored on its own host again.
type bouncedBackend struct{ testBackend }

func (b *bouncedBackend) Migrate(_ context.Context, req agent.MigrateRequest, _ uint32) (*agent.Migration, error) {
	return &agent.Migration{Job: req.Job, From: "node1", To: "node1", Snapshot: "snap-1", Error: "restore on " + req.To + " failed"}, nil
}

// A migration whose target failed (the job came back to its host) is a failure, with --json too: a
// maintenance script that drains hosts with `ftctl migrate --json` must not take it for a move.
func TestMigrateJSONFailedExitsNonZero(t *testing.T) {
	j := agent.Job{ID: "sleeper-00000001", Node: "node1", State: agent.JobRunning}
	b := &bouncedBackend{testBackend{job: j}}
	sock := filepath.Join(t.TempDir(), "agent.sock")
	srv, err := agentapi.Listen(t.Context(), sock, b, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	for _, args := range [][]string{
		{"migrate", "--socket", sock, "--job", j.ID, "--to", "node2"},
		{"migrate", "--socket", sock, "--job", j.ID, "--to", "node2", "--json"},
	} {
		out, code, err := runFtctl(t, args...)
		if code == cli.ExitOK {
			t.Errorf("%v: exit 0 (%v) for a migration that failed on its target:\n%s", args, err, out)
		}
	}
}

// jobs, like status, snapshots and events, must fail (exit 4, naming the host) when an agent it asked did
// not answer: the other hosts' jobs are still listed, but the missing host's are not "none".
func TestJobsUnreachableAgentExitsNonZero(t *testing.T) {
	fc := startFakeCluster(t, "node1", "node2")
	ca, addrs, servers := fc.ca, fc.addrs, fc.servers
	cfg := writeClusterConfig(t, ca, 0o600, fmt.Sprintf("[[agent]]\nname = \"node1\"\naddress = %q\n", addrs["node1"]))
	os.Unsetenv(clusterEnv)
	servers["node2"].Close()
	for _, args := range [][]string{{"jobs", "--cluster", cfg, "--json"}, {"jobs", "--cluster", cfg}} {
		out, code, err := runFtctl(t, args...)
		if code != cli.ExitUnavailable || err == nil || !strings.Contains(err.Error(), "node2") || !strings.Contains(out, "job-on-node1") {
			t.Errorf("%v with node2 down: exit %d, %v\n%s; want 4 naming node2, node1's jobs shown", args, code, err, out)
		}
	}
}
