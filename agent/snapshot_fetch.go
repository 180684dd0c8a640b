package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/filecopy"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/spare"
)

// locateAnswer tells which job a snapshot id a member holds belongs to, and its owner (from the job
// record in the snapshot), so that a restore can be refused before the snapshot is fetched.
type locateAnswer = clusterapi.LocateReply

// locateReply answers opLocate for a snapshot this host holds (an empty Job if it holds none).
func (a *Agent) locateReply(id string) locateAnswer {
	r := locateAnswer{ID: id, Job: a.localJobOfSnapshot(id)}
	if r.Job == "" {
		return r
	}
	if m, err := a.store.Manifest(r.Job, id); err == nil {
		if j, err := a.snapshotJob(m); err == nil && j.ID == r.Job {
			r.UID = &j.UID
		}
	}
	return r
}

// findJobOfSnapshot finds the job a snapshot id belongs to, and its owner, at the members that answer:
// only source if given, else the snapshot's node's protector first, then any alive member. Members are
// asked at once, and the first in that order that holds it wins as soon as every earlier one has said no
// (a dead member costs the wait only when nobody before it holds the snapshot). It returns the answer and
// the member that gave it (an empty Job if none holds it).
func (a *Agent) findJobOfSnapshot(ctx context.Context, id, source string) (locateAnswer, string) {
	members := a.fetchCandidates(id, source, "")
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	type result struct {
		i int
		r locateAnswer
	}
	results := make(chan result, len(members))
	for i, name := range members {
		go func() {
			r := a.remoteJobOfSnapshot(ctx, name, id)
			// What another node says is checked before it names a directory or an owner.
			if r.ID != id || ckpt.ValidName(r.Job) != nil {
				r = locateAnswer{}
			}
			results <- result{i, r}
		}()
	}
	answers := make([]*locateAnswer, len(members))
	for range members {
		res := <-results
		answers[res.i] = &res.r
		for i, r := range answers {
			if r == nil {
				break
			}
			if r.Job != "" {
				return *r, members[i]
			}
		}
	}
	return locateAnswer{}, ""
}

func (a *Agent) localJobOfSnapshot(id string) string {
	jobs, _ := a.store.Jobs()
	for _, job := range jobs {
		if _, err := a.store.Manifest(job, id); err == nil {
			return job
		}
	}
	return ""
}

// holdsSnapshot reports whether this host's store has the snapshot (verified or not).
func (a *Agent) holdsSnapshot(job, id string) bool {
	_, err := a.store.Manifest(job, id)
	return err == nil
}

func (a *Agent) remoteJobOfSnapshot(ctx context.Context, member, id string) locateAnswer {
	r, err := a.peers().Locate(ctx, member, clusterapi.LocateRequest{ID: id})
	if err != nil || r.ID != id {
		return locateAnswer{}
	}
	return r
}

