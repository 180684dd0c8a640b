package agent

import (
	"errors"
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
