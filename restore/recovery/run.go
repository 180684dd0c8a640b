package recovery

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/tcpflow"
)

// Run restores a failed node's jobs on this host, in this order: fetch each job's snapshot (falling back
// to the next candidate), plan from the peers' logs and live state and rewrite the images, prepare the
// network (guard the connections, take over the failed node's addresses, clamp the peers' ACKs, raise
// the initial congestion window, lower the path MTU), restore each job, put the path MTU back (the
// restored sockets then send full-size segments), announce the addresses, wait until the restored jobs
// have re-sent what their peers already had and check every re-sent byte (killing a job that fails),
// then snapshot the verified jobs again (re-protection). Every step is reported through emit.
//
// The jobs are fetched and planned at once, and restored at once (at most d.ParallelJobs at a time): a node's
// recovery takes as long as its slowest job, not the sum. Every job's connections are guarded before the
// first job is restored, so a restored job that talks to another job of the failed node meets a guard,
// not a missing socket (which would reset the connection), until that job is back too.
func Run(ctx context.Context, req clusterapi.RecoverRequest, d Deps, emit func(Stage)) error {
	var emitMu sync.Mutex // jobs report their stages from several goroutines
	stage := func(name, job string, start time.Time, detail string, err error) {
		emitMu.Lock()
		defer emitMu.Unlock()
		emit(Stage{Name: name, Job: job, Start: start, End: time.Now(), Detail: detail, Err: err})
	}
	parallel := d.ParallelJobs
	if parallel <= 0 {
		parallel = DefaultParallelJobs
	}
	// A job named twice would be fetched, claimed (a holder's claim of the same incarnation succeeds again,
	// as a retried request's) and restored twice at once here: two copies of it, or one whose failed twin
	// then takes down the guard, the network and the record of the copy that runs.
	named := make(map[string]bool, len(req.Jobs))
	for _, rj := range req.Jobs {
		if named[rj.Job] {
			return fmt.Errorf("the recovery request names job %s twice: refused, nothing restored (a job restored twice runs twice); check the coordinator's version and its records", rj.Job)
		}
		named[rj.Job] = true
	}
	// Errors are kept per job and joined in the request's order, whatever order the jobs finish in.
	// Every snapshot first, then the plans: a connection to another job of the failed node (on its host's
	// address, or on that job's own) is known as one only once that job's snapshot is in.
	prepared := make([]*Job, len(req.Jobs))
	prepErrs := make([]error, len(req.Jobs))
	inParallel(len(req.Jobs), parallel, func(i int) {
		prepared[i], prepErrs[i] = fetchJob(ctx, d, req, req.Jobs[i], stage)
	})
	local := onFailedNode(req, prepared)
	inParallel(len(req.Jobs), parallel, func(i int) {
		if prepared[i] != nil {
			prepared[i], prepErrs[i] = planJob(ctx, d, prepared[i], local, stage)
		}
	})
	errs := slices.DeleteFunc(prepErrs, func(err error) bool { return err == nil })
	jobs := slices.DeleteFunc(prepared, func(j *Job) bool { return j == nil })
	jobs, tornErrs := refuseTorn(ctx, d, jobs, local, stage)
	errs = append(errs, tornErrs...)
	if len(jobs) == 0 {
		return errors.Join(append(errs, errors.New("no job could be prepared"))...)
	}
	putBackMTU, putBackCwnd, err := prepareNetwork(ctx, d, req, jobs)
	if err != nil {
		for _, j := range jobs {
			discard(ctx, d, j)
		}
		return errors.Join(append(errs, err)...)
	}
	d.Tracker.Persist(jobs)
	restoreErrs := make([]error, len(jobs))
	inParallel(len(jobs), parallel, func(i int) {
		restoreErrs[i] = restoreJob(ctx, d, jobs[i], stage)
	})
	var restored []*Job
	for i, j := range jobs {
		if restoreErrs[i] != nil {
			errs = append(errs, restoreErrs[i])
			continue
		}
		restored = append(restored, j)
	}
	putBackMTU()
	for _, ip := range req.Addrs {
		if err := d.Network.Announce(ctx, ip); err != nil {
			d.Logger.Warn("gratuitous ARP failed; peers find the address when their neighbour entries expire", "addr", ip, "err", err)
		}
	}
	// A moved job address: peers with a connection find it at the first round trip, others (a new
	// connection, a router) only once told (docs/job-addresses.md, fact a).
	for _, j := range restored {
		if j.Net == nil {
			continue
		}
		if err := j.Net.Announce(ctx, j.Net.Addr()); err != nil {
			d.Logger.Warn("gratuitous ARP for a job address failed; peers find it when their neighbour entries expire", "job", j.ID, "addr", j.Net.Addr(), "err", err)
		}
	}
	orphans := orphaned(restored, jobs, restoreErrs, local)
	var verified []string
	for _, j := range restored {
		var detail string
		err, orphan := orphans[j.ID]
		if orphan {
			refuse(d, j, err)
			j.stopKeeping()
		} else {
			detail, err = ReplayAndVerify(ctx, d, j)
		}
		stage(StageReplayed, j.ID, j.RestoredAt, detail, err)
		if err != nil && ctx.Err() != nil && !orphan {
			errs = append(errs, fmt.Errorf("job %s: %w", j.ID, err)) // left running, for the next agent
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("job %s is not transparently recoverable (killed): %w", j.ID, err))
			continue
		}
		d.Tracker.SetPhase(j.ID, PhaseReplayed, time.Time{})
		verified = append(verified, j.ID)
	}
	putBackCwnd()
	if len(verified) > 0 {
		start := time.Now()
		detail, err := d.Jobs.Reprotect(ctx, verified)
		stage(StageProtected, "", start, detail, err)
		if err != nil {
			errs = append(errs, fmt.Errorf("re-protect: %w", err))
		}
	}
	return errors.Join(errs...)
}

