package agent

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/interval"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/internal/tickgrid"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/tcpflow"
)

// policyFor returns the interval policy of a job (of the whole host in semi-coordinated mode, where all
// jobs are dumped together), creating it from the job's or the agent's interval setting.
func (a *Agent) policyFor(jobID string) *interval.Policy {
	a.mu.Lock()
	defer a.mu.Unlock()
	key := jobID
	if a.cfg.Checkpoint.Mode == SemiCoordinated {
		key = ""
	}
	if p, ok := a.policies[key]; ok {
		return p
	}
	iv := a.cfg.Checkpoint.Interval
	if j, ok := a.byID[jobID]; ok && key != "" && j.Spec.Interval != "" {
		// Checked again: a restored job's record comes from another node, whose floor may be lower.
		if err := a.cfg.CheckJobInterval(j.Spec.Interval); err != nil {
			a.log.Warn("job's own interval refused here; using this agent's", "job", jobID, "err", err)
		} else {
			iv.UnmarshalText([]byte(j.Spec.Interval))
		}
	}
	// The automatic period keeps checkpoint.min_interval too: a job with a tiny dump would otherwise be
	// snapshotted every few seconds whatever floor the site set for what one user costs the host.
	cfg := interval.Config{Fixed: iv.Fixed, MTBF: a.unpredictedMTBF(), InitialCost: time.Second, Min: a.cfg.Checkpoint.MinInterval.Duration}
	p, err := interval.New(cfg)
	if err != nil { // the configuration was validated; fall back to a safe fixed period
		a.log.Error("interval policy", "err", err)
		p, _ = interval.New(interval.Config{Fixed: time.Minute})
	}
	a.policies[key] = p
	return p
}

// Retries of a job's first snapshot: a job without a replica cannot be recovered, so a failed first
// snapshot (a connection still in the listen queue, say, or no protector answering) is retried after
// firstRetry, doubling up to the job's interval.
const firstRetry = 2 * time.Second

// freezeTimeout bounds how long semi-coordinated mode waits for the jobs' cgroups to freeze. Freezing
// takes milliseconds; a task stuck in uninterruptible sleep (a dead NFS server) can hold it back forever,
// and every job of the host stays stopped meanwhile.
const freezeTimeout = 10 * time.Second

// schedule takes the snapshots: a job's first one as soon as it starts (it cannot be recovered before;
// a young process is small), then one each interval since its last (in semi-coordinated mode all jobs
// at once on the host's interval, and a new job makes the host snapshot now).
func (a *Agent) schedule(ctx context.Context) {
	s := newSnapScheduler(a.cfg.Checkpoint.Mode == SemiCoordinated)
	tickgrid.Every(ctx, 100*time.Millisecond, func() {
		// A job in coordinated mode is snapshotted with its run (scheduleCuts) once its first snapshot is in;
		// a job being replayed by its recovery, by its recovery once the replay is verified (ErrReplaying).
		jobs, _ := a.replays.split(a.Jobs(0))
		jobs = slices.DeleteFunc(jobs, func(j Job) bool { return j.Spec.Recovery == RecoveryCoordinated && j.Protected() })
		due, keys, fresh := s.due(jobs, time.Now(), a.jobInterval)
		for _, id := range fresh {
			a.log.Info("job has no replica yet: snapshotting it now", "job", id)
		}
		if len(keys) == 0 {
			return
		}
		var still func(Job) bool
		if s.onlyForConns(keys) {
			still = a.stillLacksConns
		}
		if _, err := a.checkpoint(ctx, due, 0, still); err != nil {
			a.log.Warn("scheduled snapshot failed; retrying later", "err", err)
		}
		s.attempted(keys, a.Jobs(0), time.Now())
	})
}

// snapScheduler decides when each job (or, in semi-coordinated mode, the host) is due for a snapshot.
type snapScheduler struct {
	semi  bool
	last  map[string]time.Time // last attempt, by key: the job id, or "" for the host in semi-coordinated mode
	tries map[string]int       // attempts since every job of the key had a replica
	seen  map[string]bool      // running jobs already scheduled, by id
	// streak counts the snapshots of a key taken for connections its replica lacked (Job.NewConns) in a
	// row, each gap doubling from newConnGap: a job that opens connections all the time (a service with a
	// connection per request) is snapshotted ever less often, never more than its interval asks.
	streak  map[string]int
	forConn map[string]bool  // keys due now for new connections only
	phaseOf func(Job) uint64 // phase; tests of the interval logic alone put every grid at the epoch's
}

// newConnGap is the shortest time from a snapshot attempt to the next one taken because the job opened
// connections its replica lacks (an MPI library opens them during its first exchanges).
const newConnGap = time.Second

