package agent

import (
	"bytes"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
)

// TestSnapshotsListingReadsOnlyTheCallersManifests: a user's listing of the host's snapshots, which any
// user may repeat at will, reads the manifests of that user's snapshots only. The old code read every
// manifest on the host (up to 16 MiB each) before it asked whose each snapshot was: another user's
// unreadable manifest was read, and warned of in root's log, at every user's listing.
func TestSnapshotsListingReadsOnlyTheCallersManifests(t *testing.T) {
	ta := newTestAgent(t)
	var logged bytes.Buffer
	ta.log = slog.New(slog.NewTextHandler(&logged, nil))
	theirs := ta.addSnapshot(t, Job{ID: theirJob, UID: asOther.Uid, GID: asOther.Gid, Node: ta.cfg.Name})
	if err := os.WriteFile(filepath.Join(ta.store.Path(theirJob, theirs), ckpt.ManifestName), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	ms, err := ta.Snapshots("", asOwner.Uid)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range ms {
		got = append(got, m.ID)
	}
	slices.Sort(got)
	want := []string{ta.ownSnap, ta.goneSnap}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("the owner's listing = %v, want its own snapshots %v", got, want)
	}
	if strings.Contains(logged.String(), theirs) {
		t.Errorf("the owner's listing read another user's manifest: %s", logged.String())
	}
	// Root's listing reads them all, and says which it could not read.
	logged.Reset()
	if _, err := ta.Snapshots("", asRoot.Uid); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logged.String(), theirs) {
		t.Errorf("root's listing did not warn of the unreadable manifest of %s: %q", theirs, logged.String())
	}
}

// TestRestoreRefusalNamesNoOtherUsersJob: a restore refused because the job's address is now another job's
// names that job only to root, or to the job's own user if it is theirs: the refusal reaches the user who
// asked for the restore (ftctl restore), and another user's job id is not theirs to learn.
func TestRestoreRefusalNamesNoOtherUsersJob(t *testing.T) {
	ta := newTestAgent(t)
	addr := netip.MustParsePrefix("10.9.0.5/24")
	ta.addJob(t, Job{ID: theirJob, UID: asOther.Uid, GID: asOther.Gid, State: JobRunning, PID: os.Getpid(),
		Net: &JobNet{Name: jobNetName("node1", theirJob), Addr: addr}})
	old := Job{ID: "old-00000001", UID: asOwner.Uid, GID: asOwner.Gid, Net: &JobNet{Name: jobNetName("node1", "old-00000001"), Addr: addr}}
	m := &ckpt.Manifest{Job: old.ID, ID: "20261206T120000.000Z-node1-000001"}
	work := filepath.Join(ta.dir, "restore", "work")
	if err := os.MkdirAll(work, 0o755); err != nil {
		t.Fatal(err)
	}
	_, err := ta.restoreJob(t.Context(), m, old, work, nil)
	if err == nil || !strings.Contains(err.Error(), "cannot be restored here") {
		t.Fatalf("restore of a job whose address another user's job holds: %v, want a refusal", err)
	}
	if strings.Contains(err.Error(), theirJob) {
		t.Errorf("the refusal names another user's job: %v", err)
	}
}

