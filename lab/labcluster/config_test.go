package labcluster_test

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/lab/slurm"
)

// TestConfigStartJobCommand: the agents of a lab with Slurm admit the starts members forward through the
// script ftkit ships for Slurm sites (its lab wrapper, lab/slurm), with the arguments docs/deploy.md gives
// a site, so that the Slurm end-to-end test (TestMPISlurmFailover) runs it; a lab without Slurm sets none.
// The configuration is valid either way.
func TestConfigStartJobCommand(t *testing.T) {
	st := lab.State{Plan: lab.Plan{ID: "t1", Subnet: netip.MustParsePrefix("10.9.0.0/24"), Hosts: []lab.Host{
		{Name: "node1", Role: lab.RoleNode, Addr: netip.MustParsePrefix("10.9.0.11/24")},
		{Name: "node2", Role: lab.RoleNode, Addr: netip.MustParsePrefix("10.9.0.12/24")},
		{Name: "spare1", Role: lab.RoleSpare, Addr: netip.MustParsePrefix("10.9.0.101/24")},
	}}}
	for _, tc := range []struct {
		name  string
		slurm *lab.SlurmState
		want  []string
	}{
		{"without Slurm", nil, nil},
		{"with Slurm", &lab.SlurmState{Dir: "/run/ftkit/labs/t1.slurm"},
			[]string{"/run/ftkit/labs/t1.slurm/start-job-command", "{uid}", "{gid}", "{host}", "{peer}", "{slurm_job_id}"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st.Slurm = tc.slurm
			for _, h := range st.Hosts {
				cfg := labcluster.ConfigOf(st, h, labcluster.Options{})
				if !slices.Equal(cfg.Cluster.StartJobCommand, tc.want) {
					t.Errorf("%s: start_job_command %q, want %q", h.Name, cfg.Cluster.StartJobCommand, tc.want)
				}
				if tc.slurm != nil && cfg.Cluster.StartJobCommand[0] != slurm.StartJobCommandPath(tc.slurm.Dir) {
					t.Errorf("%s: start_job_command %s is not the lab's wrapper", h.Name, cfg.Cluster.StartJobCommand[0])
				}
				if err := cfg.Validate(); err != nil {
					t.Errorf("%s: %v", h.Name, err)
				}
			}
		})
	}
}
