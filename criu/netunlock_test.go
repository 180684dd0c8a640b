package criu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	gocriu "github.com/checkpoint-restore/go-criu/v7"
	"github.com/google/nftables"

	"github.com/ftkit/ftkit/internal/cgroupv2"
	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/internal/procstate"
)

// TestDumpResumesBeforeUnlockCloses: the CRIU `make setup` builds resumes a live-dumped task before it
// frees the nftables context that deleted the network lock's table (patches/0003). Freeing it closes a
// netlink socket, and that close waits for the kernel to destroy the table, an RCU grace period (6-14 ms on
// this project's machines), which CRIU 4.2.1 spent with the task stopped.
func TestDumpResumesBeforeUnlockCloses(t *testing.T) {
	bin := requireCRIU(t, "CRIU and a network namespace")
	child, ns, _ := startSender(t)
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

// TestKilledDumpReleasesConnections: a dump killed after CRIU locked the job's connections and put their
// sockets in repair mode (here at its post-dump notification, just before it would undo both) undoes both
// itself: the lock's table is gone from the job's namespace, and the job's connection carries data again.
// The old code left the table and the socket in repair mode, where it transmits nothing: the job, thawed,
// hung on its connection for good.
func TestKilledDumpReleasesConnections(t *testing.T) {
	bin := requireCRIU(t, "CRIU and a network namespace")
	// Frozen by its cgroup, as the agent's jobs are: the dump ends with the job still frozen, and the job
	// runs again only when thawed, after the dump returned (else it could meet its socket in repair mode
	// between CRIU's death and the dump's return, and exit on EINVAL).
	root, err := cgroupv2.Dir("/")
	if err != nil {
		t.Skipf("SKIPPED LOUDLY: no cgroup v2 hierarchy to freeze the job in: %v", err)
	}
	cg := filepath.Join(root, fmt.Sprintf("ftkit-criu-killed-dump-%d", os.Getpid()))
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(cg) }) // after the child's kill, a cleanup of startSender's
	child, ns, rcv := startSender(t)
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(child.Process.Pid)), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	nfy := &killAtPostDump{cancel: cancel, criu: bin}
	_, err = (Client{Binary: bin}).dump(ctx, DumpOptions{PID: child.Process.Pid, ImagesDir: t.TempDir(), LeaveRunning: true, Netns: ns, FreezeCgroup: cg}, nfy)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("dump killed at its post-dump notification: %v (notification: %v), want context.Canceled", err, nfy.err)
	}
	if err := os.WriteFile(filepath.Join(cg, "cgroup.freeze"), []byte("0"), 0o644); err != nil { // the agent's thaw
		t.Fatal(err)
	}
	if err := netnsthread.In(ns, func() error {
		c, err := nftables.New()
		if err != nil {
			return err
		}
		tables, err := c.ListTables()
		for _, tb := range tables {
			if strings.HasPrefix(tb.Name, "CRIU-") {
				t.Errorf("the killed dump left CRIU's network lock, table %s", tb.Name)
			}
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// The sender writes without end: 8 MiB more arrive unless its socket transmits nothing.
	if err := rcv.SetReadDeadline(time.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	if n, err := io.CopyN(io.Discard, rcv, 8<<20); err != nil {
		t.Fatalf("the job's connection after the killed dump: %d bytes arrived in a minute (%v): its socket was left in repair mode", n, err)
	}
}

// killAtPostDump ends the dump's context at CRIU's post-dump notification and answers it only once CRIU is
// killed (a zombie child of this process, reaped when the dump returns): the dump ends there, its job's
// connections locked and in repair mode.
type killAtPostDump struct {
	gocriu.NoNotify
	cancel func()
	criu   string
	err    error
}

func (k *killAtPostDump) PostDump() error {
	// CRIU runs now (its exe is readable until it dies): this process's child whose exe is k.criu.
	kids, err := procstate.Tree(os.Getpid())
	if err != nil {
		k.err = err
		return err
	}
	criu := 0
	for _, pid := range kids[1:] {
		if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); exe == k.criu {
			criu = pid
		}
	}
	if criu == 0 {
		k.err = fmt.Errorf("no child of this process runs %s", k.criu)
		return k.err
	}
	k.cancel()
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if st, _ := procstate.Of(criu); st == "Z" {
			return nil
		}
	}
	k.err = errors.New("CRIU was not killed within a minute of the dump's cancel")
	return k.err
}