// orphaned says which restored jobs lost the other end of a connection to another job of the failed node
// (local) because that job's restore failed (restoreErrs, by index into jobs), directly or through another
// such job, and why. Its guard gone, the restored job's segments meet no socket and this host resets the
// connection: the job then runs on with a reset the failure-free run never had, and nothing checks that
// connection's bytes (they crossed the failed node's own interface, which no log sees).
func orphaned(restored, jobs []*Job, restoreErrs []error, local func(ckpt.Conn) bool) map[string]error {
	gone := map[tcpflow.Tuple]string{} // the connections of the jobs that are not back, by job
	for i, j := range jobs {
		if restoreErrs[i] != nil {
			for _, c := range j.Manifest.Conns {
				gone[c.Tuple] = j.ID
			}
		}
	}
	orphans := map[string]error{}
	for more := len(gone) > 0; more; {
		more = false
		for _, j := range restored {
			if _, done := orphans[j.ID]; done {
				continue
			}
			for _, c := range j.Manifest.Conns {
				peer, ok := gone[c.Reverse()]
				if !ok || peer == j.ID || !local(c) {
					continue
				}
				orphans[j.ID] = fmt.Errorf("connection %s -> %s to job %s, which is not restored: the connection is reset here, as it never was in the failed node's run: %w",
					c.Local, c.Remote, peer, restore.ErrNotRecoverable)
				for _, c := range j.Manifest.Conns {
					gone[c.Tuple] = j.ID
				}
				more = true
				break
			}
		}
	}
	return orphans
}

// DefaultParallelJobs is how many jobs Run fetches and plans, and then restores, at once unless
// Deps.ParallelJobs says otherwise.
const DefaultParallelJobs = 4

// inParallel calls fn(i) for every i in [0, n), at most limit at a time, and returns when all returned.
func inParallel(n, limit int, fn func(i int)) {
	sem := make(chan struct{}, limit)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			fn(i)
		})
	}
	wg.Wait()
}

// fetchJob fetches one job's snapshot and claims its next incarnation; nil and why if none can be had.
func fetchJob(ctx context.Context, d Deps, req clusterapi.RecoverRequest, rj clusterapi.RecoverJob, stage stageFunc) (*Job, error) {
	start := time.Now()
	j, failed, err := fetch(ctx, d, req, rj)
	detail := ""
	if j != nil {
		detail = fmt.Sprintf("%d MB from %s (snapshot %s, incarnation %d)", j.Manifest.TotalSize()>>20, j.Source, j.Manifest.ID, j.Incarnation)
	}
	if len(failed) > 0 {
		detail = strings.TrimPrefix(detail+"; failed before: "+strings.Join(failed, "; "), "; ")
	}
	stage(StageFetched, rj.Job, start, detail, err)
	if err != nil {
		return nil, fmt.Errorf("job %s: %w", rj.Job, err)
	}
	return j, nil
}

