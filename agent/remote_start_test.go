package agent

import (
	"os"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/clusterapi"
)

// TestServeStartJobRefusals: a start-job request is refused before anything is created when its sender is
// not an alive member or the request is invalid (the server validates too; the agent does not rely on it).
func TestServeStartJobRefusals(t *testing.T) {
	ta := newTestAgent(t)
	valid := clusterapi.StartJobRequest{Name: "run-node1", Argv: []string{"/bin/true"}, Dir: "/", UID: 1000, GID: 1000,
		Placement: &clusterapi.StartJobPlacement{Hosts: []string{"node1", "node2"}}}
	with := func(change func(*clusterapi.StartJobRequest)) clusterapi.StartJobRequest {
		r := valid
		change(&r)
		return r
	}
	jobsBefore := len(ta.Jobs(0))
	dirsBefore, _ := os.ReadDir(ta.cfg.JobsDir)
	tests := []struct {
		name, peer string
		req        clusterapi.StartJobRequest
		want       string
	}{
		{"not a member", "intruder", valid, "not an alive member"},
		{"relative dir", "node2", with(func(r *clusterapi.StartJobRequest) { r.Dir = "tmp" }), "absolute"},
		{"oversize argv", "node2", with(func(r *clusterapi.StartJobRequest) {
			r.Argv = []string{strings.Repeat("x", clusterapi.MaxStartJobBytes+1)}
		}), "bytes"},
		{"bad placement", "node2", with(func(r *clusterapi.StartJobRequest) {
			r.Placement = &clusterapi.StartJobPlacement{Hosts: []string{"node1"}, Spares: []string{"node1"}}
		}), "twice"},
		// The request's job address reaches the job's start: this agent has no pool.
		{"job address without a pool", "node2", with(func(r *clusterapi.StartJobRequest) { r.JobAddress = true }), "hands out no job addresses"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ta.serveStartJob(t.Context(), tt.peer, tt.req)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("%v; want a refusal about %q", err, tt.want)
			}
		})
	}
	t.Run("a failed member", func(t *testing.T) {
		ta.failMember(t, "node2")
		if _, err := ta.serveStartJob(t.Context(), "node2", valid); err == nil || !strings.Contains(err.Error(), "not an alive member") {
			t.Fatalf("start-job from a failed member: %v", err)
		}
	})
	dirsAfter, _ := os.ReadDir(ta.cfg.JobsDir)
	if n := len(ta.Jobs(0)); n != jobsBefore || len(dirsAfter) != len(dirsBefore) {
		t.Errorf("refused requests created jobs: %d -> %d jobs, %d -> %d job directories", jobsBefore, n, len(dirsBefore), len(dirsAfter))
	}
}