// fetch copies a snapshot from the member that holds it: source if given, else prefer (the member that
// said it holds it), the snapshot's node's protector (where replicas live), then any member that has it.
// A transfer of the snapshot already under way (a claimed spare's prefetch) is waited for, not raced: two
// writers of one snapshot refuse each other (ci303: a coordinated rollback's fetch on the spare met the
// prefetch, and the rollback failed).
func (a *Agent) fetch(ctx context.Context, job, id, source, prefer string) error {
	if _, err := ckpt.ParseID(id); err != nil {
		return err
	}
	var errs []error
	for _, from := range a.fetchCandidates(id, source, prefer) {
		err := a.fetchOnce(ctx, from, job, id)
		if err == nil {
			return nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", from, err))
	}
	if len(errs) == 0 {
		errs = append(errs, errors.New("no other member is alive"))
	}
	return fmt.Errorf("fetch snapshot %s of job %s: %w", id, job, errors.Join(errs...))
}

// fetchCandidates orders the members to ask for snapshot id: only source if given, else prefer, the
// snapshot's node's protector, then the other alive members.
func (a *Agent) fetchCandidates(id, source, prefer string) []string {
	if source != "" {
		return []string{source}
	}
	var out []string
	add := func(name string) {
		if name != "" && name != a.cfg.Name && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	add(prefer)
	v := a.View()
	if sid, err := ckpt.ParseID(id); err == nil {
		if p, ok := v.Protector(sid.Node); ok {
			add(p.Name)
		}
	}
	for _, m := range v.Members {
		if m.State == ring.StateAlive {
			add(m.Name)
		}
	}
	return out
}

// fetchCalls are the snapshot transfers to this host under way (fetchOnce).
type fetchCalls struct {
	mu         sync.Mutex
	m          map[string]*fetchCall // by job/snapshot
	prefetched map[string]prefetched // by job/snapshot: prefetched for a claimed recovery no recovery used yet
}

// prefetched records where a snapshot prefetched for a claim came from.
type prefetched struct {
	from    string // the member it came from
	failure string // the claim's failure
}

// takePrefetched is the member a snapshot was prefetched from, if it was, and forgets it: the recovery
// that uses the snapshot asks once, so the record holds only prefetches no recovery used yet.
func (a *Agent) takePrefetched(job, id string) (string, bool) {
	a.fetching.mu.Lock()
	defer a.fetching.mu.Unlock()
	a.forgetPrefetchesOfOtherClaims()
	key := job + "/" + id
	p, ok := a.fetching.prefetched[key]
	delete(a.fetching.prefetched, key)
	return p.from, ok
}

// forgetPrefetchesOfOtherClaims drops the record of prefetches for claims this host no longer holds (under
// fetching.mu): no recovery of theirs can come (checkRecoverRequest), and kept, every abandoned claim's
// prefetches stayed recorded for good.
func (a *Agent) forgetPrefetchesOfOtherClaims() {
	if len(a.fetching.prefetched) == 0 {
		return // nothing to forget (and no claim to ask of a host that never prefetched)
	}
	cur, held := a.claims.Current()
	for key, p := range a.fetching.prefetched {
		if !held || p.failure != cur.Failure {
			delete(a.fetching.prefetched, key)
		}
	}
}

// holdsClaim reports whether this host is claimed for failure.
func (a *Agent) holdsClaim(failure string) bool {
	cur, ok := a.claims.Current()
	return ok && cur.Failure == failure
}

type fetchCall struct {
	done    chan struct{}
	err     error
	waiters int // callers waiting for it (under fetchCalls.mu)
}

// fetchOnce fetches snapshot id of job from member from, or waits for the transfer of that snapshot already
// under way (a claimed spare's prefetch, which the recovery then finds done or nearly so). If that one
// failed, it fetches the snapshot itself.
func (a *Agent) fetchOnce(ctx context.Context, from, job, id string) error {
	return a.fetchOnceMax(ctx, from, job, id, 0)
}

// fetchOnceMax is fetchOnce with a bound on the snapshot's bytes, if maxBytes > 0, for a transfer it
// starts: a larger snapshot is refused by its manifest, before any file (ship.ReceiveOptions).
func (a *Agent) fetchOnceMax(ctx context.Context, from, job, id string, maxBytes int64) error {
	key := job + "/" + id
	for {
		a.fetching.mu.Lock()
		c, busy := a.fetching.m[key]
		if busy {
			c.waiters++
		} else {
			c = &fetchCall{done: make(chan struct{})}
			if a.fetching.m == nil {
				a.fetching.m = map[string]*fetchCall{}
			}
			a.fetching.m[key] = c
		}
		a.fetching.mu.Unlock()
		if !busy {
			c.err = a.fetchFrom(ctx, from, job, id, maxBytes)
			a.fetching.mu.Lock()
			delete(a.fetching.m, key)
			a.fetching.mu.Unlock()
			close(c.done)
			return c.err
		}
		select {
		case <-c.done:
		case <-ctx.Done():
			return ctx.Err()
		}
		if c.err == nil {
			return nil
		}
	}
}

// prefetch fetches the snapshots a claim for a failure names (this host is the claimed spare), one after
// another, unless this host holds them already: the protector waits for the failed node's fence
// meanwhile, and the recovery finds them here, or waits for the transfer under way (fetchOnce) instead of
// starting another. A snapshot that cannot be fetched now is left to the recovery. It stops once the claim
// is no longer held. It has no deadline of its own: each transfer is bounded by its manifest
// (receiveFetch), and there are at most as many as the claim's jobs; a fixed 30 minutes cut off the
// prefetch of every snapshot larger than a link carries in that time, and the recovery fetched it again.
func (a *Agent) prefetch(cl spare.Claim) {
	ctx := context.Background()
	start := time.Now()
	var fetched []string
	// The list comes from the claimer, another member: only what the failed node's recovery can restore is
	// fetched (a snapshot taken on the failed node, or on a failed member whose jobs it was restoring, as
	// checkTakenFrom allows), one per job, for at most the jobs and bytes the claim says they need (the
	// memory this host checked it has). Otherwise any claimer could have the spare pull up to MaxPrefetch
	// snapshots of any member's jobs, each as large as a receiver takes.
	v := a.View()
	jobs := map[string]bool{}
	budget := cl.Need.MemoryBytes
	for _, p := range cl.Prefetch {
		if !a.holdsClaim(cl.Failure) {
			// Its recovery will not come: the next claim's prefetch and recovery get the link and the disk.
			a.log.Info("claim no longer held: its prefetch stops", "failure", cl.Failure, "by", cl.By)
			break
		}
		if ckpt.ValidName(p.Job) != nil || p.Source == a.cfg.Name || jobs[p.Job] || len(jobs) >= cl.Need.Jobs || budget <= 0 {
			continue
		}
		sid, err := ckpt.ParseID(p.Snapshot)
		if err != nil {
			continue
		}
		if m, ok := v.Member(sid.Node); sid.Node != cl.Failed && (!ok || m.State != ring.StateFailed) {
			a.log.Warn("claim names a snapshot to prefetch of a node that has not failed: not fetched", "failure", cl.Failure, "by", cl.By,
				"failed", cl.Failed, "job", p.Job, "snapshot", p.Snapshot)
			continue
		}
		jobs[p.Job] = true
		if _, err := a.store.Manifest(p.Job, p.Snapshot); err == nil {
			continue // here already
		}
		if err := a.fetchOnceMax(ctx, p.Source, p.Job, p.Snapshot, budget); err != nil {
			a.log.Warn("prefetch for a claimed recovery failed: the recovery fetches the snapshot itself", "failure", cl.Failure, "job", p.Job, "snapshot", p.Snapshot, "from", p.Source, "err", err)
			continue
		}
		fetched = append(fetched, p.Snapshot)
		if m, err := a.store.Manifest(p.Job, p.Snapshot); err == nil {
			budget -= m.TotalSize()
		}
		a.fetching.mu.Lock()
		a.forgetPrefetchesOfOtherClaims()
		if a.holdsClaim(cl.Failure) {
			if a.fetching.prefetched == nil {
				a.fetching.prefetched = map[string]prefetched{}
			}
			a.fetching.prefetched[p.Job+"/"+p.Snapshot] = prefetched{from: p.Source, failure: cl.Failure}
		}
		a.fetching.mu.Unlock()
	}
	if len(fetched) > 0 {
		a.log.Info("snapshots prefetched while the failed node is fenced", "failure", cl.Failure, "snapshots", fetched, "ms", time.Since(start).Milliseconds())
	}
}

// fetchFrom fetches snapshot id of job from member from; maxBytes > 0 bounds its size. It sets no deadline
// of its own: the request is bounded by the message timeout (clusterapi), and the transfer as a protector's
// receive is, by its manifest (receiveFetch). A fixed 10 minutes cut off every snapshot larger than a link
// carries in that time (60 GB at 100 MB/s), from every holder in turn, and the job could not be restored.
func (a *Agent) fetchFrom(ctx context.Context, from, job, id string, maxBytes int64) error {
	c, err := a.peers().Fetch(ctx, from, clusterapi.FetchRequest{Job: job, ID: id})
	if err != nil {
		return err
	}
	defer c.Close()
	return a.receiveFetch(ctx, c, from, job, id, maxBytes)
}

// receiveFetch stores what arrives on a fetch connection to member from (the request for snapshot id of
// job already sent) if it is that snapshot: a member sends whatever it has under the name asked for, so
// anything else is refused before a file moves. The transfer sets its own deadlines: ship's idle timeout
// (a.wire.Idle only when a test shortens it) until the manifest, which the holder sends before reading any
// file, then the bound the manifest's size gives (ship.ReceiveOptions.PerMiB), within ctx. maxBytes > 0
// bounds the snapshot's size (0: ship's default).
func (a *Agent) receiveFetch(ctx context.Context, c io.ReadWriter, from, job, id string, maxBytes int64) error {
	got, err := ship.Receive(ctx, c, a.store, ship.ReceiveOptions{Peer: from, Authorize: expectSnapshot(job, id), ShareBlocks: a.cfg.Checkpoint.ShareBlocks,
		Logger: a.log, IdleTimeout: a.wire.Idle, MaxSnapshotBytes: maxBytes})
	if err != nil {
		return err
	}
	a.noteReceived(job, id)
	a.log.Info("snapshot fetched", "job", job, "snapshot", id, "from", from, "bytes", got.Bytes, "ms", got.Duration.Milliseconds())
	return nil
}

// expectSnapshot is the Authorize policy of a fetch: the manifest received must be the job and snapshot
// asked for, taken on the node the snapshot id names.
func expectSnapshot(job, id string) func(*ckpt.Manifest) error {
	node := ""
	if sid, err := ckpt.ParseID(id); err == nil {
		node = sid.Node
	}
	return func(m *ckpt.Manifest) error {
		if m.Job != job || m.ID != id {
			return fmt.Errorf("asked for snapshot %s of job %s, received %s of job %s", id, job, m.ID, m.Job)
		}
		if node != "" && m.Node != node {
			return fmt.Errorf("snapshot %s names node %s but its manifest says %s", id, node, m.Node)
		}
		return nil
	}
}

// serveFetch ships a snapshot this host holds to the member that asked for it.
func (a *Agent) serveFetch(ctx context.Context, c net.Conn, peer string, req clusterapi.FetchRequest) error {
	// The transfer sets its own deadlines: ship's idle timeout (a.wire.Idle only when a test shortens it).
	_, err := ship.Send(ctx, c, a.store, req.Job, req.ID, ship.SendOptions{Peer: peer, Logger: a.log, IdleTimeout: a.wire.Idle})
	return err
}

// linkTree hard-links (or copies, across file systems) every file of src into a fresh dst (0700), so
// that CRIU's restore log and image edits never touch the verified snapshot. Anything but regular files
// and directories is refused: a verified snapshot holds nothing else.
func linkTree(src, dst string) error {
	os.RemoveAll(dst)
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		target := filepath.Join(dst, rel)
		switch {
		case d.IsDir():
			return os.MkdirAll(target, 0o700)
		case !d.Type().IsRegular():
			return fmt.Errorf("%s is not a regular file", p)
		}
		if err := os.Link(p, target); err == nil {
			return nil
		}
		in, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
		if err != nil {
			return err
		}
		defer in.Close()
		st, err := in.Stat()
		if err != nil {
			return err
		}
		return filecopy.PrefixToNew(target, in, st.Size())
	})
}
