package agent

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
)

// locateScript is a member that holds snapshot id, of job, owned by uid.
type locateScript struct {
	clusterapi.Service
	id, job string
	uid     uint32
}

func (s locateScript) Locate(_ context.Context, _ string, req clusterapi.LocateRequest) (clusterapi.LocateReply, error) {
	if req.ID != s.id {
		return clusterapi.LocateReply{ID: req.ID}, nil
	}
	return clusterapi.LocateReply{ID: s.id, Job: s.job, UID: &s.uid}, nil
}

// TestRestoreOthersRemoteSnapshotTellsNothing: a uid that names one of its own jobs and a snapshot id
// another member holds of another user's job is refused as not its own before anything else is said of the
// snapshot: the answer named the other user's job ("snapshot S is of job J, not X"), whose id only its owner
// and root may see. The owner, naming the wrong job, is told which job the snapshot is of.
func TestRestoreOthersRemoteSnapshotTellsNothing(t *testing.T) {
	pki := newTestPKI(t)
	const snap, theirs, mine = "20261122T153000.123Z-n2-000042", "secret-0a1b2c3d", "mine-01020304"
	a, _ := clientAgent(t, pki, map[string]uint16{
		"n2": scriptedPeer(t, pki, "n2", locateScript{id: snap, job: theirs, uid: 1000}),
	})
	for _, tt := range []struct {
		name     string
		uid      uint32
		told     bool  // whether the error may name the snapshot's job
		wantKind error // of the error
	}{
		{"another uid", 2000, false, ErrNoJob},
		{"the owner", 1000, true, ckpt.ErrNotFound},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := a.Restore(t.Context(), RestoreRequest{Snapshot: snap, Job: mine}, tt.uid)
			switch {
			case err == nil:
				t.Fatalf("restore of %s as job %s by uid %d succeeded", snap, mine, tt.uid)
			case !errors.Is(err, tt.wantKind):
				t.Errorf("uid %d: %v; want %v", tt.uid, err, tt.wantKind)
			case strings.Contains(err.Error(), theirs) != tt.told:
				t.Errorf("uid %d: %v; naming job %s: %v, want %v", tt.uid, err, theirs, !tt.told, tt.told)
			}
		})
	}
}