func newSnapScheduler(semi bool) *snapScheduler {
	s := &snapScheduler{semi: semi, last: map[string]time.Time{}, tries: map[string]int{}, seen: map[string]bool{},
		streak: map[string]int{}, forConn: map[string]bool{}}
	s.phaseOf = s.phase
	return s
}

func (s *snapScheduler) key(j Job) string {
	if s.semi {
		return ""
	}
	return j.ID
}

// due returns the jobs to snapshot now (nil in semi-coordinated mode: all of them), the keys that
// attempt covers (none: nothing is due), and the jobs first seen without a replica.
func (s *snapScheduler) due(jobs []Job, now time.Time, interval func(id string) time.Duration) (due, keys, fresh []string) {
	// Keys due for more than new connections: in semi-coordinated mode one job due on its interval makes the
	// host's snapshot one the scheduler must not skip, whatever another job of it opened.
	other := map[string]bool{}
	for _, j := range jobs {
		if j.State != JobRunning {
			delete(s.last, j.ID)
			delete(s.tries, j.ID)
			delete(s.seen, j.ID)
			delete(s.streak, j.ID)
			continue
		}
		key := s.key(j)
		last, ok := s.last[key]
		if !s.seen[j.ID] {
			// When to take a job's first snapshot here: at once if it has no replica; at its replica's age if
			// it has one (adopted by a restarted agent); after an interval for a restored job, whose recovery
			// snapshots it once its peers' bytes are replayed.
			s.seen[j.ID] = true
			switch {
			case needsFirstSnapshot(j):
				last, ok = time.Time{}, true
				fresh = append(fresh, j.ID)
			case j.Protected() && (!ok || j.Replica.Time.Before(last)):
				last, ok = j.Replica.Time, true
			}
		}
		if !ok {
			last = now
		}
		s.last[key] = last
		iv := interval(j.ID)
		uncovered := needsFirstSnapshot(j) || len(j.NewConns) > 0
		if uncovered && s.tries[key] > 0 {
			iv = min(iv, firstRetry<<min(s.tries[key]-1, 16))
		}
		gap := min(iv, newConnGap<<min(s.streak[key], 16))
		next := last.Add(iv)
		if !uncovered {
			next = onGrid(last, iv, s.phaseOf(j))
		}
		switch {
		case !now.Before(next) || needsFirstSnapshot(j) && s.tries[key] == 0:
			due = append(due, j.ID)
			other[key] = true
		case len(j.NewConns) > 0 && s.tries[key] == 0 && now.Sub(last) >= gap:
			due = append(due, j.ID)
			s.forConn[key] = true
		case !uncovered && now.Sub(last) >= 2*gap:
			delete(s.streak, key) // quiet for a while: the next new connection is snapshotted soon again
		}
	}
	for k := range other {
		delete(s.forConn, k)
	}
	if len(due) == 0 {
		return nil, nil, fresh
	}
	if s.semi {
		return nil, []string{""}, fresh // every running job of the host, frozen together
	}
	return due, due, fresh
}

// phase places the grid of j's snapshots (onGrid): the jobs of one run share it, so that ranks started
// apart are dumped together; a job without a run name has one of its own (from its id), so that unrelated
// jobs of a host keep apart; in semi-coordinated mode the host's jobs are dumped together anyway.
func (s *snapScheduler) phase(j Job) uint64 {
	if s.semi {
		return 0
	}
	h := fnv.New64a()
	if j.Spec.Run != "" {
		h.Write([]byte("run\x00" + j.Spec.Run))
	} else {
		h.Write([]byte("job\x00" + j.ID))
	}
	return h.Sum64()
}

// onGrid returns when a job last snapshotted at last is due again on interval iv: the first instant at
// least iv/2 after last on its grid (multiples of iv since the Unix epoch, shifted by phase). Once on the
// grid, its snapshots are iv apart; ranks of one run (one phase, one interval) come to it at the same
// instants on every host (clocks agree to milliseconds under NTP). A tightly coupled job stops whenever
// one rank is frozen: its ranks' snapshots taken one after another stalled it once per rank.
func onGrid(last time.Time, iv time.Duration, phase uint64) time.Time {
	if iv <= 0 {
		return last
	}
	p := int64(phase % uint64(iv))
	earliest := last.Add(iv / 2).UnixNano()
	// The first p + k·iv at or after earliest, without wrapping int64: a job may ask for an interval of a
	// century or more, and (earliest - p + iv - 1) wrapped into the past, which made it due at every tick.
	d := earliest - p // both in [0, MaxInt64]: no wrap
	k := d / int64(iv)
	if k*int64(iv) < d {
		k++ // ceiling (for d < 0 the truncation toward zero is one)
	}
	if k > 0 && k > (math.MaxInt64-p)/int64(iv) {
		return last.Add(iv) // past what UnixNano holds (year 2262): an interval after last will do
	}
	return time.Unix(0, p+k*int64(iv))
}

