package agent

import (
	"encoding/json"
	"slices"
	"sort"
	"testing"

	"github.com/ftkit/ftkit/clusterapi"
)

// TestOperatorService: an operator sees and acts on the host as root does (every job, every snapshot), and
// an unknown job or snapshot is refused as not found, before any work.
func TestOperatorService(t *testing.T) {
	ta := newTestAgent(t)
	s := operatorService{ta.Agent}
	ctx := t.Context()

	st, err := s.Status(ctx, "alice")
	if err != nil {
		t.Fatal(err)
	}
	var status Status
	if err := json.Unmarshal(st.Status, &status); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, j := range status.Jobs {
		ids = append(ids, j.ID)
	}
	sort.Strings(ids)
	if status.Node != "node1" || !slices.Equal(ids, []string{doneJob, ownersJob, rootsJob}) {
		t.Errorf("status of %s with jobs %v; want node1 with every job", status.Node, ids)
	}

	sn, err := s.Snapshots(ctx, "alice", clusterapi.OperatorSnapshotsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var jobs []string
	for _, m := range sn.Snapshots {
		jobs = append(jobs, m.Job)
	}
	sort.Strings(jobs)
	if !slices.Equal(jobs, []string{goneJob, ownersJob, rootsJob}) {
		t.Errorf("snapshots of %v, want every job's", jobs)
	}

	if _, err := s.Events(ctx, "alice"); err != nil {
		t.Errorf("events: %v", err)
	}

	for name, call := range map[string]func() error{
		"checkpoint of an unknown job": func() error {
			_, err := s.Checkpoint(ctx, "alice", clusterapi.OperatorCheckpointRequest{Jobs: []string{"nope-00000001"}})
			return err
		},
		"restore of an unknown snapshot": func() error {
			_, err := s.Restore(ctx, "alice", clusterapi.OperatorRestoreRequest{Snapshot: "20260301T120304.000Z-node2-000007"})
			return err
		},
	} {
		err := call()
		if e := clusterapi.Refusal(err); e == nil || e.Code != clusterapi.CodeNotFound {
			t.Errorf("%s: %v, want a %s refusal", name, err, clusterapi.CodeNotFound)
		}
	}
}
