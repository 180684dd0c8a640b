package criu

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestDumpResumesBeforeUnlockCloses: the CRIU `make setup` builds resumes a live-dumped task before it
// frees the nftables context that deleted the network lock's table (patches/0003). Freeing it closes a
// netlink socket, and that close waits for the kernel to destroy the table, an RCU grace period (6-14 ms on
// this project's machines), which CRIU 4.2.1 spent with the task stopped.
func TestDumpResumesBeforeUnlockCloses(t *testing.T) {
	bin := requireCRIU(t, "CRIU and a network namespace")
	child, ns := startSender(t)
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	if _, err := (Client{Binary: bin}).Dump(ctx, DumpOptions{PID: child.Process.Pid, ImagesDir: dir, LeaveRunning: true, Netns: ns}); err != nil {
		t.Fatal(err)
	}
	log, err := os.ReadFile(filepath.Join(dir, dumpLog))
	if err != nil {
		t.Fatal(err)
	}
	unfreeze := bytes.Index(log, []byte("Unfreezing tasks"))
	freed := bytes.Index(log, []byte("Freed the network unlock's nftables context"))
	if unfreeze < 0 {
		t.Fatalf("CRIU's dump log does not say it unfroze the task:\n%s", log)
	}
	if freed < unfreeze {
		level, _ := BinaryPatchLevel(bin)
		t.Fatalf("the network unlock's nftables context was not freed after the task was unfrozen (at %d, unfrozen at %d): %s (patch level %d, want %d) lacks patches/0003",
			freed, unfreeze, bin, level, PatchLevel())
	}
}