// planJob plans a fetched job's connections from the peers' logs (those local selects aside) and rewrites
// its images; nil and why if it cannot be restored.
func planJob(ctx context.Context, d Deps, j *Job, local func(ckpt.Conn) bool, stage stageFunc) (*Job, error) {
	start := time.Now()
	err := plan(ctx, d, j, local)
	if err == nil {
		err = restore.Rewrite(j.Work, j.Plan)
	}
	stage(StageRewritten, j.ID, start, PlanSummary(j.Plan), err)
	if err != nil {
		discard(ctx, d, j)
		return nil, fmt.Errorf("job %s is not transparently recoverable: %w", j.ID, err)
	}
	return j, nil
}

// onFailedNode selects the connections whose other end was on the failed node too: on loopback (the job's
// own, or its host's for jobs without a network of their own), on one of the node's host addresses, or on
// the job address of one of its jobs restored here (jobs: the fetched ones, nil for the others).
func onFailedNode(req clusterapi.RecoverRequest, jobs []*Job) func(ckpt.Conn) bool {
	addrs := slices.Clone(req.Addrs)
	for _, j := range jobs {
		if j != nil && j.Net != nil {
			addrs = append(addrs, j.Net.Addr())
		}
	}
	return func(c ckpt.Conn) bool {
		ip := c.Remote.Addr().Unmap()
		return ip.IsLoopback() || slices.Contains(addrs, ip)
	}
}

// refuseTorn drops the jobs whose connections to other jobs of the failed node their snapshots alone cannot
// rebuild (ckpt.Match), and then the jobs connected to a dropped one, until the rest agree. plan leaves such
// connections out: their bytes crossed the failed host's own interface, which no log sees, so both ends come
// from the jobs' snapshots. Snapshots of one semi-coordinated freeze always agree; snapshots taken one job at
// a time rarely do, and restored as they are the two jobs wait forever for bytes neither holds. Each
// dropped job is discarded and gets a failed "restored" stage saying why.
func refuseTorn(ctx context.Context, d Deps, jobs []*Job, local func(ckpt.Conn) bool, stage stageFunc) ([]*Job, []error) {
	why := map[string][]string{}
	torn, stray := map[string]bool{}, map[string]bool{} // the jobs with each kind of refused connection
	droppedEnd := map[tcpflow.Tuple]string{}            // the connections of the jobs dropped so far, by job
	for {
		parts := make([]ckpt.Part, len(jobs))
		for i, j := range jobs {
			parts[i] = ckpt.Part{Job: j.ID, Conns: j.Manifest.Conns}
		}
		ms := ckpt.Match(parts, local)
		if len(ms) == 0 {
			break
		}
		for _, m := range ms {
			conn := fmt.Sprintf("connection %s -> %s", m.Conn.Local, m.Conn.Remote)
			if peer, ok := droppedEnd[m.Conn.Reverse()]; ok {
				why[m.Job] = append(why[m.Job], fmt.Sprintf("%s to job %s, which is refused", conn, peer))
				continue
			}
			if m.Peer == "" {
				why[m.Job] = append(why[m.Job], conn+": its other end was on the failed node too, in no job restored with it")
				stray[m.Job] = true
				continue
			}
			why[m.Job] = append(why[m.Job], fmt.Sprintf("%s to job %s: %s", conn, m.Peer, m.Why))
			torn[m.Job] = true
			if m.Peer != m.Job {
				why[m.Peer] = append(why[m.Peer], fmt.Sprintf("connection %s -> %s to job %s: %s", m.Conn.Remote, m.Conn.Local, m.Job, m.Why))
				torn[m.Peer] = true
			}
		}
		jobs = slices.DeleteFunc(jobs, func(j *Job) bool {
			if _, bad := why[j.ID]; !bad {
				return false
			}
			for _, c := range j.Manifest.Conns {
				droppedEnd[c.Tuple] = j.ID
			}
			discard(ctx, d, j)
			return true
		})
	}
	var errs []error
	for _, id := range slices.Sorted(maps.Keys(why)) {
		var remedy []string
		if torn[id] {
			remedy = append(remedy, "the snapshots of jobs that talk to each other on one host must be taken together, checkpoint.mode = \"semi-coordinated\"")
		}
		if stray[id] {
			remedy = append(remedy, "a peer on the same host must run as a job of that host, or of a host of its own")
		}
		cause := ""
		if len(remedy) > 0 {
			cause = fmt.Sprintf(" (no log holds what crosses a host's own interface: %s)", strings.Join(remedy, "; "))
		}
		err := fmt.Errorf("job %s is not transparently recoverable: %s%s: %w", id, strings.Join(why[id], "; "), cause, restore.ErrNotRecoverable)
		stage(StageRestored, id, time.Now(), "", err)
		errs = append(errs, err)
	}
	return jobs, errs
}

