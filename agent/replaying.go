package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
)

// ErrReplaying refuses a snapshot of a job whose recovery is replaying its peers' bytes into it. CRIU's
// network lock would drop the segments the replay delivers to the job's sockets while it dumps (their
// sends fail with EPERM, and the recovery kills the job: CI, 2026-11-27), and the snapshot would catch the
// job half way through a replay its recovery has not verified. The recovery snapshots the job itself once
// the replay is verified.
var ErrReplaying = errors.New("its recovery is replaying its peers' bytes into it and snapshots it once that is verified: try again then")

// replayingJobs are the jobs restored on this host whose recovery has not verified their replay yet: from
// the recovery's record of them (before CRIU restores them) until their replay is verified or they are
// killed. Their recovery's tracker keeps the set; a restarted agent fills it from its unfinished
// recoveries before it schedules any snapshot.
type replayingJobs struct {
	mu  sync.Mutex
	ids map[string]bool
}

func (r *replayingJobs) set(id string, on bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !on {
		delete(r.ids, id)
		return
	}
	if r.ids == nil {
		r.ids = map[string]bool{}
	}
	r.ids[id] = true
}

func (r *replayingJobs) has(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ids[id]
}

// split returns the jobs of jobs that no recovery replays into, and the ids of those it does.
func (r *replayingJobs) split(jobs []Job) (rest []Job, replaying []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rest = slices.DeleteFunc(jobs, func(j Job) bool {
		if r.ids[j.ID] {
			replaying = append(replaying, j.ID)
			return true
		}
		return false
	})
	return rest, replaying
}

// waitReplayed returns once no recovery replays into job id (at once if none does), or an error wrapping
// ErrReplaying after timeout (a recovery kills a job that has not re-sent its peers' bytes within
// replay_timeout, so twice that leaves time for the check of those bytes). A drain moves such a job once
// its replay is verified, instead of leaving it on a host predicted to fail.
func (a *Agent) waitReplayed(ctx context.Context, id string, timeout time.Duration) error {
	start := time.Now()
	for a.replays.has(id) {
		if time.Since(start) > timeout {
			return fmt.Errorf("job %s still replaying after %s: %w", id, timeout, ErrReplaying)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("job %s: waiting for its replay: %w", id, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}
