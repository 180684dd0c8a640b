package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
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