// discard drops a prepared job that will not be restored: its working copy, and its claimed incarnation.
func discard(ctx context.Context, d Deps, j *Job) {
	removeWork(d, j.Work)
	d.Jobs.GiveBack(ctx, j)
}

// removeWork removes a restore's working copy of a snapshot, saying so if it stays: it holds the job's
// memory, and nothing else removes it.
func removeWork(d Deps, dir string) {
	if err := criu.RemoveWorkDir(dir); err != nil {
		d.Logger.Warn("could not remove a restore's working copy of a snapshot; remove it by hand", "dir", dir, "err", err)
	}
}

// restoreJob restores one prepared job under its guard, or undoes what its preparation left (the guard,
// its job network, its claimed incarnation unless processes may have started).
func restoreJob(ctx context.Context, d Deps, j *Job, stage stageFunc) error {
	start := time.Now()
	j.stopKeeping = d.Log.Keep(j.Plan)
	var events <-chan intercept.Event
	stopEvents := func() {}
	if j.gate != nil {
		events, stopEvents = d.Determinants.Watch(j.ID) // before the job runs: none of its calls is missed
	}
	err := d.Jobs.Restore(ctx, j)
	j.RestoredAt = time.Now()
	if err == nil && j.gate != nil {
		startGate(ctx, d, j, events, stopEvents)
	}
	if err == nil {
		j.finErr = deliverFins(ctx, d, j)
	}
	stage(StageRestored, j.ID, start, "", err)
	if err != nil {
		stopEvents()
		endHold(d, j)
		// No socket here re-sends anything: a peer's ACKs lowered on would also lower those of the RSTs
		// this host sends it, which the peer ignores, and it would wait instead of failing.
		if d.Clamp != nil {
			for _, c := range j.Plan.Conns {
				if c.Resend > 0 {
					d.Clamp.Release(c.Conn.Tuple)
				}
			}
		}
		j.stopKeeping()
		d.Tracker.SetPhase(j.ID, "", time.Time{})
		// Undone even when the restore failed because ctx ended (the agent stops): a guard left up drops
		// the job's flows and new connections to its address for good.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
		defer cancel()
		if err := netOf(d, j).Unguard(cctx, j.RunID); err != nil {
			d.Logger.Warn("could not remove the network guard of a job whose restore failed: its flows stay dropped", "job", j.ID, "err", err)
		}
		if j.Net != nil {
			if err := j.Net.Delete(cctx); err != nil {
				d.Logger.Warn("could not delete the network of a job whose restore failed: its address stays on the wire", "job", j.ID, "err", err)
				d.Jobs.NetLeft(j, err) // logged only, it was never deleted again, and its address went to the next job
			}
		}
		d.Jobs.GiveBackUnlessStarted(cctx, j, err)
		return fmt.Errorf("job %s: %w", j.ID, err)
	}
	d.Tracker.SetPhase(j.ID, PhaseRestored, j.RestoredAt)
	return nil
}

// FinConn is a restored connection whose peer closed it after the snapshot: the peer's FIN goes to the
// restored socket at Seq, where the peer's data ends (part of the agent's on-disk recovery record, for a
// recovery resumed by a restarted agent).
type FinConn struct {
	tcpflow.Tuple
	Seq     uint32 `json:"seq"`
	OutqSeq uint32 `json:"outq_seq"`
}

