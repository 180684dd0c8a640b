package agent

import (
	"errors"
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
//
// It also orders declarations with vouches (OpVouch): a node back from a stall of its own that looked like
// isolation asks its protector whether it is still a member before it kills its jobs. Either the vouch
// comes first, and a declaration on the silence before it is dropped (the node answered after it), or the
// declaration does, and the vouch is refused (the node kills its jobs, which go on elsewhere). vmu, not mu,
// orders the two: a declaration holds mu while commits finish, which a vouch must not wait for.
type declaredFailed struct {
	mu sync.RWMutex
	// nodes counts the fail-overs under way of each node: two may overlap (it beat again during the first
	// one's fence wait, then fell silent again), and the first to end must not lift the second one's mark.
	nodes map[string]int

	vmu     sync.Mutex
	vouched map[string]time.Time // the last vouch for each member
	failed  map[string]uint64    // the incarnation of each member this host declared failed, the last one
	// viewed is the incarnation of each member that this host made a view of failed, the last one: that
	// declaration is never withdrawn (undeclare).
	viewed  map[string]uint64
	refused map[string]time.Time // the last vouch refused because of such a declaration
	retries map[string]retry     // the last fail-over of each member that changed nothing (retryAfter)
}

// retry is when a fail-over that changed nothing ended, and the wait before the next suspicion it set.
type retry struct {
	at   time.Time
	wait time.Duration
}

// failoverRetryMax bounds the wait before a node whose fail-over changed nothing is suspected again.
const failoverRetryMax = 10 * time.Minute

// retryAfter is how long after now node, whose fail-over just ended with nothing changed, may be suspected
// again: first after timeout; while its fail-overs keep changing nothing, twice the previous wait each time,
// at most failoverRetryMax. A node heard from meanwhile (no fail-over for more than twice the last wait)
// starts over.
func (d *declaredFailed) retryAfter(node string, timeout time.Duration, now time.Time) time.Duration {
	d.vmu.Lock()
	defer d.vmu.Unlock()
	if d.retries == nil {
		d.retries = map[string]retry{}
	}
	r := d.retries[node]
	if r.wait == 0 || now.Sub(r.at) > 2*r.wait+timeout {
		r.wait = timeout
	} else {
		r.wait = min(2*r.wait, max(failoverRetryMax, timeout))
	}
	r.at = now
	d.retries[node] = r
	return r.wait
}

// errVouched refuses a declaration: the node was vouched for after its silence began.
var errVouched = errors.New("vouched for after its silence began")

// fail records that this host declares incarnation inc of node failed, on a silence that began at
// silentSince: from now on it vouches for that incarnation no more. It refuses (errVouched) if node was
// vouched for since silentSince.
func (d *declaredFailed) fail(node string, inc uint64, silentSince time.Time) error {
	d.vmu.Lock()
	defer d.vmu.Unlock()
	if at, ok := d.vouched[node]; ok && at.After(silentSince) {
		return fmt.Errorf("%s: %w (at %s)", node, errVouched, at.Format(time.StampMilli))
	}
	if d.failed == nil {
		d.failed = map[string]uint64{}
	}
	d.failed[node] = inc
	return nil
}

// declare declares incarnation inc of node failed (fail) and marks it so once every commit of a snapshot
// under way is over; forget, returned, lifts the mark (its fail-over is over).
func (d *declaredFailed) declare(node string, inc uint64, silentSince time.Time) (forget func(), err error) {
	if err := d.fail(node, inc, silentSince); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.nodes == nil {
		d.nodes = map[string]int{}
	}
	d.nodes[node]++
	return sync.OnceFunc(func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		if d.nodes[node]--; d.nodes[node] <= 0 {
			delete(d.nodes, node)
		}
	}), nil
}

// vouch records, at now, that incarnation inc of node answered after any silence so far, unless this host
// declared that incarnation failed: its jobs go on elsewhere then, or nowhere.
func (d *declaredFailed) vouch(node string, inc uint64, now time.Time) error {
	d.vmu.Lock()
	defer d.vmu.Unlock()
	if f, ok := d.failed[node]; ok && f == inc {
		if d.refused == nil {
			d.refused = map[string]time.Time{}
		}
		d.refused[node] = now
		return fmt.Errorf("this node declared %s (incarnation %d) failed: its jobs go on elsewhere, or wait for ftctl restore", node, inc)
	}
	if d.vouched == nil {
		d.vouched = map[string]time.Time{}
	}
	d.vouched[node] = now
	return nil
}

// enter refuses a commit of a snapshot of node if node is declared failed; otherwise declarations wait
// until release is called.
func (d *declaredFailed) enter(node string) (release func(), err error) {
	d.mu.RLock()
	if d.nodes[node] > 0 {
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

// lastVouch is when this host last vouched for node (zero if never): the node counts the vouch as contact
// with its protector, so a fence wait counts from it too (awaitFence).
func (d *declaredFailed) lastVouch(node string) time.Time {
	d.vmu.Lock()
	defer d.vmu.Unlock()
	return d.vouched[node]
}

// refusedSince is when this host last refused to vouch for node because it had declared it failed, if
// that was after t: the node killed its jobs on that answer.
func (d *declaredFailed) refusedSince(node string, t time.Time) (time.Time, bool) {
	d.vmu.Lock()
	defer d.vmu.Unlock()
	at, ok := d.refused[node]
	return at, ok && at.After(t)
}

// inView records that this host made a view in which incarnation inc of node is failed: its jobs may be
// restored elsewhere from then on, so the declaration stands even if the node is alive again in a later view
// of this host's (that view lost the tie-break with another failure's view of the same epoch, until
// keepFailedInView applies the failure again).
func (d *declaredFailed) inView(node string, inc uint64) {
	d.vmu.Lock()
	defer d.vmu.Unlock()
	if d.viewed == nil {
		d.viewed = map[string]uint64{}
	}
	d.viewed[node] = inc
}

// undeclare withdraws this host's declaration of incarnation inc of node, whose fail-over ended with the
// node still a member (nothing of it was restored): a vouch for it is no longer refused. A declaration whose
// fail-over made a view of the node failed (inView) stands: vouched for, the node ran its jobs on next to
// their restored copies (its protector's host acknowledges its beats, so it never fenced itself). It
// reports whether the declaration stands so.
func (d *declaredFailed) undeclare(node string, inc uint64) (viewed bool) {
	d.vmu.Lock()
	defer d.vmu.Unlock()
	if v, ok := d.viewed[node]; ok && v == inc {
		return true
	}
	if f, ok := d.failed[node]; ok && f == inc {
		delete(d.failed, node)
	}
	return false
}
