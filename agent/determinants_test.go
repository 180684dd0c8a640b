package agent

import (
	"testing"

	"github.com/ftkit/ftkit/intercept"
)

func newTestDetState() *detState {
	return &detState{store: intercept.NewStore(0), byCgroup: map[uint64]*detStream{}, byJob: map[string]*detStream{}, wake: make(chan struct{}, 1)}
}

// TestWatchOrderJobEnds: a job that ends while a recovery watches it closes the watcher once; the watcher's
// stop afterwards must not close it again (it did: a panic).
func TestWatchOrderJobEnds(t *testing.T) {
	d := newTestDetState()
	s := &detStream{job: "j", cgroup: 7, watchers: map[chan intercept.Det]bool{}}
	d.byJob["j"], d.byCgroup[7] = s, s
	ch, stop := d.watch("j")
	if got := d.unwatch("j"); got != s {
		t.Fatalf("unwatch returned %p, want the job's stream", got)
	}
	if _, open := <-ch; open {
		t.Fatal("the watcher of an ended job is still open")
	}
	stop() // must not panic
	if len(d.byJob) != 0 || len(d.byCgroup) != 0 {
		t.Fatalf("streams left: %v %v", d.byJob, d.byCgroup)
	}
}

// TestWatchOrderNeverRegistered: a watch for a job whose restore never registered it leaves nothing behind.
func TestWatchOrderNeverRegistered(t *testing.T) {
	d := newTestDetState()
	_, stop := d.watch("j")
	if d.byJob["j"] == nil {
		t.Fatal("no placeholder stream while watching")
	}
	stop()
	stop() // twice is fine
	if len(d.byJob) != 0 {
		t.Fatalf("placeholder left: %v", d.byJob)
	}
}
