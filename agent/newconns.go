package agent

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/heldconns"
	"github.com/ftkit/ftkit/internal/threadcpu"
	"github.com/ftkit/ftkit/internal/tickgrid"
	"github.com/ftkit/ftkit/tcpflow"
)

// A connection a job opens after its last snapshot cannot be rebuilt from that snapshot: restored, the
// process would accept or connect again while its peer's end is long established, and the peer's next
// segment would be answered with a reset. So the agent lists every protected job's connections each
// connCheckEvery, names those its replica lacks in the job's record (Job.NewConns: `ftctl status` shows
// the job UNPROTECTED) and the scheduler snapshots the job again soon (snapScheduler, newConnGap).

// connCheckEvery is how often the agent looks for its jobs' new connections: it reads the handshakes the
// receive tap counted for each job (a map lookup), and only when they moved the jobs' sockets (/proc: a few
// microseconds per descriptor) and their connections (sock_diag: about a millisecond per network
// namespace, whatever the number of sockets).
const connCheckEvery = 100 * time.Millisecond

// maxNewConnsListed bounds Job.NewConns; the last entry then says how many more there are.
const maxNewConnsListed = 16

// replicaConns is the set of connections of a job's replica, by snapshot.
type replicaConns struct {
	snapshot string
	conns    map[tcpflow.Tuple]bool // false: still connecting at the dump
}

func snapshotConns(m *ckpt.Manifest) replicaConns {
	rc := replicaConns{snapshot: m.ID, conns: make(map[tcpflow.Tuple]bool, len(m.Conns))}
	for _, c := range m.Conns {
		// A socket still connecting at the dump holds nothing of the connection it becomes (false): once
		// established, the replica lacks it, as one opened after the snapshot.
		rc.conns[c.Tuple.Unmap()] = !c.Connecting
	}
	return rc
}

// connListing is the last socket table read for the jobs of one network namespace.
type connListing struct {
	socks heldconns.Sockets
	held  map[string]heldconns.Held
	hs    map[string]uint64 // the jobs' completed handshakes (receive tap) when it was read; nil: unknown
	// again: read it again at the next check: the handshakes moved, and the socket of a passive open is
	// made just after the tap counts it.
	again bool
	at    time.Time
}

// settled reports whether the listing can change only with a new connection: none of its sockets
// connecting or with connections waiting to be accepted, not to be read again, younger than connRelist,
// and read after replica, the newest of its jobs' replicas (one taken after the listing may lack a
// connection the listing holds that closed meanwhile: compared with it, that connection would look new).
func (l connListing) settled(now, replica time.Time) bool {
	if l.held == nil || l.again || now.Sub(l.at) >= connRelist || !l.at.After(replica) {
		return false
	}
	for _, h := range l.held {
		if !h.Settled() {
			return false
		}
	}
	return true
}

// unchanged reports whether the listing holds without reading the jobs' sockets: settled, and no handshake
// completed since (a new connection completes one).
func (l connListing) unchanged(hs map[string]uint64, now, replica time.Time) bool {
	return hs != nil && l.settled(now, replica) && maps.Equal(hs, l.hs)
}

// fresh reports whether the listing holds for socks: settled, and the same sockets.
func (l connListing) fresh(socks heldconns.Sockets, now, replica time.Time) bool {
	return l.settled(now, replica) && l.socks.Equal(socks)
}

// connRelist is how old a socket listing may be reused while the jobs' sockets stay the same (a
// connection waiting in a listen queue appears without a new socket).
const connRelist = 5 * time.Second

// connCheckShare bounds the check's CPU: the next check waits at least this many times as long as the
// shortest of the last connCheckWindow cost in CPU time (a job with thousands of descriptors is checked
// less often).
const connCheckShare = 200

// connCheckWindow is how many checks connCheckPace remembers. The shortest of them counts, not the last,
// so one costly check (its caches cold) does not space the next ones. When the pace counted wall time,
// one check that waited 13 ms for a CPU put the next 2.6 s away, past a 2.5 s job's end: it was never
// seen covered.
const connCheckWindow = 8

// connCheckPace spaces the connection checks.
type connCheckPace struct {
	took [connCheckWindow]time.Duration
	n    int
}

// next records how long a check took and returns how long to wait before the next one.
func (p *connCheckPace) next(took time.Duration) time.Duration {
	p.took[p.n%len(p.took)] = took
	p.n++
	return max(connCheckEvery, connCheckShare*slices.Min(p.took[:min(p.n, len(p.took))]))
}

// checkConns runs the check until ctx ends.
func (a *Agent) checkConns(ctx context.Context) {
	listings := map[string]connListing{} // by network namespace: "" for the host's, else the job network's name
	next := connCheckEvery
	var pace connCheckPace
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(tickgrid.Within(time.Now(), next, connCheckEvery)):
		}
		running := map[string]bool{}
		var protected []Job
		for _, j := range a.Jobs(0) {
			if j.State == JobRunning && j.Protected() {
				running[j.ID] = true
				protected = append(protected, j)
			}
		}
		groups, nets := byNetns(protected)
		for key := range listings {
			if groups[key] == nil {
				delete(listings, key)
			}
		}
		var spent time.Duration
		for key, jobs := range groups {
			spent += checkCost(func(elsewhere *time.Duration) {
				listings[key] = a.checkJobConns(nets[key], listings[key], jobs, elsewhere)
			})
		}
		a.mu.Lock()
		for id := range a.replicaConns {
			if !running[id] {
				delete(a.replicaConns, id)
			}
		}
		a.mu.Unlock()
		next = pace.next(spent)
	}
}

