package agent

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt/ship"
)

// keepReplicas applies retention to the copies this protector holds of the sender's snapshots of a job,
// after one of them was received: the newest checkpoint.keep stay, as on the sender, and the newest copy
// that verifies is never deleted. The one just received counts as verified (Receive hashed it), so in
// the usual case nothing is hashed again.
func (a *Agent) keepReplicas(ctx context.Context, got *ship.Received) {
	m := got.Manifest
	a.replicas.arrived(m.Node, m.Job, time.Now())
	if a.detStore != nil {
		a.detStore.Trim(m) // the determinants before it are no longer needed
	}
	deleted, err := a.store.PruneReceived(ctx, m.Job, m.Node, a.cfg.Checkpoint.Keep, m.ID, a.pinnedSnapshots(m.Job)...)
	if err != nil {
		a.log.Warn("prune replicas", "job", m.Job, "from", m.Node, "err", err)
	}
	if len(deleted) > 0 {
		a.log.Debug("pruned replicas", "job", m.Job, "from", m.Node, "ids", deleted)
	}
}

// replicaArrivals remembers when the newest replica of each job arrived from each node. A node's heartbeats
// name the jobs it runs, but a job started and protected between its node's last beat and its crash is in
// none: its replica, arrived after that beat, says it ran then, and it must be restored too.
type replicaArrivals struct {
	mu     sync.Mutex
	byNode map[string]map[string]time.Time // node -> job -> arrival
}

// maxArrivals bounds what replicaArrivals keeps: beyond it the oldest arrivals are forgotten (they are older
// than any last heartbeat a failure can have).
const maxArrivals = 1 << 16

func (r *replicaArrivals) arrived(node, job string, at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.byNode == nil {
		r.byNode = map[string]map[string]time.Time{}
	}
	if r.byNode[node] == nil {
		r.byNode[node] = map[string]time.Time{}
	}
	r.byNode[node][job] = at
	n := 0
	for _, jobs := range r.byNode {
		n += len(jobs)
	}
	for n > maxArrivals {
		oldNode, oldJob, oldest := "", "", at
		for nd, jobs := range r.byNode {
			for j, t := range jobs {
				if t.Before(oldest) {
					oldNode, oldJob, oldest = nd, j, t
				}
			}
		}
		if oldNode == "" {
			break
		}
		delete(r.byNode[oldNode], oldJob)
		n--
	}
}

// since is jobs (what node's last heartbeat, at lastBeat, named) plus every job whose replica from node
// arrived after lastBeat.
func (r *replicaArrivals) since(node string, lastBeat time.Time, jobs []string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := slices.Clone(jobs)
	var late []string
	for job, at := range r.byNode[node] {
		if at.After(lastBeat) && !slices.Contains(out, job) {
			late = append(late, job)
		}
	}
	slices.Sort(late)
	return append(out, late...)
}
