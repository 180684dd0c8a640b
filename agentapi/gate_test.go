package agentapi

import (
	"testing"
	"time"
)

func TestCheckpointGate(t *testing.T) {
	g := newCheckpointGate(10 * time.Second)
	t0 := time.Unix(1000, 0)
	for i, tt := range []struct {
		uid  uint32
		at   time.Duration
		ok   bool
		wait time.Duration
	}{
		{1000, 0, true, 0},
		{1000, 3 * time.Second, false, 7 * time.Second},
		{2000, 3 * time.Second, true, 0},
		{0, 3 * time.Second, true, 0},
		{0, 3 * time.Second, true, 0},
		{1000, 9999 * time.Millisecond, false, time.Millisecond},
		{1000, 10 * time.Second, true, 0},
		{2000, 12 * time.Second, false, time.Second},
		{2000, 13 * time.Second, true, 0},
	} {
		wait, ok := g.allow(tt.uid, t0.Add(tt.at))
		if ok != tt.ok || wait != tt.wait {
			t.Errorf("step %d: uid %d at %s: (%s, %v), want (%s, %v)", i, tt.uid, tt.at, wait, ok, tt.wait, tt.ok)
		}
	}
	if len(g.last) > 2 {
		t.Errorf("the gate keeps %d uids", len(g.last))
	}
}
