package agent

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

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

// forgetDuringFetch is a member that holds a snapshot: asked for it, it runs during (on the restoring host, while
// the transfer is under way) and then fails the transfer; it counts the Forget requests it gets.
type forgetDuringFetch struct {
	clusterapi.Service
	during  func()
	forgets chan clusterapi.ForgetRequest
}

func (s forgetDuringFetch) Fetch(context.Context, string, clusterapi.FetchRequest, net.Conn) error {
	s.during()
	return errors.New("scripted holder: transfer failed")
}

func (s forgetDuringFetch) Forget(_ context.Context, _ string, req clusterapi.ForgetRequest) (clusterapi.ForgetReply, error) {
	s.forgets <- req
	return clusterapi.ForgetReply{Deleted: 1}, nil
}

// TestRestoreFetchHeldFromAForgetPass: the owner of an ended job whose keep_ended has passed restores it
// from a snapshot another member holds. The restore's lock, which a forget pass spares (stillEnded), was
// taken only after the fetch: a forget pass during the transfer told the holder to delete the very snapshot
// it was sending (and removed the job's record), and one right after it deleted the snapshot fetched.
func TestRestoreFetchHeldFromAForgetPass(t *testing.T) {
	pki := newTestPKI(t)
	const job, snap = "ended-0000000a", "20261122T153000.123Z-n1-000042"
	ended := time.Now().Add(-2 * time.Hour)
	var a *Agent
	script := forgetDuringFetch{forgets: make(chan clusterapi.ForgetRequest, 4)}
	script.during = func() { a.forgetDue(context.Background(), time.Now()) }
	a, _ = clientAgent(t, pki, map[string]uint16{"n2": scriptedPeer(t, pki, "n2", script)})
	a.jobs = jobStore{dir: t.TempDir()}
	a.cfg.Checkpoint.KeepEnded = Duration{Duration: time.Hour}
	a.mu.Lock()
	a.byID[job] = &Job{ID: job, Node: "n1", State: JobExited, Ended: ended, Forget: []string{"n2"}}
	a.mu.Unlock()

	if _, err := a.Restore(t.Context(), RestoreRequest{Snapshot: snap, Job: job, Source: "n2"}, 0); err == nil {
		t.Fatal("restore succeeded from a holder whose transfer fails")
	}
	select {
	case req := <-script.forgets:
		t.Errorf("the holder was told to forget job %s (%+v) while it sent the snapshot a restore fetched", job, req)
	default:
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.byID[job] == nil {
		t.Errorf("job %s's record was forgotten while a restore of it fetched its snapshot", job)
	}
}