// Fins lists j's connections whose peers closed them after the snapshot.
func Fins(j *Job) []FinConn {
	var fins []FinConn
	for _, c := range j.Plan.Conns {
		if c.Fin {
			fins = append(fins, FinConn{Tuple: c.Conn.Tuple, Seq: c.Conn.InqSeq + uint32(len(c.Inject)), OutqSeq: c.Conn.OutqSeq})
		}
	}
	return fins
}

// deliverFins delivers to j's restored sockets the FINs their peers sent after the snapshot: the images
// hold the peers' bytes up to them, never the FIN.
func deliverFins(ctx context.Context, d Deps, j *Job) error {
	var errs []error
	for _, c := range Fins(j) {
		errs = append(errs, deliverFin(ctx, d, netOf(d, j), c, j.peers[c.Tuple].Live))
	}
	return errors.Join(errs...)
}

// ResumeFins delivers the FINs of fins to restored job j, for a recovery resumed by a restarted agent,
// which may have died before it delivered them: a socket that took its FIN already is left alone
// (restore.DeliverFIN). The peers' live state is asked again. A FIN that cannot be delivered makes
// ReplayAndVerify refuse the job, as in the recovery that restored it.
func ResumeFins(ctx context.Context, d Deps, net Network, j *Job, fins []FinConn) {
	var errs []error
	for _, c := range fins {
		owner := d.Peers.Owner(ctx, c.Remote.Addr())
		if owner == "" {
			errs = append(errs, fmt.Errorf("connection %s -> %s: the peer closed it after the snapshot, and no member holds the peer to deliver its FIN", c.Local, c.Remote))
			continue
		}
		// From where its data ends: the peer's live state, and no bytes.
		qctx, cancel := context.WithTimeout(ctx, time.Minute)
		reply, _, err := logRange(qctx, d.Peers, owner, c.Tuple, c.Seq)
		cancel()
		if err == nil && reply.Live == nil {
			err = fmt.Errorf("%s has no live state of it", owner)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("connection %s -> %s: the peer closed it after the snapshot, and its FIN could not be delivered: %w", c.Local, c.Remote, err))
			continue
		}
		errs = append(errs, deliverFin(ctx, d, net, c, *reply.Live))
	}
	j.finErr = errors.Join(errs...)
}

// deliverFin delivers c's peer's FIN, with the peer's live state live.
func deliverFin(ctx context.Context, d Deps, net Network, c FinConn, live ebpfprobes.FlowState) error {
	h := peerHeader(d, live, c.Tuple, c.OutqSeq)
	h.Seq = c.Seq
	ctx, cancel := context.WithTimeout(ctx, deliverFinWait)
	defer cancel()
	if err := net.DeliverFIN(ctx, c.Tuple, h); err != nil {
		return fmt.Errorf("connection %s -> %s: the peer closed it after the snapshot, and its FIN could not be delivered: %w", c.Local, c.Remote, err)
	}
	return nil
}

// deliverFinWait bounds deliverFins for one connection: the FIN follows the bytes the restored queue holds
// already, so the socket takes it at once.
const deliverFinWait = 10 * time.Second

// cleanupTimeout bounds what undoes a failed restore once the recovery's context has ended.
const cleanupTimeout = 10 * time.Second

// stageFunc reports one step of a job's recovery (Run's stage).
type stageFunc func(name, job string, start time.Time, detail string, err error)

