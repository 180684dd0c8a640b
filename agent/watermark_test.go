package agent

import (
	"testing"
	"time"
)

// TestWatermarkOfJobRestoredFromClockAhead: a job restored here from the snapshot of a host whose clock is
// far ahead carries that host's creation time, later than this host's present. Its log watermark counted
// from it, which read as now: senders freed the finished connections' bytes a second restore from the same
// snapshot needs (this host failing before the job's first snapshot here is replicated). It counts from no
// later than the restore here.
func TestWatermarkOfJobRestoredFromClockAhead(t *testing.T) {
	ta := newTestAgent(t)
	restoredAt := time.Now().Add(-time.Hour).UTC()
	j := ta.addJob(t, Job{ID: "restored", UID: asOwner.Uid, GID: asOwner.Gid, State: JobRunning, PID: ta.byID[ownersJob].PID})
	ta.mu.Lock()
	j.Created = time.Now().Add(24 * time.Hour).UTC() // the original host's clock, a day ahead
	j.Restored, j.RestoredAt = "snap-from-node2", restoredAt
	ta.mu.Unlock()
	w, err := ta.logWatermark()
	if err != nil {
		t.Fatal(err)
	}
	if !w.Held || w.Age < time.Hour {
		t.Fatalf("watermark held %v, %v old; want held, at least the hour since the restore here", w.Held, w.Age)
	}
}
