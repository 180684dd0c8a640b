package agent

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/heldconns"
	"github.com/ftkit/ftkit/tcpflow"
)

// A connection a job opens after its last snapshot cannot be rebuilt from that snapshot: restored, the
// process would accept or connect again while its peer's end is long established, and the peer's next
// segment would be answered with a reset. So the agent lists every protected job's connections each
// connCheckEvery, names those its replica lacks in the job's record (Job.NewConns: `ftctl status` shows
// the job UNPROTECTED) and the scheduler snapshots the job again soon (snapScheduler, newConnGap).

// connCheckEvery is how often the agent lists its jobs' connections (sock_diag and /proc: well under a
// millisecond for a job with a few hundred descriptors).
const connCheckEvery = 500 * time.Millisecond

// maxNewConnsListed bounds Job.NewConns; the last entry then says how many more there are.
const maxNewConnsListed = 16

// replicaConns is the set of connections of a job's replica, by snapshot.
type replicaConns struct {
	snapshot string
	conns    map[tcpflow.Tuple]bool
}

func snapshotConns(m *ckpt.Manifest) replicaConns {
	rc := replicaConns{snapshot: m.ID, conns: make(map[tcpflow.Tuple]bool, len(m.Conns))}
	for _, c := range m.Conns {
		rc.conns[c.Tuple.Unmap()] = true
	}
	return rc
}

// checkConns runs the check until ctx ends.
func (a *Agent) checkConns(ctx context.Context) {
	every(ctx, connCheckEvery, func() {
		running := map[string]bool{}
		var host []Job // jobs in the host's network namespace: one socket listing serves them all
		for _, j := range a.Jobs(0) {
			if j.State != JobRunning || !j.Protected() {
				continue
			}
			running[j.ID] = true
			if j.Net == nil {
				host = append(host, j)
			} else {
				a.checkJobConns(j.Net, j)
			}
		}
		if len(host) > 0 {
			a.checkJobConns(nil, host...)
		}
		a.mu.Lock()
		for id := range a.replicaConns {
			if !running[id] {
				delete(a.replicaConns, id)
			}
		}
		a.mu.Unlock()
	})
}

// checkJobConns lists the connections of jobs, which share network namespace n (nil: the host's), and
// records in each job's record those its replica lacks.
func (a *Agent) checkJobConns(n *JobNet, jobs ...Job) {
	var cgroups []string
	for _, j := range jobs {
		cgroups = append(cgroups, j.Cgroup)
	}
	checked := time.Now().UTC() // before the listing: what it finds is at least this recent
	var held map[string]heldconns.Held
	err := inJobNet(n, func() error {
		var err error
		held, err = heldconns.List(cgroups...)
		return err
	})
	if err != nil {
		a.log.Debug("list the jobs' connections", "jobs", len(jobs), "err", err)
		return
	}
	for _, j := range jobs {
		known, err := a.connsOfReplica(j)
		if err != nil {
			a.log.Debug("connections of the job's replica unknown: not checked", "job", j.ID, "err", err)
			continue
		}
		fresh := newConns(held[j.Cgroup], known)
		a.mu.Lock()
		cur, ok := a.byID[j.ID]
		// A replica recorded meanwhile holds the connections the job had at its dump: this listing was
		// compared with the one before and is stale.
		if !ok || cur.Replica == nil || cur.Replica.Snapshot != known.snapshot {
			a.mu.Unlock()
			continue
		}
		changed := !slices.Equal(cur.NewConns, fresh)
		cur.NewConns, cur.ConnsChecked = fresh, checked
		if changed {
			a.notify()
		}
		a.mu.Unlock()
		if changed && len(fresh) > 0 {
			a.log.Info("job has connections its replica lacks: not protected until its next snapshot, taken soon",
				"job", j.ID, "replica", known.snapshot, "connections", fresh)
		}
	}
}

// connsOfReplica returns the connections of j's replica, from memory or, after a restart, its manifest.
func (a *Agent) connsOfReplica(j Job) (replicaConns, error) {
	a.mu.Lock()
	rc, ok := a.replicaConns[j.ID]
	a.mu.Unlock()
	if ok && rc.snapshot == j.Replica.Snapshot {
		return rc, nil
	}
	m, err := a.store.Manifest(j.ID, j.Replica.Snapshot)
	if err != nil {
		return replicaConns{}, fmt.Errorf("manifest of replica %s: %w", j.Replica.Snapshot, err)
	}
	rc = snapshotConns(m)
	a.mu.Lock()
	a.replicaConns[j.ID] = rc
	a.mu.Unlock()
	return rc, nil
}

// newConns names what held has that the replica's set lacks: connections (a loopback one is restored
// with both its ends, or re-made by both) and listeners with connections waiting to be accepted.
func newConns(held heldconns.Held, known replicaConns) []string {
	var out []string
	for _, c := range held.Conns {
		if c.Remote.Addr().IsLoopback() || known.conns[c] {
			continue
		}
		out = append(out, fmt.Sprintf("%s -> %s: opened after snapshot %s", c.Local, c.Remote, known.snapshot))
	}
	for _, l := range held.Pending {
		out = append(out, fmt.Sprintf("listener %s: a connection waits in its accept queue", l))
	}
	slices.Sort(out)
	if len(out) > maxNewConnsListed {
		more := len(out) - (maxNewConnsListed - 1)
		out = append(out[:maxNewConnsListed-1], fmt.Sprintf("and %d more", more))
	}
	return out
}