// TestSemiCoordinatedRefusalNamesNoOtherUsersListener: a user's checkpoint in semi-coordinated mode freezes
// the jobs of this host theirs talk to (localPeers), and a connection waiting in a listen queue of such a
// job, another user's, fails the snapshot. The refusal named that job's listening address to the user; it
// is told what it means for theirs, and root's log has the rest (peerErrorFor).
func TestSemiCoordinatedRefusalNamesNoOtherUsersListener(t *testing.T) {
	ta := newTestAgent(t)
	ta.cfg.Checkpoint.Mode = SemiCoordinated
	ta.cfg.Checkpoint.AcceptWait = Duration{Duration: 100 * time.Millisecond}
	// A connection between the two jobs (mine holds one end, theirs the other), and a listener of theirs with
	// a connection it has not accepted.
	pair, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mineEnd, err := net.Dial("tcp", pair.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	theirEnd, err := pair.Accept()
	if err != nil {
		t.Fatal(err)
	}
	pair.Close()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	waiting, err := net.Dial("tcp", listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	// Each job is a process of its own holding its sockets; the test's copies are closed.
	hold := func(socks ...any) int {
		var files []*os.File
		for _, s := range socks {
			f, err := s.(interface{ File() (*os.File, error) }).File()
			if err != nil {
				t.Fatal(err)
			}
			files = append(files, f)
		}
		cmd := exec.Command("sleep", "600")
		cmd.ExtraFiles = files
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		for _, f := range files {
			f.Close()
		}
		for _, s := range socks {
			s.(io.Closer).Close()
		}
		return cmd.Process.Pid
	}
	minePID := hold(mineEnd)
	theirPID := hold(theirEnd, listener, waiting)
	ta.mu.Lock()
	delete(ta.byID, ownersJob) // the fixture's jobs are the test's process
	delete(ta.byID, rootsJob)
	ta.mu.Unlock()
	const mine = "mine-00000002"
	for _, j := range []Job{
		{ID: mine, UID: asOwner.Uid, GID: asOwner.Gid, State: JobRunning, PID: minePID},
		{ID: theirJob, UID: asOther.Uid, GID: asOther.Gid, State: JobRunning, PID: theirPID},
	} {
		jj := ta.addJob(t, j)
		// A cgroup as the kernel shows it frozen.
		if err := os.WriteFile(filepath.Join(jj.Cgroup, "cgroup.freeze"), []byte("0"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(jj.Cgroup, "cgroup.events"), []byte("populated 1\nfrozen 1\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	port := strconv.Itoa(listener.Addr().(*net.TCPAddr).Port)
	_, err = ta.Checkpoint(t.Context(), []string{mine}, asOwner.Uid)
	if err == nil {
		t.Fatal("checkpoint with a peer's connection waiting in its listen queue succeeded")
	}
	if strings.Contains(err.Error(), ":"+port) {
		t.Errorf("the user's refusal names another user's listener (port %s): %v", port, err)
	}
	// Root is told the whole of it.
	_, err = ta.Checkpoint(t.Context(), []string{mine}, asRoot.Uid)
	if err == nil || !strings.Contains(err.Error(), ":"+port) {
		t.Errorf("root's refusal = %v, want it to name the listener (port %s)", err, port)
	}
}

// TestEventsReadNoManifest: a user's listing of the failure timelines, which any user may repeat at will,
// asks whose each job held here as snapshots is from the snapshot's bounded job record. The old code read
// the newest manifest (up to 16 MiB) of every job of the failure log not running here, other users' too,
// at every user's request: here a manifest that blocks whoever opens it held the user's answer.
func TestEventsReadNoManifest(t *testing.T) {
	ta := newTestAgent(t)
	theirs := ta.addSnapshot(t, Job{ID: theirJob, UID: asOther.Uid, GID: asOther.Gid, Node: "node2"})
	manifest := filepath.Join(ta.store.Path(theirJob, theirs), ckpt.ManifestName)
	if err := os.Remove(manifest); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(manifest, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Lets a reader blocked in its open go (the old code's).
		if f, err := os.OpenFile(manifest, os.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
			f.Close()
		}
	})
	ta.failures.Update("node2-1", func(f *Failure) {
		f.ID, f.Node, f.Protector, f.Jobs = "node2-1", "node2", "node1", []string{theirJob, goneJob}
	})
	done := make(chan []*Failure, 1)
	go func() { done <- ta.Events(asOwner.Uid) }()
	select {
	case fs := <-done:
		if len(fs) != 1 || !slices.Equal(fs[0].Jobs, []string{goneJob}) {
			t.Errorf("the owner sees %v, want the failure with its job %s alone", fs, goneJob)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the owner's listing of the failures opened another user's manifest, and waits on it")
	}
}

// TestMarksAreRootsOnly: the marks that tell a job's shim its copy was superseded, or why the agent killed
// it, lie beside the job records: in jobs_dir in the default layout, which users may write to (sticky). A
// mark another user planted there for a job (its id is in the directory's listing) is not written into: it
// is replaced by one of root's, which the shim alone believes. The old code wrote into the planted file,
// which its owner may change or remove at will.
func TestMarksAreRootsOnly(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to give a file to another user")
	}
	ta := newTestAgent(t)
	j := Job{ID: ownersJob, UID: asOwner.Uid, GID: asOwner.Gid, Incarnation: 2}
	for _, tt := range []struct {
		name  string
		path  string
		write func() error
	}{
		{"superseded", ta.supersededMark(j.ID, j.Incarnation), func() error { ta.supersede(j); return nil }},
		{"refused", ta.refusalMark(j.ID, j.Incarnation), func() error { return writeMark(ta.refusalMark(j.ID, j.Incarnation), "killed by ftkit") }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if err := os.WriteFile(tt.path, []byte("planted"), 0o666); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(tt.path, int(asOther.Uid), int(asOther.Gid)); err != nil {
				t.Fatal(err)
			}
			if err := tt.write(); err != nil {
				t.Fatal(err)
			}
			fi, err := os.Lstat(tt.path)
			if err != nil {
				t.Fatal(err)
			}
			if st := fi.Sys().(*syscall.Stat_t); st.Uid != 0 || !fi.Mode().IsRegular() || fi.Mode().Perm() != 0o600 {
				t.Errorf("the %s mark is uid %d's, mode %v: want a file of root's, 0600, in place of the one uid %d planted", tt.name, st.Uid, fi.Mode(), asOther.Uid)
			}
			// A mark of root's already there (the copy superseded twice) stays.
			if err := tt.write(); err != nil {
				t.Fatal(err)
			}
			if fi2, err := os.Lstat(tt.path); err != nil || !os.SameFile(fi, fi2) {
				t.Errorf("root's %s mark was replaced (%v)", tt.name, err)
			}
		})
	}
}
