package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/shim"
)

// TestAgainIfMountGone: a restore CRIU failed on a mount point gone from the host is launched once more
// (ci231: TestRestoredPtyIndexIsFree, when a parallel test removed its mount during the restore); any other
// outcome is final.
func TestAgainIfMountGone(t *testing.T) {
	gone := errors.New("criu restore: (00.126673) 1: Error (criu/mount-v2.c:634): mnt-v2: Can't stat mountpoint /tmp/.criu.mntns.x/mnt-1/run/gone: No such file or directory")
	other := errors.New("criu restore: Restoring FAILED.")
	for _, tc := range []struct {
		name    string
		results []error
		calls   int
		want    error
	}{
		{"restored", []error{nil}, 1, nil},
		{"a mount went, then restored", []error{gone, nil}, 2, nil},
		{"a mount went twice", []error{gone, gone}, 2, gone},
		{"another failure", []error{other}, 1, other},
	} {
		calls, retried := 0, 0
		err := againIfMountGone(func() error { calls++; return tc.results[calls-1] }, func(error) { retried++ })
		if err != tc.want || calls != tc.calls || retried != tc.calls-1 {
			t.Errorf("%s: err %v after %d launches (%d retries), want %v after %d", tc.name, err, calls, retried, tc.want, tc.calls)
		}
	}
}

// A snapshot's job record may come from a peer (a protector's replica): a user's listing of its
// snapshots must not have root read one of any size, as a restore's read of it does not
// (snapshotRecord, maxJobRecord).
func TestOwnsSnapshotBoundsRecord(t *testing.T) {
	ta := newTestAgent(t)
	m, err := ta.store.Manifest(goneJob, ta.goneSnap)
	if err != nil {
		t.Fatal(err)
	}
	if !ta.ownsSnapshot(m, asOwner.Uid) {
		t.Fatal("the owner does not own its job's snapshot")
	}
	// The record padded past the bound: valid JSON, the owner's uid.
	p := filepath.Join(ta.store.Path(m.Job, m.ID), snapJob)
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	var j Job
	if err := json.Unmarshal(b, &j); err != nil {
		t.Fatal(err)
	}
	big := append(b, bytes.Repeat([]byte(" "), maxJobRecord)...)
	if err := os.WriteFile(p, big, 0o600); err != nil {
		t.Fatal(err)
	}
	if ta.ownsSnapshot(m, asOwner.Uid) {
		t.Errorf("a job record of %d bytes, more than the %d a snapshot's may hold, was read whole", len(big), maxJobRecord)
	}
}

// TestRestoreShimRunsAsTheJobsUser: the restore's shim is told the job's user, which it names to CRIU
// (criu.RestoreUIDEnv): CRIU then binds the job's unix sockets and opens its files as that user, and the
// shim checks those paths and what the restored processes hold (heldfiles) against the user. The shim was
// given no uid: it read 0, and CRIU opened and bound every path the images name as root, every check skipped.
func TestRestoreShimRunsAsTheJobsUser(t *testing.T) {
	ta := newTestAgent(t)
	spec := fakeRestoreShim(t, ta)
	const id = "restored-00000001"
	j := Job{ID: id, UID: asOwner.Uid, GID: asOwner.Gid, Dir: ta.layout().dir(id)}
	if err := restoreWithFakeShim(t, ta, j); err == nil || !strings.Contains(err.Error(), "fake shim") {
		t.Fatalf("restore: %v, want the fake shim's refusal", err)
	}
	b, err := os.ReadFile(spec)
	if err != nil {
		t.Fatalf("the shim did not run: %v", err)
	}
	var got shim.Spec
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if got.Mode != shim.ModeRestore || got.UID != asOwner.Uid || got.GID != asOwner.Gid {
		t.Errorf("restore shim of a job of uid %d gid %d: mode %q, uid %d, gid %d", asOwner.Uid, asOwner.Gid, got.Mode, got.UID, got.GID)
	}
}

// TestRestoreRefusesBesideARunningCopy: a restore of a job that runs on this host already (a recovery
// request repeated or resumed, a migration resumed) is refused before anything runs: nothing checked that
// below the recovery's incarnation claim, which the same failure's repeated request wins again.
func TestRestoreRefusesBesideARunningCopy(t *testing.T) {
	ta := newTestAgent(t)
	spec := fakeRestoreShim(t, ta)
	const id = "running-00000001"
	ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid()})
	err := restoreWithFakeShim(t, ta, Job{ID: id, Dir: ta.layout().dir(id)})
	if err == nil || !strings.Contains(err.Error(), "already runs on") {
		t.Fatalf("restore beside the running copy: %v, want a refusal", err)
	}
	if _, err := os.Stat(spec); err == nil {
		t.Error("the restore's shim ran")
	}
	if j, _, err := ta.Job(id, 0); err != nil || j.State != JobRunning || j.PID != os.Getpid() {
		t.Errorf("the running copy's record after the refusal: %+v, %v", j, err)
	}
}

// fakeRestoreShim makes ta's shim one that keeps the spec it was given (in the returned file) and fails, as
// a restore CRIU refused: nothing runs.
func fakeRestoreShim(t *testing.T, ta *testAgent) (spec string) {
	t.Helper()
	spec = filepath.Join(ta.dir, "shim-spec.json")
	fake := filepath.Join(ta.dir, "fake-shim")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\ncat >"+spec+"\necho '{\"error\": \"fake shim: not restored\"}'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	ta.SetShim(fake)
	return spec
}

