package agent

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/spare"
)

// TestServeClaimForRun: a node of the ring is a run's spare only while idle and named among the run's
// spares; a ring spare accepts as before, whatever the run names.
func TestServeClaimForRun(t *testing.T) {
	forRun := func(spares ...string) spare.Claim {
		return spare.Claim{Failure: "n3-1", Failed: "n3", Need: spare.Need{Jobs: 1, MemoryBytes: 1 << 10}, Spares: spares}
	}
	tests := []struct {
		name    string
		self    string
		by      string
		running bool   // self runs a job
		busy    string // self's long operation
		claim   spare.Claim
		wantErr string // "" for accepted
	}{
		{"an idle node named by the run accepts", "n1", "n2", false, "", forRun("n1"), ""},
		{"named among several", "n1", "n2", false, "", forRun("s2", "n1"), ""},
		{"the coordinator itself, idle and named", "n2", "n2", false, "", forRun("n2"), ""},
		{"a node running a job refuses", "n1", "n2", true, "", forRun("n1"), "n1 runs jobs [run-00000001]"},
		{"a node restoring jobs refuses", "n1", "n2", false, "restore", forRun("n1"), `busy "restore"`},
		{"a node the run does not name refuses", "n1", "n2", false, "", forRun("s1", "n4"), "n1 is not a free spare"},
		{"a node without a run refuses", "n1", "n2", false, "", forRun(), "n1 is not a free spare"},
		{"a ring spare still accepts, named or not", "s1", "n2", false, "", forRun("n1"), ""},
		{"the failed node itself refuses", "n3", "n2", false, "", forRun("n3"), `"n3" is not another node of the ring`},
		{"only an alive node of the ring claims", "n1", "s2", false, "", forRun("n1"), "s2 is not an alive node of the ring"},
		{"a run's spare that is no member name", "n1", "n2", false, "", forRun("n1", "a b"), "a spare of the run"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, _ := newWireAgent(t, tt.self, testMembers(nil))
			if tt.running {
				a.byID["run-00000001"] = &Job{ID: "run-00000001", State: JobRunning, Node: tt.self}
			}
			if tt.busy != "" {
				defer a.busy.begin(tt.busy)()
			}
			err := a.serveClaim(tt.by, tt.claim)
			cur, claimed := a.claims.Current()
			if tt.wantErr == "" {
				if err != nil || !claimed || cur.By != tt.by {
					t.Fatalf("refused (%v) or not recorded (%+v)", err, cur)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %v; want one saying %q", err, tt.wantErr)
			}
			if claimed {
				t.Errorf("claim recorded: %+v", cur)
			}
		})
	}
}

// TestServeClaimReleasesFinishedRun: a node that served a run's claim earlier and is idle again accepts a
// new one once that recovery is over, and not while it may still be coming.
func TestServeClaimReleasesFinishedRun(t *testing.T) {
	tests := []struct {
		name     string
		failed   bool // the earlier claim's node is failed in the view (its recovery happened)
		recorded bool // this host's record of that recovery says done
		old      bool // the earlier claim is older than a recovery may take
		accepted bool
	}{
		{"recovery done here", true, true, false, true},
		{"no recovery came for a long time", true, false, true, true},
		{"the recovery may still come", true, false, false, false},
		{"the earlier failed node is not failed in the view yet", false, true, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, _ := newWireAgent(t, "n1", testMembers(nil))
			at := time.Now()
			if tt.old {
				at = at.Add(-2 * recoverLimit)
			}
			if err := a.claims.Claim(spare.Claim{Failure: "n3-old", By: "n2", Failed: "n3", At: at, Spares: []string{"n1"}}, 1<<40); err != nil {
				t.Fatal(err)
			}
			if tt.failed {
				nv, err := a.View().Absorb("n3", "n1")
				if err != nil {
					t.Fatal(err)
				}
				if _, err := a.adoptView(nv); err != nil {
					t.Fatal(err)
				}
			}
			if tt.recorded {
				if err := saveRecovery(a.cfg.StateDir, &recoveryRecord{Failure: "n3-old", Coordinator: "n2", Done: true}); err != nil {
					t.Fatal(err)
				}
			}
			// The testMembers ring has three nodes: the next failure to claim for is n3's again (a later one).
			err := a.serveClaim("n2", spare.Claim{Failure: "n3-2", Failed: "n3", Spares: []string{"n1"}, Need: spare.Need{Jobs: 1}})
			requireClaimHeld(t, a, err, tt.accepted, "n3-2", "n3-old")
		})
	}
}

