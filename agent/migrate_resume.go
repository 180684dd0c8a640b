package agent

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// An agent that dies during a migration (SIGKILL, OOM, a crash) leaves the migration's event open. If the
// job had not left this host yet, the restarted agent adopted it (thawed, as after a semi-coordinated
// snapshot): the migration is over, the job runs on here. If it had (its record says moved, and names the
// migration and the dump it left with), the job runs nowhere unless the target got the request: the
// restarted agent takes what is left of it here down and finishes the move, from the target's record of the
// recovery if it has one, by asking the target again if not, and by restoring the job here again if the
// target fails, as the migration itself would have. The claim of the job's next incarnation from a majority
// keeps a request that reached the target twice from running the job twice.

// errRestartedMidMove is the cause a resumed migration gives the target's recovery its stream lost.
var errRestartedMidMove = errors.New("this host's agent restarted during the migration")

// resumeMigrations finishes the migrations of this host a previous agent left under way (at start, once
// adopt has read the job records). It returns how many it resumed, and a wait for their end (tests).
func (a *Agent) resumeMigrations(ctx context.Context) (n int, wait func()) {
	var wg sync.WaitGroup
	for _, f := range a.failures.List() {
		// Only this host's own migrations: a timeline another member sent that names this host is not one.
		if f.Kind != KindMigration || f.Node != a.cfg.Name || f.Protector != a.cfg.Name || f.Done || len(f.Jobs) != 1 {
			continue
		}
		j, _, err := a.Job(f.Jobs[0], 0)
		switch {
		case err == nil && j.State == JobMoved && j.Migration == f.ID && j.MovedSnapshot != "":
			n++
			wg.Go(func() { a.resumeMigration(ctx, f.ID, j) })
		case err == nil && j.State == JobMoved:
			a.endMigration(f.ID, fmt.Errorf("ftagent restarted after job %s left this host for %s, and its record does not name the dump it left with: restore it with `ftctl restore`", j.ID, j.MovedTo))
		case err == nil:
			a.endMigration(f.ID, fmt.Errorf("not moved: ftagent restarted before job %s left this host; the restarted agent found it %s", j.ID, j.State))
		default:
			a.endMigration(f.ID, fmt.Errorf("not moved: ftagent restarted during the migration and found no record of job %s: %w", f.Jobs[0], err))
		}
	}
	return n, wg.Wait
}

// resumeMigration finishes migration id of job j, which had left this host when the previous agent died.
func (a *Agent) resumeMigration(ctx context.Context, id string, j Job) {
	a.log.Warn("resuming a migration a previous agent left under way: the job had left this host", "migration", id, "job", j.ID, "to", j.MovedTo, "snapshot", j.MovedSnapshot)
	emit := a.migrationStages(id)
	// The previous agent may have died before it killed the job: the job's address goes off the wire (adopt
	// removed its network already if it still had a name), then its processes, as leave does.
	a.removeOrphanJobNet(ctx, j.ID, j.netAddr(), "its migration left this host") // one left holds its address
	if err := a.killCopy(ctx, j); err != nil {
		a.endMigration(id, fmt.Errorf("job %s left this host for %s but what is left of it here could not be killed, so it is not restored anywhere: %w; kill it, then `ftctl restore --snapshot %s`",
			j.ID, j.MovedTo, err, j.MovedSnapshot))
		return
	}

	rreq := a.migrationRequest(id, j.ID, j.MovedSnapshot)
	res := &Migration{Job: j.ID, From: a.cfg.Name, To: j.MovedTo, Snapshot: j.MovedSnapshot, Event: id}
	var err error
	if st, serr := a.recoveryStatus(ctx, j.MovedTo, id, []string{j.ID}); serr == nil && !st.Known {
		// The previous agent died before its request reached the target.
		err = a.remoteRecover(ctx, j.MovedTo, rreq, emit)
	} else {
		err = a.afterBrokenStream(ctx, j.MovedTo, rreq, emit, errRestartedMidMove)
	}
	m, merr := a.store.Manifest(j.ID, j.MovedSnapshot)
	if merr != nil {
		m = nil // its peers are not asked to snapshot (endMove)
	}
	if err := a.endMove(ctx, res, rreq, emit, err, j, m); err != nil {
		a.log.Error("resumed migration failed", "migration", id, "job", j.ID, "err", err)
		return
	}
	a.log.Info("resumed migration ended", "migration", id, "job", j.ID, "runs_on", res.To, "err", res.Error)
}
