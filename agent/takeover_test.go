package agent

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/restore/recovery"
	"github.com/ftkit/ftkit/ring"
)

func TestFollowedTargets(t *testing.T) {
	v := ring.View{Epoch: 1, Members: []ring.Member{
		{Name: "node1", Role: ring.RoleNode, State: ring.StateAlive},
		{Name: "spare1", Role: ring.RoleNode, State: ring.StateAlive},
		{Name: "spare2", Role: ring.RoleSpare, State: ring.StateAlive},
	}}
	var f followedTargets
	ctx1, cancel1 := context.WithCancelCause(context.Background())
	ctx2, cancel2 := context.WithCancelCause(context.Background())
	ctx3, cancel3 := context.WithCancelCause(context.Background())
	defer f.follow("spare1", cancel1)()
	defer f.follow("spare2", cancel2)()
	f.follow("spare1", cancel3)() // no longer followed

	f.failed(v)
	if ctx1.Err() != nil || ctx2.Err() != nil {
		t.Fatalf("a view with every target alive ended a wait: %v, %v", context.Cause(ctx1), context.Cause(ctx2))
	}
	v.Members[1].State = ring.StateFailed
	f.failed(v)
	if err := context.Cause(ctx1); !errors.Is(err, errTargetFailed) || !strings.Contains(err.Error(), "spare1") {
		t.Errorf("the wait on spare1 ended with %v, want errTargetFailed naming it", err)
	}
	if ctx2.Err() != nil || ctx3.Err() != nil {
		t.Errorf("waits on spare2 (%v) or an unfollowed one (%v) ended", context.Cause(ctx2), context.Cause(ctx3))
	}
}

func TestCheckTakenFrom(t *testing.T) {
	v := ring.View{Epoch: 3, Members: []ring.Member{
		{Name: "node1", Role: ring.RoleNode, State: ring.StateAlive},
		{Name: "node2", Role: ring.RoleNode, State: ring.StateFailed},
		{Name: "spare1", Role: ring.RoleNode, State: ring.StateFailed},
	}}
	for _, tc := range []struct {
		name, from, want string
	}{
		{"none", "", ""},
		{"a failed member", "node2", ""},
		{"an alive member", "node1", "node1, which is not a failed member"},
		{"a stranger", "node9", "node9, which is not a failed member"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkTakenFrom(v, []RecoverJob{{Job: "j-1", Snapshot: "s", TakenFrom: tc.from}})
			if (err == nil) != (tc.want == "") || err != nil && !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want %q", err, tc.want)
			}
		})
	}
}

// TestClaimSupersedesFencedHost: a recovery claims the incarnation after the one a restore on the failed
// node it is for claimed (that restore died with the node), and only that one.
func TestClaimSupersedesFencedHost(t *testing.T) {
	for _, tc := range []struct {
		name, fenced, heldOn string
		want                 uint64 // 0: refused
	}{
		{"held on the fenced node", "spare1", "spare1", 2},
		{"held elsewhere", "spare1", "node1", 0},
		{"a recovery with no fenced node (migration, resume)", "", "spare1", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ta := newTestAgent(t)
			ta.failMember(t, "node2") // the only other member: this agent alone grants
			if _, err := ta.grants.Grant(grant.Request{Job: goneJob, Incarnation: 1, Holder: "failover:node2-x", Host: tc.heldOn}, time.Now()); err != nil {
				t.Fatal(err)
			}
			act := &recoveryActions{a: ta.Agent, records: map[*recovery.Job]Job{}, fenced: tc.fenced}
			j := &recovery.Job{ID: goneJob, Holder: "failover:spare1-y", Manifest: &ckpt.Manifest{Job: goneJob, Node: "node2"}}
			n, err := act.Claim(t.Context(), j, 1)
			switch {
			case tc.want == 0 && !errors.Is(err, ErrJobAlive):
				t.Fatalf("claimed %d (%v), want a refusal: the job may run on %s", n, err, tc.heldOn)
			case tc.want != 0 && (err != nil || n != tc.want):
				t.Fatalf("claimed %d (%v), want %d", n, err, tc.want)
			}
		})
	}
}