// TestServeClaimReleasesAbandoned: a spare claimed for a recovery that ended before the view changed (the
// failed node beat again) accepts a new claim once that failure's timeline says done, the node being an
// alive member still; not while the recovery may go on.
func TestServeClaimReleasesAbandoned(t *testing.T) {
	for _, tt := range []struct {
		name     string
		done     bool // the failure's timeline here says done
		accepted bool
	}{
		{"recovery abandoned", true, true},
		{"recovery under way", false, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			a, _ := newWireAgent(t, "s1", testMembers(nil))
			if err := a.claims.Claim(spare.Claim{Failure: "n3-old", By: "n2", Failed: "n3", At: time.Now()}, 1<<40); err != nil {
				t.Fatal(err)
			}
			a.failures.Update("n3-old", func(f *Failure) {
				f.Node, f.Protector, f.Detected, f.Done = "n3", "n2", time.Now(), tt.done
			})
			err := a.serveClaim("n2", spare.Claim{Failure: "n3-2", Failed: "n3", Need: spare.Need{Jobs: 1}})
			requireClaimHeld(t, a, err, tt.accepted, "n3-2", "n3-old")
		})
	}
}

// requireClaimHeld checks a claim made while an earlier one was held: accepted, the newer one is held;
// refused as busy, the earlier one is kept.
func requireClaimHeld(t *testing.T, a *Agent, err error, accepted bool, newer, earlier string) {
	t.Helper()
	cur, _ := a.claims.Current()
	if accepted {
		if err != nil || cur.Failure != newer {
			t.Fatalf("refused (%v); holds %+v", err, cur)
		}
		return
	}
	if !errors.Is(err, spare.ErrBusy) || cur.Failure != earlier {
		t.Fatalf("error %v, holds %+v; want busy with the earlier claim kept", err, cur)
	}
}

// TestClaimSpareForRun: the coordinator claims its run's spares first, itself included when it is one
// (it absorbs the failed node); with none free it falls back to the ring's spares, then basic mode, and
// the claimed stage says the run's own spares were busy.
func TestClaimSpareForRun(t *testing.T) {
	tests := []struct {
		name       string
		runSpares  []string
		target     string
		absorb     bool
		basic      bool
		wantDetail string
	}{
		{"the coordinator is the run's idle spare", []string{"n2"}, "n2", true, false, "a spare of the run"},
		{"the run's spares do not answer: ring spares, then basic mode", []string{"n1"}, "n2", true, true,
			"basic mode on the protector: the run's own spares were busy or gone (n1: "},
		{"no run spare alive", []string{"gone"}, "n2", true, true, "none of the run's own spares [gone] is alive"},
		{"no run: as before", nil, "n2", true, true, "basic mode on the protector: no spare free (s1: "},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, _ := newWireAgent(t, "n2", testMembers(nil))
			target, absorb, basic := a.claimSpare(t.Context(), "n3-1", "n3", spare.Need{Jobs: 1}, tt.runSpares, nil)
			if target != tt.target || absorb != tt.absorb || basic != tt.basic {
				t.Errorf("claimed %s (absorb %v, basic %v); want %s (absorb %v, basic %v)", target, absorb, basic, tt.target, tt.absorb, tt.basic)
			}
			fs := a.Failures()
			if len(fs) != 1 || len(fs[0].Stages) != 1 || !strings.Contains(fs[0].Stages[0].Detail, tt.wantDetail) {
				t.Fatalf("stages %+v; want one claimed stage saying %q", fs, tt.wantDetail)
			}
		})
	}
}

// TestReplicaNamesRunSpares: a holder answers a replica with the spares its job record's placement names,
// which the coordinator claims first; none for a job without a placement or with one no run can have.
func TestReplicaNamesRunSpares(t *testing.T) {
	tests := []struct {
		name      string
		placement *Placement
		want      []string
	}{
		{"a job of a run", &Placement{Hosts: []string{"node1", "node2"}, Spares: []string{"node3", "node4"}}, []string{"node3", "node4"}},
		{"a run without spares", &Placement{Hosts: []string{"node1", "node2"}}, nil},
		{"no placement", nil, nil},
		{"an invalid placement", &Placement{Hosts: []string{"node1"}, Spares: []string{"node1"}}, nil},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ta := newTestAgent(t)
			job := fmt.Sprintf("run-0000000%d", i)
			ta.addSnapshot(t, Job{ID: job, Node: "node1", Spec: JobSpec{Argv: []string{"x"}, Placement: tt.placement}})
			rep, err := peerService{ta.Agent}.Replica(t.Context(), "node2", clusterapi.ReplicaRequest{Job: job, Node: "node1"})
			if err != nil || !slices.Equal(rep.RunSpares, tt.want) {
				t.Fatalf("answer %+v, %v; want the run's spares %v", rep.RunSpares, err, tt.want)
			}
			held, err := ta.heldReplicas(t.Context(), job, "node1")
			if err != nil || len(held) == 0 || !slices.Equal(held[0].spares, tt.want) {
				t.Fatalf("held %+v, %v; want this host's replica with the run's spares %v", held, err, tt.want)
			}
		})
	}
}