// onlyForConns reports whether every key in keys is due only for connections its replica lacks.
func (s *snapScheduler) onlyForConns(keys []string) bool {
	for _, k := range keys {
		if !s.forConn[k] {
			return false
		}
	}
	return true
}

// attempted records a snapshot attempt of keys at now, whatever its outcome (a failing job is not
// retried in a tight loop); jobs is the state afterwards: a key whose jobs all have a replica covering
// their connections is back on its interval, one still without is retried after firstRetry, doubling.
func (s *snapScheduler) attempted(keys []string, jobs []Job, now time.Time) {
	for _, k := range keys {
		s.last[k] = now
		if s.forConn[k] {
			s.streak[k]++
			delete(s.forConn, k)
		}
		waiting := false
		for _, j := range jobs {
			if j.State == JobRunning && s.key(j) == k && (needsFirstSnapshot(j) || len(j.NewConns) > 0) {
				waiting = true
			}
		}
		if waiting {
			s.tries[k]++
		} else {
			delete(s.tries, k)
		}
	}
}

// stillLacksConns reports whether a snapshot due only for connections j's replica lacked is still due once
// the previous snapshot is done: not if that one (an operator's, say) took them, nor if it holds them and is
// being shipped.
func (a *Agent) stillLacksConns(j Job) bool { return len(j.NewConns) > 0 && !a.shipping.covers(j) }

// needsFirstSnapshot: the job has no replica and is not a restored job in the hands of its recovery.
func needsFirstSnapshot(j Job) bool { return !j.Protected() && j.Restored == "" }

// recordReplica notes in the job's record that snapshot m reached a protector: from now on a failure of
// this host is recoverable (`ftctl status` shows the job as protected), unless m's connections (or strays,
// those the other snapshots of its freeze do not complete) say otherwise.
func (a *Agent) recordReplica(ctx context.Context, m *ckpt.Manifest, strays []string) {
	// Before a.mu: who holds a job address is asked of the members (and holderOf takes a.mu).
	bad := append(unrecoverableConns(m.Conns, a.ownerLookup(ctx), a.dumpedApart()), strays...)
	bad = append(bad, a.unloggedConns(ctx, m)...)
	v := a.View()
	a.mu.Lock()
	j, ok := a.byID[m.Job]
	if !ok || j.Node != a.cfg.Name || (j.Protected() && j.Replica.Snapshot >= m.ID) {
		a.mu.Unlock()
		return
	}
	first := !j.Protected()
	if j.Replica != nil && j.Replica.Node == a.cfg.Name {
		// The holders of this host's replicas that the new one's do not include (the protector changed: the
		// ring or the run's hosts did, or it did not answer) stay to be told when the job is forgotten: once
		// retention deletes the snapshots naming them, nothing else does, and their copies stayed for good.
		// Not one that failed: it may never answer again, and would keep the ended job's record (counted
		// against its user's, maxEndedJobsPerUser) for good.
		for _, h := range j.Replica.Holders {
			if mem, ok := v.Member(h); ok && mem.State == ring.StateAlive && !slices.Contains(m.Replicas, h) && !slices.Contains(j.Forget, h) {
				j.Forget = append(j.Forget, h)
			}
		}
	}
	j.Replica = &Replica{Snapshot: m.ID, Time: time.Now().UTC(), Node: a.cfg.Name, Holders: append([]string(nil), m.Replicas...), Unrecoverable: bad}
	// The snapshot holds the connections the job had when it was dumped; the next check lists any opened
	// since against it.
	j.NewConns = nil
	a.replicaConns[m.Job] = snapshotConns(m)
	err := a.jobs.save(j)
	a.notify()
	created := j.Created
	a.mu.Unlock()
	if err != nil {
		a.log.Error("save job record", "job", m.Job, "err", err)
	}
	if len(bad) > 0 {
		a.log.Error("job is snapshotted but NOT recoverable: a failure of this host would end in a refusal", "job", m.Job, "snapshot", m.ID, "connections", bad)
	}
	if first {
		a.log.Info("job protected: its first snapshot is replicated", "job", m.Job, "snapshot", m.ID,
			"holders", m.Replicas, "ms_since_start", time.Since(created).Milliseconds())
	}
}

