package agent

import (
	"fmt"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt"
)

// declaredFailed orders the commits of the snapshots peers send this host with this host's declarations
// of their senders' failures. A fail-over chooses the newest replica of each of the failed node's jobs; a
// replica of it that arrived whole just before the crash, and committed after that choice (a commit syncs
// every file of the snapshot to disk), would trim the determinants and prune the copies the older choice
// needs, and the recovery would be refused for want of them. So a declaration waits for the commits under
// way, which the choice then sees, and from then until the fail-over ends the node's snapshots are refused.
type declaredFailed struct {
	mu    sync.RWMutex
	nodes map[string]bool
}

// declare marks node failed once every commit of a snapshot under way is over; forget, returned, lifts
// the mark (its fail-over is over).
func (d *declaredFailed) declare(node string) (forget func()) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.nodes == nil {
		d.nodes = map[string]bool{}
	}
	d.nodes[node] = true
	return func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		delete(d.nodes, node)
	}
}

// enter refuses a commit of a snapshot of node if node is declared failed; otherwise declarations wait
// until release is called.
func (d *declaredFailed) enter(node string) (release func(), err error) {
	d.mu.RLock()
	if d.nodes[node] {
		d.mu.RUnlock()
		return nil, fmt.Errorf("this protector declared %s failed and is restoring its jobs from the replicas it chose: a snapshot of it arriving now is not kept", node)
	}
	return d.mu.RUnlock, nil
}

// beforeReplicaCommit is ship.ReceiveOptions.BeforeCommit for the snapshots peers send (declaredFailed).
func (a *Agent) beforeReplicaCommit(m *ckpt.Manifest) (func(error), error) {
	release, err := a.declared.enter(m.Node)
	if err != nil {
		return nil, err
	}
	return func(err error) {
		if err == nil {
			// Before a declaration can read the arrivals: a job whose first replica this is gets restored.
			a.replicas.arrived(m.Node, m.Job, time.Now())
		}
		release()
	}, nil
}
