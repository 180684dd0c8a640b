package agent

import (
	"testing"

	"github.com/ftkit/ftkit/detect"
)

// beatSink answers pings and takes heartbeats: a protector whose host acknowledges this node's beats.
type beatSink struct{ *pingScript }

func (beatSink) Beat(string, detect.Beat) {}

// TestSelfFenceFirstOfCutSegment: a partition that cuts off n1 with its protector n2 leaves n1 hearing n2
// (its host acknowledges n1's beats) but not its predecessor n3. n2, the last node of the segment, fences on
// its protector's silence; the far side replaces it, and n1's new protector there declares n1 (n3, its other
// neighbour, does not reach it either) and restores its jobs. So n1 fences too when its predecessor has been
// silent for fence_timeout and it reaches a minority of the other members, and keeps its jobs when it
// reaches a majority (its predecessor failed). Before, it heard its protector and never fenced: its jobs ran
// on beside their copies.
//
// The ring is n1 (this node) -> n2 (its protector) -> n3 (its predecessor) -> n1, with spares s1 and s2.
func TestSelfFenceFirstOfCutSegment(t *testing.T) {
	pki := newTestPKI(t)
	tests := []struct {
		name   string
		answer []string // the members that answer pings besides n2; the others' ports refuse
		fence  bool
	}{
		{"cut off with its protector", nil, true},
		{"the predecessor alone failed", []string{"s1", "s2"}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ports := map[string]uint16{"n2": scriptedPeer(t, pki, "n2", beatSink{&pingScript{name: "n2"}})}
			for _, m := range tt.answer {
				ports[m] = scriptedPeer(t, pki, m, &pingScript{name: m})
			}
			a, logs, kill := fencingAgent(t, pki, ports)
			// n2 acknowledges n1's beats all along; n3 never beats.
			ctx := runSelfFence(t, a)
			go a.sendBeats(ctx)

			requireFenceDecision(t, a, logs, kill, tt.fence, "no contact with its predecessor n3", "no answer from 3 of the 4 other members")
		})
	}
}