// semiCoordinated freezes every job's cgroup, waits for the bytes in flight between them (awaitInFlight),
// dumps them all while frozen, and thaws them: one consistent snapshot of the host, so traffic between its
// jobs never needs to be logged. With withPeers (jobs are not all of the host's), the running jobs of the
// host that the frozen ones talk to are frozen and dumped with them (localPeers), listed again once they
// are frozen too, until none is left out. It returns the jobs it dumped.
func (a *Agent) semiCoordinated(ctx context.Context, jobs []Job, withPeers bool) ([]Job, []*ckpt.Manifest, error) {
	var start time.Time // of the freeze the jobs are dumped in
	defer a.raised()()  // after the thaw below
	var frozen []string
	thaw := func() {
		for _, cg := range frozen {
			if err := setFrozen(cg, false); err != nil {
				a.log.Error("thaw job cgroup (the job stays frozen until this is fixed)", "cgroup", cg, "err", err)
			}
		}
		frozen = nil
	}
	defer thaw()
	freeze := func(jobs []Job) error {
		for _, j := range jobs {
			if err := setFrozen(j.Cgroup, true); err != nil {
				return fmt.Errorf("freeze job %s: %w", j.ID, err)
			}
			frozen = append(frozen, j.Cgroup)
		}
		if err := waitFrozen(ctx, frozen, freezeTimeout); err != nil {
			return fmt.Errorf("semi-coordinated snapshot skipped, jobs thawed: %w", err)
		}
		return nil
	}
	named, asked := len(jobs), jobs
	var waiting func() ([]netip.AddrPort, error) // the listen queues of the jobs frozen last
	freezeAll := func() error {
		start, jobs = time.Now(), asked
		if err := freeze(jobs); err != nil {
			return err
		}
		// Frozen, the jobs make no new connection; a peer that connects to one of them meanwhile is found at
		// the next listing.
		for withPeers {
			peers, err := a.localPeers(jobs)
			if err != nil {
				return &peerError{fmt.Errorf("semi-coordinated snapshot skipped, jobs thawed: %w", err)}
			}
			if len(peers) == 0 {
				break
			}
			a.log.Info("snapshotting with the jobs named the jobs of this host they talk to", "jobs", jobsOf(jobs), "peers", jobsOf(peers))
			jobs = append(jobs, peers...)
			if err := freeze(peers); err != nil {
				return &peerError{err}
			}
		}
		waiting = a.acceptsWaitingIn(jobs)
		return nil
	}
	// Nor can the frozen jobs accept (freezeAccepted); a connection that comes in after the last look still
	// fails the dump, and the error says so.
	if err := freezeAccepted(ctx, a.acceptWait(), freezeAll, thaw, func() ([]netip.AddrPort, error) { return waiting() }); err != nil {
		if len(jobs) > named && errors.Is(err, criu.ErrInFlight) {
			err = &peerError{err} // the listeners it names may be another user's jobs'
		}
		return nil, nil, err
	}
	if err := a.awaitInFlight(ctx, jobs); err != nil {
		if len(jobs) > named {
			err = &peerError{err} // it may name another user's connections
		}
		return nil, nil, err
	}
	var out []*ckpt.Manifest
	for i, j := range jobs {
		m, err := a.snapshot(ctx, j, true, false)
		if err != nil {
			err = fmt.Errorf("semi-coordinated snapshot of job %s: %w", j.ID, err)
			if i >= named {
				err = &peerError{err}
			}
			return jobs, out, err
		}
		out = append(out, m)
	}
	a.policyFor("").Observe(time.Since(start))
	a.log.Info("host snapshot (semi-coordinated)", "jobs", len(jobs), "frozen_ms", time.Since(start).Milliseconds())
	return jobs, out, nil
}

// raised raises the agent's CPU priority (raise) until release is called. A job the agent keeps frozen waits
// for all of its work, not only CRIU's (heartbeat.nice may put the agent below the jobs).
func (a *Agent) raised() (release func()) {
	if a.raise == nil {
		return func() {}
	}
	return a.raise()
}

// setFrozen writes cgroup v2's cgroup.freeze.
func setFrozen(cgroup string, on bool) error {
	v := "0"
	if on {
		v = "1"
	}
	return os.WriteFile(filepath.Join(cgroup, "cgroup.freeze"), []byte(v), 0)
}

// isFrozen reports whether a freeze of the cgroup is requested (cgroup.freeze), done or not.
func isFrozen(cgroup string) (bool, error) {
	b, err := os.ReadFile(filepath.Join(cgroup, "cgroup.freeze"))
	if err != nil {
		return false, err
	}
	return strings.TrimSpace(string(b)) == "1", nil
}

