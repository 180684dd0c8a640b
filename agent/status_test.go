package agent

import (
	"slices"
	"testing"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/coordinated"
)

// TestStatusCuts: a host's status carries the newest cut recorded there of each run of the running jobs
// it shows that roll their run back, and only of those: a caller sees its own runs' cuts.
func TestStatusCuts(t *testing.T) {
	ta := newTestAgent(t)
	const snap = "20260501T120000.000Z-node1-000001"
	ta.mu.Lock()
	ta.byID[ownersJob].Spec.Run, ta.byID[ownersJob].Spec.Recovery = "r", RecoveryCoordinated
	ta.byID[rootsJob].Spec.Run, ta.byID[rootsJob].Spec.Recovery = "r", RecoveryAuto
	ta.byID[doneJob].Spec.Run, ta.byID[doneJob].Spec.Recovery = "done", RecoveryCoordinated // exited
	ta.mu.Unlock()
	records := ta.cutRecords()
	for _, c := range []coordinated.Cut{
		{Run: "r", UID: asOwner.Uid, ID: "cut-1", Parts: []clusterapi.CutPart{{Job: ownersJob, Host: "node1", Snapshot: snap}}},
		{Run: "r", UID: 0, ID: "cut-2", Parts: []clusterapi.CutPart{{Job: rootsJob, Host: "node1", Snapshot: snap}}},
		{Run: "done", UID: asOwner.Uid, ID: "cut-3", Parts: []clusterapi.CutPart{{Job: doneJob, Host: "node1", Snapshot: snap}}},
		{Run: "elsewhere", UID: asOwner.Uid, ID: "cut-4", Parts: []clusterapi.CutPart{{Job: "far-00000001", Host: "node2", Snapshot: snap}}},
	} {
		if err := records.Save(c); err != nil {
			t.Fatal(err)
		}
	}
	ids := func(uid uint32) []string {
		var out []string
		for _, c := range ta.Status(uid).Cuts {
			out = append(out, c.ID)
		}
		slices.Sort(out)
		return out
	}
	if got := ids(asOwner.Uid); !slices.Equal(got, []string{"cut-1"}) {
		t.Errorf("the owner's status: cuts %v, want its running job's run's cut-1 only", got)
	}
	if got := ids(0); !slices.Equal(got, []string{"cut-1", "cut-2"}) {
		t.Errorf("root's status: cuts %v, want cut-1 and cut-2 (the runs of running jobs here)", got)
	}
	ta.mu.Lock()
	ta.byID[ownersJob].Spec.Recovery = RecoveryLogging
	ta.mu.Unlock()
	if got := ids(asOwner.Uid); len(got) != 0 {
		t.Errorf("a run in message-logging recovery: cuts %v, want none", got)
	}
}