// byNetns groups jobs by network namespace, as one socket table lists them: "" for the host's, else the
// name of the job network, which nets holds.
func byNetns(jobs []Job) (groups map[string][]Job, nets map[string]*JobNet) {
	groups, nets = map[string][]Job{}, map[string]*JobNet{}
	for _, j := range jobs {
		key := ""
		if j.Net != nil {
			key, nets[j.Net.Name] = j.Net.Name, j.Net
		}
		groups[key] = append(groups[key], j)
	}
	return groups, nets
}

// checkCost runs check and returns the CPU time it cost: on the calling thread, and what check adds to
// elsewhere for its work on other threads. Not wall time: on a busy host a cheap check that waited for a
// CPU would space the next ones as a costly one, and in ci301 none saw a 5 s job covered before its end.
func checkCost(check func(elsewhere *time.Duration)) time.Duration {
	var elsewhere time.Duration
	return threadcpu.Of(func() { check(&elsewhere) }) + elsewhere
}

// checkJobConns lists the connections of jobs, which share network namespace n (nil: the host's), and
// records in each job's record those its replica lacks. last is the namespace's previous listing, reused
// while it is fresh; it returns the listing used, and adds to elsewhere the CPU time it spent on another
// thread (inside a job network).
func (a *Agent) checkJobConns(n *JobNet, last connListing, jobs []Job, elsewhere *time.Duration) connListing {
	var cgroups []string
	var replica time.Time // the newest of the jobs' replicas
	for _, j := range jobs {
		cgroups = append(cgroups, j.Cgroup)
		if j.Replica.Time.After(replica) {
			replica = j.Replica.Time
		}
	}
	checked := time.Now().UTC() // before the listing: what it finds is at least this recent
	hs := a.handshakes(cgroups)
	cur := last
	if !last.unchanged(hs, checked, replica) {
		socks, err := heldconns.Inodes(cgroups...)
		if err != nil {
			a.log.Debug("list the jobs' sockets", "jobs", len(jobs), "err", err)
			return connListing{}
		}
		if moved := !maps.Equal(hs, last.hs); moved || !last.fresh(socks, checked, replica) {
			cur = connListing{socks: socks, hs: hs, again: moved && last.held != nil, at: checked}
			err = inJobNet(n, func() error {
				var err error
				took := threadcpu.Of(func() { cur.held, err = heldconns.List(socks) })
				if n != nil { // on a thread of its own, which the caller's clock does not see
					*elsewhere += took
				}
				return err
			})
			if err != nil {
				a.log.Debug("list the jobs' connections", "jobs", len(jobs), "err", err)
				return connListing{}
			}
		}
	}
	for _, j := range jobs {
		known, err := a.connsOfReplica(j)
		if err != nil {
			a.log.Debug("connections of the job's replica unknown: not checked", "job", j.ID, "err", err)
			continue
		}
		fresh := newConns(cur.held[j.Cgroup], known)
		a.mu.Lock()
		rec, ok := a.byID[j.ID]
		// A replica recorded meanwhile holds the connections the job had at its dump: this listing was
		// compared with the one before and is stale.
		if !ok || rec.Replica == nil || rec.Replica.Snapshot != known.snapshot {
			a.mu.Unlock()
			continue
		}
		changed := !slices.Equal(rec.NewConns, fresh)
		rec.NewConns, rec.ConnsChecked = fresh, checked
		if changed {
			a.notify()
		}
		a.mu.Unlock()
		if changed && len(fresh) > 0 {
			a.log.Info("job has connections its replica lacks: not protected until its next snapshot, taken soon",
				"job", j.ID, "replica", known.snapshot, "connections", fresh)
			select {
			case a.beatNow <- struct{}{}: // the protector must know before this host could fail
			default:
			}
		}
	}
	return cur
}

// handshakes reads the handshakes the receive tap counted for each cgroup; nil without a tap or when one
// cannot be read (the check then reads the jobs' sockets every time).
func (a *Agent) handshakes(cgroups []string) map[string]uint64 {
	if a.netlog == nil || a.netlog.tap == nil {
		return nil
	}
	out := make(map[string]uint64, len(cgroups))
	for _, cg := range cgroups {
		n, err := a.netlog.tap.Handshakes(cg)
		if err != nil {
			return nil
		}
		out[cg] = n
	}
	return out
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
		established, ok := known.conns[c]
		switch {
		case c.Remote.Addr().IsLoopback() || established:
			continue
		case ok:
			out = append(out, fmt.Sprintf("%s -> %s: still connecting at snapshot %s", c.Local, c.Remote, known.snapshot))
		default:
			out = append(out, fmt.Sprintf("%s -> %s: opened after snapshot %s", c.Local, c.Remote, known.snapshot))
		}
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