// waitFrozen waits until cgroup.events says every task of each cgroup is frozen, for at most timeout.
func waitFrozen(ctx context.Context, cgroups []string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for _, cg := range cgroups {
		for {
			b, err := os.ReadFile(filepath.Join(cg, "cgroup.events"))
			if err != nil {
				return fmt.Errorf("read freeze state of %s: %w", cg, err)
			}
			if strings.Contains(string(b), "frozen 1") {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("cgroup %s did not freeze within %s (a task in uninterruptible sleep?)", cg, timeout)
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("cgroup %s did not freeze: %w", cg, ctx.Err())
			case <-time.After(2 * time.Millisecond):
			}
		}
	}
	return nil
}

// unrecoverableConns names the connections of a snapshot that no restore could rebuild, and why. A peer
// outside the cluster runs no agent: nobody logs what it sends, so the bytes it sent after the snapshot
// could never be given back. A peer on this host (apart: on loopback or one of its addresses) that is not
// in the snapshot itself is dumped apart from the job, and what crossed between them reaches no log either:
// after a failure of this host the two snapshots disagree (restore/recovery refuses them). apart is nil
// when the host's jobs are dumped in one freeze (semi-coordinated mode), whose snapshots always agree.
func unrecoverableConns(conns []ckpt.Conn, owner func(netip.Addr) string, apart func(netip.Addr) bool) []string {
	inSnapshot := map[tcpflow.Tuple]bool{}
	for _, c := range conns {
		inSnapshot[c.Tuple] = true
	}
	var out []string
	for _, c := range conns {
		ip := c.Remote.Addr().Unmap()
		switch {
		case apart != nil && !inSnapshot[c.Reverse()] && apart(ip):
			out = append(out, fmt.Sprintf("%s -> %s: the peer is another process of this host, dumped apart from this job, and nothing logs what crosses the host's own interface (snapshots of one freeze restore both ends: checkpoint.mode = \"semi-coordinated\")", c.Local, c.Remote))
		case ip.IsLoopback() || owner(ip) != "":
		default:
			out = append(out, fmt.Sprintf("%s -> %s: the peer is not a cluster member, so nobody logs what it sends", c.Local, c.Remote))
		}
	}
	return out
}

// strayLocalConns names, by snapshot, the connections of ms (the snapshots of one semi-coordinated freeze)
// that a restore of exactly ms would not rebuild although their other end was a process of this host
// (onHost): a process in none of the frozen jobs (a program not started under ftkit), or, should the
// freeze have caught one, a connect pending in one snapshot and accepted in the other. No log sees what
// crosses the host's own interface, so the recovery of this host would refuse the job.
func strayLocalConns(ms []*ckpt.Manifest, onHost func(netip.Addr) bool) map[string][]string {
	parts := make([]ckpt.Part, len(ms))
	ids := map[string]string{}
	for i, m := range ms {
		parts[i] = ckpt.Part{Job: m.Job, Conns: m.Conns}
		ids[m.Job] = m.ID
	}
	out := map[string][]string{}
	for _, mm := range ckpt.Match(parts, func(c ckpt.Conn) bool { return onHost(c.Remote.Addr()) }) {
		why := fmt.Sprintf("%s -> %s: %s", mm.Conn.Local, mm.Conn.Remote, mm.Why)
		if mm.Peer == "" {
			why = fmt.Sprintf("%s -> %s: the peer is a process of this host in no job snapshotted with this one (not started under ftkit?), "+
				"and nothing logs what crosses the host's own interface (run it as a job of this host, or on another host)", mm.Conn.Local, mm.Conn.Remote)
		}
		out[ids[mm.Job]] = append(out[ids[mm.Job]], why)
	}
	return out
}

// onThisHost says whether a peer at ip is on this host: loopback, one of the host addresses it holds, or the
// address of one of its running jobs (job networks on one host reach each other inside it, never through
// the logged interface: macvlan bridge mode).
func (a *Agent) onThisHost(ip netip.Addr) bool {
	ip = ip.Unmap()
	if ip.IsLoopback() {
		return true
	}
	if owner, ok := a.View().Owner(ip); ok {
		return owner == a.cfg.Name
	}
	return a.runsJobAddr(ip)
}

// dumpedApart is onThisHost where each job is dumped on its own (uncoordinated mode), nil where the host's
// jobs are dumped together.
func (a *Agent) dumpedApart() func(netip.Addr) bool {
	if a.cfg.Checkpoint.Mode == SemiCoordinated {
		return nil
	}
	return a.onThisHost
}
