package agent

import (
	"testing"

	"github.com/ftkit/ftkit/detect"
)

// A long operation is announced by a beat at once, restores before checkpoints, until its end; operations
// that overlap keep the host busy until the last ends.
func TestSetBusy(t *testing.T) {
	a := &Agent{beatNow: make(chan struct{}, 1)}
	beat := func() bool {
		select {
		case <-a.beatNow:
			return true
		default:
			return false
		}
	}
	endCkpt := a.setBusy(detect.BusyCheckpoint)
	if queued := beat(); !queued || a.busy.current() != detect.BusyCheckpoint {
		t.Fatalf("after a checkpoint began: beat queued %v, busy %q; want a beat and %q", queued, a.busy.current(), detect.BusyCheckpoint)
	}
	endRestore := a.setBusy(detect.BusyRestore)
	endCkpt2 := a.setBusy(detect.BusyCheckpoint) // the queue holds one beat: the second begin does not block
	if !beat() || beat() {
		t.Error("two operations began: want one beat queued")
	}
	if got := a.busy.current(); got != detect.BusyRestore {
		t.Errorf("busy %q during a restore and two checkpoints, want %q", got, detect.BusyRestore)
	}
	endRestore()
	endCkpt()
	endCkpt() // ends once
	if got := a.busy.current(); got != detect.BusyCheckpoint {
		t.Errorf("busy %q with one checkpoint left, want %q", got, detect.BusyCheckpoint)
	}
	endCkpt2()
	if got := a.busy.current(); got != "" {
		t.Errorf("busy %q after every operation ended, want none", got)
	}
	if beat() {
		t.Error("an operation's end queued a beat")
	}
}