// fetch tries the job's candidate snapshots in order and claims the job's next incarnation for the first
// that works; failed lists why each earlier candidate failed. A refused claim ends the search: the job
// runs elsewhere, whatever the snapshot.
func fetch(ctx context.Context, d Deps, req clusterapi.RecoverRequest, rj clusterapi.RecoverJob) (*Job, []string, error) {
	cands, err := rj.CandidateList(req.Source)
	if err != nil {
		return nil, nil, err
	}
	var failed []string
	for _, c := range cands {
		j, err := d.Snapshots.Fetch(ctx, rj.Job, c)
		if err == nil && j.Manifest.Node != req.Failed && (rj.TakenFrom == "" || j.Manifest.Node != rj.TakenFrom) {
			// A snapshot of the job taken on another host is not this recovery's to restore.
			err = fmt.Errorf("snapshot %s was taken on %s, not on %s, whose jobs this recovery restores", c.Snapshot, j.Manifest.Node, req.Failed)
			removeWork(d, j.Work)
		}
		if err != nil {
			d.Logger.Warn("candidate snapshot failed; trying the next", "job", rj.Job, "snapshot", c.Snapshot, "source", c.Source, "err", err)
			failed = append(failed, fmt.Sprintf("%s from %s: %v", c.Snapshot, c.Source, err))
			continue
		}
		j.Holder = "failover:" + req.Failure
		j.Ran = req.Failed
		n, err := d.Jobs.Claim(ctx, j, j.Incarnation+1)
		if err != nil {
			removeWork(d, j.Work)
			return nil, failed, fmt.Errorf("snapshot %s verified, but the job may not run here: %w", c.Snapshot, err)
		}
		j.Incarnation = n
		return j, failed, nil
	}
	return nil, failed, fmt.Errorf("none of %d candidate snapshot(s) could be fetched and verified: %s", len(cands), strings.Join(failed, "; "))
}

