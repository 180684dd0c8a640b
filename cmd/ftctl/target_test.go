package main

import (
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/internal/cli"
)

// drainBackend records the drains it is asked for.
type drainBackend struct {
	testBackend
	drained chan struct{}
}

func (b *drainBackend) Drain(context.Context, agent.DrainRequest, uint32) (*agent.DrainResult, error) {
	b.drained <- struct{}{}
	return &agent.DrainResult{Node: "node1"}, nil
}

// --socket names one agent, which acts on its own host: a --host (drain, restore, checkpoint name their
// host with it) or --lab beside it was dropped, and `ftctl drain --socket S --host node2` drained S's host.
func TestSocketWithHostRefused(t *testing.T) {
	b := &drainBackend{testBackend: testBackend{job: agent.Job{ID: "sleeper-00000001", Node: "node1", State: agent.JobRunning}}, drained: make(chan struct{}, 10)}
	sock := filepath.Join(t.TempDir(), "agent.sock")
	srv, err := agentapi.Listen(t.Context(), sock, b, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"drain", "--socket", sock, "--host", "node2"}, "--host"},
		{[]string{"drain", "--socket", sock, "--node", "node2"}, "--host"},
		{[]string{"checkpoint", "--socket", sock, "--host", "node2"}, "--host"},
		{[]string{"status", "--socket", sock, "--host", "node2"}, "--host"},
		{[]string{"drain", "--socket", sock, "--lab", "lab2"}, "--lab"},
	} {
		_, code, err := runFtctl(t, tc.args...)
		if code != cli.ExitUsage || err == nil || !strings.Contains(err.Error(), tc.flag) {
			t.Errorf("%v: exit %d, %v; want %d naming %s", tc.args, code, err, cli.ExitUsage, tc.flag)
		}
	}
	if len(b.drained) != 0 {
		t.Errorf("the socket's agent was drained %d time(s) for --host node2", len(b.drained))
	}
	// Alone, --socket still reaches its agent.
	if _, code, err := runFtctl(t, "drain", "--socket", sock); code != cli.ExitOK || len(b.drained) != 1 {
		t.Errorf("drain --socket: exit %d, %v, %d drain(s); want one", code, err, len(b.drained))
	}
}

// checkpoint --uid picks whose run --run names: without --run it was dropped, and every job was
// snapshotted (not only that user's).
func TestCheckpointUIDWithoutRun(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "agent.sock")
	_, code, err := runFtctl(t, "checkpoint", "--socket", sock, "--uid", "1000")
	if code != cli.ExitUsage || err == nil || !strings.Contains(err.Error(), "--run") {
		t.Errorf("checkpoint --uid without --run: exit %d, %v; want %d naming --run", code, err, cli.ExitUsage)
	}
}