// restoreWithFakeShim restores j from a snapshot of no images in a work directory of its own.
func restoreWithFakeShim(t *testing.T, ta *testAgent, j Job) error {
	t.Helper()
	m := &ckpt.Manifest{Job: j.ID, ID: "20261206T120000.000Z-node2-000001"}
	work := filepath.Join(ta.dir, "restore", j.ID)
	if err := os.MkdirAll(work, 0o700); err != nil {
		t.Fatal(err)
	}
	_, err := ta.restoreJob(t.Context(), m, j, work, nil)
	return err
}

// TestFailedRestoreKillsWhatItLeft: a restore whose shim failed (killed at the restore's deadline, its CRIU
// with it) may leave part of the job's tree in the job's cgroup, stopped where CRIU left it; the agent kills
// the cgroup before giving it back. The old code only removed the cgroup's directory, which fails while
// processes are in it, and left them there.
func TestFailedRestoreKillsWhatItLeft(t *testing.T) {
	ta := newTestAgent(t)
	const id = "cutshort-00000001"
	cg := ta.layout().cgroup(id)
	// The fake shim plays the kernel's cgroup files too: CRIU had made part of the tree in the cgroup.
	fake := filepath.Join(ta.dir, "fake-shim")
	script := "#!/bin/sh\ncat >/dev/null\n: >" + cg + "/cgroup.kill\necho 'populated 0' >" + cg + "/cgroup.events\n" +
		"echo '{\"error\": \"fake shim: restore cut short\"}'\n"
	if err := os.WriteFile(fake, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	ta.SetShim(fake)
	if err := restoreWithFakeShim(t, ta, Job{ID: id, Dir: ta.layout().dir(id)}); err == nil || !strings.Contains(err.Error(), "restore cut short") {
		t.Fatalf("restore whose shim failed: %v, want its error", err)
	}
	if b, err := os.ReadFile(filepath.Join(cg, "cgroup.kill")); err != nil || string(b) != "1" {
		t.Errorf("the job's cgroup.kill after the failed restore: %q, %v; want \"1\" (what the restore left killed)", b, err)
	}
}

// TestRestoreKeepsTheHoldersStillToTell: a job moved from node1 to node2 and back. node2 holds the snapshot
// node1 moved it with, node3 node1's replicas, node4 some node1 still had to tell. The copy restored on node1
// replaced the ended copy's record, which forgetJob then never forgot, and with it the only record of those
// holders: once the job ended on node1 for good, they were not told, and kept node1's snapshots for good.
func TestRestoreKeepsTheHoldersStillToTell(t *testing.T) {
	ta := newTestAgent(t)
	fake := filepath.Join(ta.dir, "fake-shim")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\ncat >/dev/null\necho '{\"pid\": "+strconv.Itoa(os.Getpid())+"}'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	ta.SetShim(fake)
	const id = "back-0000000d"
	ta.addJob(t, Job{ID: id, State: JobMoved, MovedTo: "node2", Forget: []string{"node4"},
		Replica: &Replica{Node: "node1", Holders: []string{"node3"}}})
	// The record the snapshot carries is node2's: its holders are node2's to tell.
	j := Job{ID: id, Dir: ta.layout().dir(id), Forget: []string{"node5"}, Replica: &Replica{Node: "node2", Holders: []string{"node6"}}}
	m := &ckpt.Manifest{Job: id, ID: "20261206T120000.000Z-node2-000001"}
	work := filepath.Join(ta.dir, "restore", id)
	if err := os.MkdirAll(work, 0o700); err != nil {
		t.Fatal(err)
	}
	restored, err := ta.restoreJob(t.Context(), m, j, work, nil)
	if err != nil {
		t.Fatalf("restore: %v", err)
	}
	if want := []string{"node2", "node3", "node4"}; !slices.Equal(slices.Sorted(slices.Values(restored.Forget)), want) {
		t.Errorf("the restored copy's holders to tell at its end: %v, want %v", restored.Forget, want)
	}
}

// TestWorkCopyLeavesNothingWhenItFails: a working copy of a snapshot's images that fails part way (a file it
// can neither link nor copy) was left in the state directory's restore/ for good: no restore removes a copy
// it was never given, settleOutputJournals looks only at those with an output journal, and the images
// already linked kept their bytes on disk after the snapshot itself was deleted.
func TestWorkCopyLeavesNothingWhenItFails(t *testing.T) {
	ta := newTestAgent(t)
	const id = "partial-0000000b"
	snap := ta.addSnapshot(t, Job{ID: id, Node: ta.cfg.Name})
	m, err := ta.store.Manifest(id, snap)
	if err != nil {
		t.Fatal(err)
	}
	// After core-1.img in the walk's order: that one is linked first.
	if err := os.Symlink("core-1.img", filepath.Join(ta.store.Path(id, snap), snapImages, "z-not-regular")); err != nil {
		t.Fatal(err)
	}
	if work, err := ta.workCopy(m); err == nil {
		t.Fatalf("working copy of images with a symbolic link among them: %s, want an error", work)
	}
	if ents, err := os.ReadDir(filepath.Join(ta.cfg.StateDir, "restore")); err == nil && len(ents) > 0 {
		t.Errorf("restore/ after a failed working copy: %s; want nothing left", ents[0].Name())
	}
}