// plan asks every peer of the job's connections but the local ones (both ends on the failed node, restored
// from its snapshots: refuseTorn) for what it sent since the snapshot, for its live state and for its record
// of what it received, and computes the image edits.
func plan(ctx context.Context, d Deps, j *Job, local func(ckpt.Conn) bool) error {
	var conns []ckpt.Conn
	for _, c := range j.Manifest.Conns {
		if !local(c) {
			conns = append(conns, c)
		}
	}
	// Each connection's bytes come from another host: fetched a few at a time, a job with many
	// connections waits for the slowest, not for the sum.
	got := make([]fetchedConn, len(conns))
	inParallel(len(conns), maxParallelFetches, func(i int) { got[i] = fetchConn(ctx, d, conns[i]) })
	peers := map[tcpflow.Tuple]restore.Peer{}
	j.Checks = map[tcpflow.Tuple]Check{}
	var errs []error
	for i, c := range conns {
		if got[i].err != nil {
			errs = append(errs, got[i].err)
			continue
		}
		peers[c.Tuple] = got[i].peer
		j.Checks[c.Tuple] = got[i].check
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	p, err := restore.NewPlan(conns, peers, restore.RestoredMSS)
	j.Plan, j.peers = p, peers
	if err == nil {
		planGate(ctx, d, j, peers)
	}
	return err
}

// maxParallelFetches bounds the connections whose logs plan fetches at once.
const maxParallelFetches = 8

// fetchedConn is what plan needs of one connection from the member that holds its peer.
type fetchedConn struct {
	peer  restore.Peer
	check Check
	err   error
}

// fetchConn fetches, from the member that holds c's peer, the bytes it logged on c since the snapshot with
// its live state, then its record of what it received on c.
func fetchConn(ctx context.Context, d Deps, c ckpt.Conn) fetchedConn {
	if c.Connecting {
		// Restored, the socket connects again with the same first sequence number; the peer may have
		// accepted it since the snapshot and exchanged bytes on it, which no connecting socket can take up.
		return fetchedConn{err: fmt.Errorf("connection %s -> %s was still connecting when the snapshot was taken (SYN_SENT), so the snapshot holds nothing of what was exchanged on it since: a newer snapshot is needed: %w",
			c.Local, c.Remote, restore.ErrNotRecoverable)}
	}
	owner := d.Peers.Owner(ctx, c.Remote.Addr())
	if owner == "" {
		return fetchedConn{err: fmt.Errorf("connection %s -> %s: the peer is not a cluster member, so nobody logged what it sent", c.Local, c.Remote)}
	}
	qctx, cancel := context.WithTimeout(ctx, time.Minute)
	asked := time.Now()
	reply, data, err := logRange(qctx, d.Peers, owner, c.Tuple, c.InqSeq)
	cancel()
	if err != nil {
		return fetchedConn{err: fmt.Errorf("connection %s -> %s: log of %s: %w", c.Local, c.Remote, owner, err)}
	}
	if reply.Live == nil {
		return fetchedConn{err: fmt.Errorf("connection %s -> %s: %s has no live state of it", c.Local, c.Remote, owner)}
	}
	p := restore.Peer{Live: *reply.Live, LiveAge: reply.LiveAge + time.Since(asked), Logged: data}
	if l := reply.Live; l.HasAck && int32(l.Ack-c.OutqSeq) <= 0 {
		// The peer acknowledged nothing past the snapshot's write_seq: the restored job re-sends it
		// nothing (restore.NewPlan), so there is nothing to check. The sending end of a one-way stream
		// (a relay's upstream) received no payload at all and keeps no record to ask for.
		return fetchedConn{peer: p, check: Check{Missing: fmt.Sprintf("not asked: %s acknowledged nothing past the snapshot's write_seq", owner)}}
	}
	// Asked now, while nothing runs at this end: the peer's record ends where its socket does.
	qctx, cancel = context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return fetchedConn{peer: p, check: fetchCheck(qctx, d.Peers, owner, c.Tuple, c.OutqSeq)}
}

// logRange asks owner, the member that holds flow's peer (flow.Local is the restored end), for what the peer
// logged of flow from sequence number from on, and its live state. The reply comes from another host: it must
// be the range asked for, starting at from and holding exactly the bytes it announces, since its bytes are
// placed in the restored stream from from on (a range from elsewhere would reach the restored program at the
// wrong sequence numbers, a stream the failure-free run never had).
func logRange(ctx context.Context, peers Peers, owner string, flow tcpflow.Tuple, from uint32) (clusterapi.LogRangeReply, []byte, error) {
	reply, data, err := peers.LogRange(ctx, owner, clusterapi.LogRangeRequest{Tuple: flow.Reverse(), From: from})
	if err != nil {
		return reply, nil, err
	}
	if reply.From != from || reply.Len != int64(len(data)) {
		return reply, nil, fmt.Errorf("%s answered the request for its log from sequence %d with %d bytes from sequence %d (%d announced): not the range asked for, its bytes cannot be placed in the stream; check that agent (its version, its log): %w",
			owner, from, len(data), reply.From, reply.Len, restore.ErrNotRecoverable)
	}
	return reply, data, nil
}

// fetchCheck is the Check of conn from the member that holds its peer.
func fetchCheck(ctx context.Context, peers Peers, owner string, conn tcpflow.Tuple, from uint32) Check {
	rec, err := peers.Received(ctx, owner, conn, from)
	if err != nil {
		return Check{Missing: fmt.Sprintf("%s could not give its record of what it received: %v", owner, err)}
	}
	return Check{Received: rec}
}

// PlanSummary is the detail of the "images rewritten" stage.
func PlanSummary(p restore.Plan) string {
	var inject, resend int64
	for _, c := range p.Conns {
		inject += int64(len(c.Inject))
		resend += int64(c.Resend)
	}
	return fmt.Sprintf("%d connection(s): %d bytes injected, %d bytes to re-send, initcwnd %d", len(p.Conns), inject, resend, p.InitCwnd)
}

// prepareNetwork guards the jobs' connections, takes over the failed node's addresses, registers the
// restored flows with the ACK clamp, raises the initial congestion window and lowers the path MTU; call
// putBackMTU once the jobs are restored, and putBackCwnd once they have replayed. On error it undoes what
// it did, so that the host is left as it was (a peer must not find the address here without a socket).
func prepareNetwork(ctx context.Context, d Deps, req clusterapi.RecoverRequest, jobs []*Job) (putBackMTU, putBackCwnd func(), err error) {
	var guarded, created []*Job
	var taken []netip.Addr
	var clamped []tcpflow.Tuple
	defer func() {
		if err == nil {
			return
		}
		for _, ip := range taken {
			d.Network.Release(ip)
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout) // as restoreJob's
		defer cancel()
		for _, j := range guarded {
			if err := netOf(d, j).Unguard(cctx, j.RunID); err != nil {
				d.Logger.Warn("could not remove a network guard after a failed recovery: its flows stay dropped", "job", j.ID, "err", err)
			}
		}
		for _, j := range created {
			if err := j.Net.Delete(cctx); err != nil {
				d.Logger.Warn("could not delete a job network after a failed recovery: its address stays on the wire", "job", j.ID, "err", err)
				d.Jobs.NetLeft(j, err) // as restoreJob's
			}
		}
		for _, f := range clamped {
			d.Clamp.Release(f)
		}
	}()
	// The network guard goes up before the address: until CRIU has rebuilt the sockets, the peers'
	// retransmissions to the taken-over address must be dropped, never answered with a RST. A job with
	// an address of its own is guarded inside its network (the host's table would not see traffic to a
	// macvlan), which therefore exists first: its address is up a moment before the guard, while peers'
	// neighbour entries still name the old host's interface (only the announce below moves them).
	initCwnd := restore.MinInitCwnd
	for _, j := range jobs {
		if j.Net != nil {
			// Deleted on error even if its Create fails: a Create that fails half-way leaves the namespace,
			// and its interface with the job's address, up (jobnet.Create completes such a network later,
			// but only if asked again here); Delete of a network that is not there is no error.
			created = append(created, j)
			if err := j.Net.Create(ctx); err != nil {
				return nil, nil, fmt.Errorf("create the network of job %s: %w", j.ID, err)
			}
		}
		// New connections to the job wait too (a peer's SYN is dropped, and sent again) until CRIU has
		// rebuilt its listening sockets: the job's own address, or the addresses taken over for it.
		addrs := req.Addrs
		if j.Net != nil {
			addrs = []netip.Addr{j.Net.Addr()}
		}
		if err := netOf(d, j).Guard(ctx, j.RunID, j.Manifest.Conns, addrs); err != nil {
			return nil, nil, fmt.Errorf("guard connections of job %s: %w", j.ID, err)
		}
		guarded = append(guarded, j)
		initCwnd = max(initCwnd, j.Plan.InitCwnd)
	}
	for _, ip := range req.Addrs {
		if err := d.Network.TakeOver(ip); err != nil {
			return nil, nil, fmt.Errorf("take over address %s: %w", ip, err)
		}
		taken = append(taken, ip)
	}
	if d.Clamp != nil {
		for _, j := range jobs {
			for _, c := range j.Plan.Conns {
				if c.Resend == 0 && !c.Deferred {
					continue
				}
				// From the snapshot's write_seq: CRIU restores the out-queue as sent, and the peer, whose
				// rcv_nxt is beyond it (Resend > 0), has all of it.
				f := c.Conn.Tuple
				if err := d.Clamp.Clamp(f, c.Conn.OutqSeq); err != nil {
					return nil, nil, err
				}
				clamped = append(clamped, f)
				// A replayed receive order: the peer's own data segments wait until the gate is done.
				if c.Deferred {
					if err := d.Clamp.Hold(f, true); err != nil {
						return nil, nil, err
					}
				}
			}
		}
	}
	// The routes a restored socket uses are its namespace's: the host's, and each job network's.
	nets := []Network{d.Network}
	for _, j := range created {
		nets = append(nets, j.Net)
	}
	var cwndPutBacks []func() error
	for _, n := range nets {
		putBack, err := n.SetInitCwnd(initCwnd)
		if err != nil {
			d.Logger.Warn("could not raise the initial congestion window; re-sent bytes may stall", "err", err)
		}
		if putBack != nil {
			cwndPutBacks = append(cwndPutBacks, putBack)
		}
	}
	// Last, so that nothing above fails with the routes lowered: the restored sockets connect under the
	// lowered MTU and resync their segment size when it is put back (restore.LowerPathMTU).
	var putBacks []func() error
	for _, n := range nets {
		putBack, err := n.LowerPathMTU()
		if err != nil {
			d.Logger.Warn("could not lower the path MTU; restored sockets may send 524-byte segments", "err", err)
		}
		if putBack != nil {
			putBacks = append(putBacks, putBack)
		}
	}
	putBackMTU = func() {
		for _, putBack := range putBacks {
			if err := putBack(); err != nil {
				d.Logger.Warn("could not put the path MTU back; restored sockets may send 524-byte segments", "err", err)
			}
		}
	}
	putBackCwnd = func() {
		for _, putBack := range cwndPutBacks {
			if err := putBack(); err != nil {
				d.Logger.Warn("could not put the initial congestion window back; new connections of this host start with a large burst", "err", err)
			}
		}
	}
	return putBackMTU, putBackCwnd, nil
}

// netOf is the network job j's connections live in: its own, or the host's.
func netOf(d Deps, j *Job) Network {
	if j.Net != nil {
		return j.Net
	}
	return d.Network
}
