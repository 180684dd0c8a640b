package agent

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agentconfig"
	"github.com/ftkit/ftkit/criu"
)

// TestSnapshotDumpTimeout: a snapshot whose CRIU hangs ends at checkpoint.dump_timeout, with an error naming
// it; its CRIU is gone by then (killed before the job is thawed and the snapshot's directory removed) and the
// store holds no new snapshot. The old code gave the dump no deadline: the snapshot, and the host's snapshot
// lock with it, waited for CRIU for good.
func TestSnapshotDumpTimeout(t *testing.T) {
	ta := newTestAgent(t)
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "pid")
	// A CRIU that starts and never answers (a freeze or a file system that hangs).
	script := filepath.Join(dir, "criu")
	if err := os.WriteFile(script, []byte("#!/bin/sh\necho $$ > "+pidFile+".new && mv "+pidFile+".new "+pidFile+"\nexec sleep 3600\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	ta.criu = criu.Client{Binary: script}
	ta.cfg.Checkpoint.DumpTimeout = agentconfig.Duration{Duration: 200 * time.Millisecond}
	j, _, err := ta.Job(ownersJob, 0)
	if err != nil {
		t.Fatal(err)
	}
	before, err := ta.store.List(ownersJob, ta.cfg.Name)
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := ta.snapshot(t.Context(), j, false, false)
		errc <- err
	}()
	select {
	case err = <-errc:
	case <-time.After(30 * time.Second):
		t.Fatal("a snapshot whose CRIU hangs did not end at checkpoint.dump_timeout (200ms)")
	}
	if err == nil || !strings.Contains(err.Error(), "checkpoint.dump_timeout") {
		t.Fatalf("snapshot with a CRIU that hangs = %v, want an error naming checkpoint.dump_timeout", err)
	}
	b, rerr := os.ReadFile(pidFile)
	if rerr != nil {
		t.Fatalf("the fake CRIU never ran: %v", rerr)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	if kerr := syscall.Kill(pid, 0); !errors.Is(kerr, syscall.ESRCH) {
		t.Fatalf("the snapshot failed with its CRIU (pid %d) still running (kill 0: %v)", pid, kerr)
	}
	after, err := ta.store.List(ownersJob, ta.cfg.Name)
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(before) {
		t.Errorf("snapshots of the job after a dump that timed out: %v, want %v", after, before)
	}
}
