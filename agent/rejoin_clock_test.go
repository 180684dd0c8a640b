package agent

import (
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
)

// TestServeRejoinAgesRecoveryOnOwnClock: a failed member is not admitted back while the recovery of its jobs
// that another protector coordinates is under way, whatever that protector's clock says. Its timeline's
// Detected is the protector's wall clock: a protector 2*recoverLimit behind had the member admitted as an
// alive spare mid-recovery, and its target then refused the recovery request (node2 not failed in its view).
func TestServeRejoinAgesRecoveryOnOwnClock(t *testing.T) {
	_, failed, _ := rejoinViews(t)
	ta := newTestAgent(t)
	ta.members.view = failed
	lagging := time.Now().Add(-2 * recoverLimit) // node3's wall clock: it declared node2 a moment ago
	f := &Failure{ID: "node2-1", Node: "node2", Protector: "node3", Target: "s1", Detected: lagging, Updated: lagging.Add(time.Second),
		Jobs: []string{"j1"}, Stages: []Stage{{Name: StageDetected, Host: "node3", Start: lagging.Add(-time.Second), End: lagging}}}
	if !ta.failures.Merge("node3", f) {
		t.Fatal("node3's own timeline was not merged")
	}
	_, err := ta.serveRejoin(t.Context(), "node2", clusterapi.RejoinRequest{Incarnation: 0})
	if e := clusterapi.Refusal(err); e == nil || !strings.Contains(e.Message, "is not over") {
		t.Fatalf("err %v, want a refusal: the recovery of node2's jobs (failure node2-1) is under way", err)
	}
	if m, _ := ta.View().Member("node2"); m.Incarnation != 0 {
		t.Errorf("node2 rejoined as incarnation %d mid-recovery", m.Incarnation)
	}
}
