package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/tcpflow"
)

// maxCandidates bounds the replicas a recovery request may list per job.
const maxCandidates = clusterapi.MaxCandidates

// maxRecoverRequest bounds a recovery request; maxRecoverJobs the jobs it names.
const (
	maxRecoverRequest = clusterapi.MaxRecoverRequest
	maxRecoverJobs    = clusterapi.MaxRecoverJobs
)

// recoverLimit bounds how long a caller follows a recovery on another host; the stream itself must not
// fall silent for longer than the idle timeout (the target sends a keepalive line in between stages).
const recoverLimit = 30 * time.Minute

// remoteRecover has target run the recovery and relays its stages.
func (a *Agent) remoteRecover(ctx context.Context, target string, req RecoverRequest, emit func(Stage)) error {
	end, err := a.peers().Recover(ctx, target, req, recoverLimit, func(m clusterapi.RecoverProgress) {
		if len(m.Stage) == 0 {
			return // a keepalive
		}
		var s Stage
		if err := json.Unmarshal(m.Stage, &s); err != nil {
			a.log.Warn("recovery stage from the target is not the expected JSON; left out", "target", target, "err", err)
			return
		}
		emit(s)
	})
	var broken *clusterapi.StreamError
	switch {
	case errors.As(err, &broken):
		return a.afterBrokenStream(ctx, target, req, emit, broken.Err)
	case clusterapi.Refusal(err) != nil:
		return fmt.Errorf("recovery on %s: %w", target, err)
	case err != nil:
		return fmt.Errorf("ask %s to recover: %w", target, err)
	case end.Error != "":
		return fmt.Errorf("recovery on %s: %s", target, end.Error)
	}
	return nil
}

// serveRecover runs a recovery a member asked for and reports its stages through progress: a refusal
// before the first, then the stages, keepalives in between, and the end.
func (a *Agent) serveRecover(ctx context.Context, peer string, req RecoverRequest, progress func(clusterapi.RecoverProgress) error) error {
	if err := a.checkRecoverRequest(req, peer); err != nil {
		return err
	}
	req.Source = peer
	send := func(m clusterapi.RecoverProgress) {
		progress(m) // a failed write means the caller is gone: the recovery goes on
	}
	send(clusterapi.RecoverProgress{}) // accepted: the stream starts
	// Stages may take minutes (a fetch, a replay): an empty line now and then tells the caller that the
	// recovery goes on, so that it can give up on a silent stream quickly.
	stop, stopped := make(chan struct{}), make(chan struct{})
	keepalive := sync.OnceFunc(func() { close(stop); <-stopped })
	defer keepalive()
	go func() {
		defer close(stopped)
		t := time.NewTicker(a.idleTimeout() / 4)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				send(clusterapi.RecoverProgress{})
			}
		}
	}()
	err := a.recoverJobs(ctx, req, func(s Stage) {
		b, jerr := json.Marshal(s)
		if jerr == nil {
			send(clusterapi.RecoverProgress{Stage: b})
		}
	})
	keepalive() // the keepalives have stopped: the end is the last line
	send(clusterapi.RecoverProgress{Done: true, Error: errString(err)})
	return nil
}

// checkRecoverRequest refuses a recovery request unless this host was claimed for its failure by the
// member that sends it, and it names only the failed node's addresses (which this host then takes over).
func (a *Agent) checkRecoverRequest(req RecoverRequest, peer string) error {
	cl, ok := a.claims.Current()
	switch {
	case !ok || cl.Failure != req.Failure:
		return fmt.Errorf("%s was not claimed for failure %s", a.cfg.Name, req.Failure)
	case cl.By != peer || cl.Failed != req.Failed:
		return fmt.Errorf("%s was claimed for failure %s by %s for node %s, not by %s for node %s", a.cfg.Name, req.Failure, cl.By, cl.Failed, peer, req.Failed)
	case len(req.Jobs) == 0 || len(req.Jobs) > maxRecoverJobs:
		return fmt.Errorf("recovery request names %d jobs: 1 to %d", len(req.Jobs), maxRecoverJobs)
	}
	failed, ok := a.member(req.Failed)
	if !ok {
		return fmt.Errorf("%q is not a cluster member", req.Failed)
	}
	for _, ip := range req.Addrs {
		if !slices.Contains(failed.Addrs, ip.Unmap()) {
			return fmt.Errorf("address %s is not one of the failed node %s's addresses %v", ip, req.Failed, failed.Addrs)
		}
	}
	return nil
}

// restoring is one job on its way back.
type restoring struct {
	m     *ckpt.Manifest
	job   Job
	work  string
	plan  restore.Plan
	runID string
	// source is the member the snapshot came from; holder is the restore attempt that claimed the job's
	// incarnation (job.Incarnation), to give it back if the job never runs.
	source, holder string
	// restoredAt is when CRIU's restore returned: replay is measured from there.
	restoredAt time.Time
	// checks are the peers' records of what they received, per connection (Local: the restored end).
	checks map[tcpflow.Tuple]resentCheck
	// replayed are flows whose replay a previous agent saw complete (resume.go): not waited for again.
	replayed []tcpflow.Tuple
	// stopKeeping ends keepResends once the re-sent bytes are checked.
	stopKeeping func()
}

// recoverJobs restores a failed node's jobs on this host: fetch each snapshot, ask each peer for the bytes
// it sent since the snapshot's receive point and for its live TCP state, rewrite the images, guard the
// connections, take over the failed node's addresses, restore, announce, wait until the restored jobs
// have re-sent what their peers already had, then snapshot them again (re-protection).
func (a *Agent) recoverJobs(ctx context.Context, req RecoverRequest, emit func(Stage)) (err error) {
	defer a.setBusy("restore")()
	// On disk as it goes: an agent restarted mid-way resumes from there (resume.go).
	track := a.trackRecovery(req)
	emit = track.wrap(emit)
	defer func() { track.done(ctx, err) }()
	stage := func(name, job string, start time.Time, detail string, err error) {
		emit(Stage{Name: name, Job: job, Host: a.cfg.Name, Start: start, End: time.Now(), Detail: detail, Error: errString(err)})
	}
	iface, own, err := hostInterface(a.cfg.Cluster.Listen.Addr())
	if err != nil {
		return err
	}
	var jobs []*restoring
	var errs []error
	for _, rj := range req.Jobs {
		start := time.Now()
		r, failed, err := a.prepareRecovery(ctx, req, rj)
		detail := ""
		if r != nil {
			detail = fmt.Sprintf("%d MB from %s (snapshot %s, incarnation %d)", r.m.TotalSize()>>20, r.source, r.m.ID, r.job.Incarnation)
		}
		if len(failed) > 0 {
			detail = strings.TrimPrefix(detail+"; failed before: "+strings.Join(failed, "; "), "; ")
		}
		stage(StageFetched, rj.Job, start, detail, err)
		if err != nil {
			errs = append(errs, fmt.Errorf("job %s: %w", rj.Job, err))
			continue
		}
		start = time.Now()
		err = a.planRecovery(ctx, req, r)
		if err == nil {
			err = restore.Rewrite(r.work, r.plan)
		}
		stage(StageRewritten, rj.Job, start, planSummary(r.plan), err)
		if err != nil {
			a.giveBack(ctx, r.job.ID, r.job.Incarnation, r.holder, nil)
			errs = append(errs, fmt.Errorf("job %s is not transparently recoverable: %w", rj.Job, err))
			continue
		}
		jobs = append(jobs, r)
	}
	if len(jobs) == 0 {
		return errors.Join(append(errs, errors.New("no job could be prepared"))...)
	}
	if err := a.prepareNetwork(ctx, iface, own.Bits(), req.Addrs, jobs); err != nil {
		for _, r := range jobs {
			os.RemoveAll(r.work)
			a.giveBack(ctx, r.job.ID, r.job.Incarnation, r.holder, nil)
		}
		return errors.Join(append(errs, err)...)
	}
	track.persist(jobs)
	var restored []*restoring
	for _, r := range jobs {
		start := time.Now()
		r.stopKeeping = a.keepResends(r)
		_, err := a.restoreJob(ctx, r.m, r.job, r.work)
		r.restoredAt = time.Now()
		stage(StageRestored, r.job.ID, start, "", err)
		if err != nil {
			r.stopKeeping()
			track.setPhase(r.job.ID, "", time.Time{})
			restore.Unguard(ctx, r.runID)
			a.giveBackUnlessStarted(ctx, r.job, r.job.Incarnation, r.holder, err)
			errs = append(errs, fmt.Errorf("job %s: %w", r.job.ID, err))
			continue
		}
		track.setPhase(r.job.ID, phaseRestored, r.restoredAt)
		restored = append(restored, r)
	}
	for _, ip := range req.Addrs {
		if err := restore.Announce(ctx, iface, ip); err != nil {
			a.log.Warn("gratuitous ARP failed; peers find the address when their neighbour entries expire", "addr", ip, "err", err)
		}
	}
	var verified []*restoring
	for _, r := range restored {
		detail, err := a.replayAndVerify(ctx, r)
		stage(StageReplayed, r.job.ID, r.restoredAt, detail, err)
		if err != nil {
			errs = append(errs, fmt.Errorf("job %s is not transparently recoverable (killed): %w", r.job.ID, err))
			continue
		}
		track.setPhase(r.job.ID, phaseReplayed, time.Time{})
		verified = append(verified, r)
	}
	restored = verified
	if len(restored) > 0 {
		start := time.Now()
		var ids []string
		for _, r := range restored {
			ids = append(ids, r.job.ID)
		}
		detail, err := a.reprotect(ctx, ids)
		stage(StageProtected, "", start, detail, err)
		if err != nil {
			errs = append(errs, fmt.Errorf("re-protect: %w", err))
		}
	}
	return errors.Join(errs...)
}

// prepareNetwork guards the jobs' connections, takes over the failed node's addresses, registers the
// restored flows with the ACK clamp and raises the initial congestion window. On error it undoes what it
// did, so that the host is left as it was (a peer must not find the address here without a socket).
func (a *Agent) prepareNetwork(ctx context.Context, iface string, bits int, addrs []netip.Addr, jobs []*restoring) (err error) {
	var guarded []string
	var taken []netip.Prefix
	var clamped []tcpflow.Tuple
	defer func() {
		if err == nil {
			return
		}
		for _, p := range taken {
			restore.Release(iface, p)
		}
		for _, id := range guarded {
			restore.Unguard(ctx, id)
		}
		for _, f := range clamped {
			a.clamp.Release(f)
		}
	}()
	// The network guard goes up before the address: until CRIU has rebuilt the sockets, the peers'
	// retransmissions to the taken-over address must be dropped, never answered with a RST.
	initCwnd := restore.MinInitCwnd
	for _, r := range jobs {
		if err := restore.Guard(ctx, r.runID, r.m.Conns); err != nil {
			return fmt.Errorf("guard connections of job %s: %w", r.job.ID, err)
		}
		guarded = append(guarded, r.runID)
		initCwnd = max(initCwnd, r.plan.InitCwnd)
	}
	for _, ip := range addrs {
		p := netip.PrefixFrom(ip, bits)
		if err := restore.TakeOver(iface, p); err != nil {
			return fmt.Errorf("take over address %s: %w", ip, err)
		}
		taken = append(taken, p)
	}
	if a.clamp != nil {
		for _, r := range jobs {
			for _, c := range r.plan.Conns {
				if c.Resend == 0 {
					continue
				}
				// From the snapshot's write_seq: CRIU restores the out-queue as sent, and the peer, whose
				// rcv_nxt is beyond it (Resend > 0), has all of it.
				f := c.Conn.Tuple
				if err := a.clamp.Clamp(f, c.Conn.OutqSeq); err != nil {
					return err
				}
				clamped = append(clamped, f)
			}
		}
	}
	if err := restore.SetInitCwnd(iface, initCwnd); err != nil {
		a.log.Warn("could not raise the initial congestion window; re-sent bytes may stall", "err", err)
	}
	return nil
}

// prepareRecovery tries the job's candidate snapshots in order (fetch, verify, read the job record) and
// claims the job's next incarnation for the first that works; failed lists why each earlier candidate
// failed. A refused claim ends the search: the job runs elsewhere, whatever the snapshot.
func (a *Agent) prepareRecovery(ctx context.Context, req RecoverRequest, rj RecoverJob) (*restoring, []string, error) {
	cands, err := rj.CandidateList(req.Source)
	if err != nil {
		return nil, nil, err
	}
	var failed []string
	for _, c := range cands {
		r, err := a.prepareCandidate(ctx, rj.Job, c)
		if err != nil {
			a.log.Warn("candidate snapshot failed; trying the next", "job", rj.Job, "snapshot", c.Snapshot, "source", c.Source, "err", err)
			failed = append(failed, fmt.Sprintf("%s from %s: %v", c.Snapshot, c.Source, err))
			continue
		}
		r.holder = "failover:" + req.Failure
		n := r.job.Incarnation + 1
		if err := a.claimIncarnation(ctx, rj.Job, n, r.holder, r.m.Node); err != nil {
			os.RemoveAll(r.work)
			if errors.Is(err, grant.ErrConflict) {
				err = fmt.Errorf("%w: %w", ErrJobAlive, err)
			}
			return nil, failed, fmt.Errorf("snapshot %s verified, but the job may not run here: %w", c.Snapshot, err)
		}
		r.job.Incarnation = n
		return r, failed, nil
	}
	return nil, failed, fmt.Errorf("none of %d candidate snapshot(s) could be fetched and verified: %s", len(cands), strings.Join(failed, "; "))
}

// prepareCandidate fetches (unless this host has it) and verifies one snapshot and lays out a working copy
// of its images.
func (a *Agent) prepareCandidate(ctx context.Context, job string, c Candidate) (*restoring, error) {
	source := a.cfg.Name
	m, err := a.store.Verify(ctx, job, c.Snapshot)
	if err != nil && c.Source != "" && c.Source != a.cfg.Name {
		// Missing here, or a damaged copy (which the holder's copy replaces once it verifies).
		source = c.Source
		if err := a.fetchFrom(ctx, source, job, c.Snapshot); err != nil {
			return nil, err
		}
		m, err = a.store.Verify(ctx, job, c.Snapshot)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrCorruptSnapshot, err)
	}
	j, err := a.snapshotJob(m)
	if err != nil {
		return nil, err
	}
	if j.ID != job {
		return nil, fmt.Errorf("snapshot %s of job %s carries the job record of %q", m.ID, job, j.ID)
	}
	work, err := a.workCopy(m)
	if err != nil {
		return nil, err
	}
	runID, err := restore.RunID(work)
	if err != nil {
		os.RemoveAll(work)
		return nil, err
	}
	return &restoring{m: m, job: j, work: work, runID: runID, source: source}, nil
}

// planRecovery asks every peer of the job's connections for what it sent since the snapshot and for its
// live state, and computes the image edits.
func (a *Agent) planRecovery(ctx context.Context, req RecoverRequest, r *restoring) error {
	peers := map[tcpflow.Tuple]restore.Peer{}
	r.checks = map[tcpflow.Tuple]resentCheck{}
	var conns []ckpt.Conn
	var errs []error
	for _, c := range r.m.Conns {
		if slices.Contains(req.Addrs, c.Remote.Addr().Unmap()) {
			continue // both ends were on the failed node: restored from the same node snapshot
		}
		owner := a.memberByIP(c.Remote.Addr())
		if owner == "" {
			errs = append(errs, fmt.Errorf("connection %s -> %s: the peer is not a cluster member, so nobody logged what it sent", c.Local, c.Remote))
			continue
		}
		qctx, cancel := context.WithTimeout(ctx, time.Minute)
		asked := time.Now()
		reply, data, err := a.LogRange(qctx, owner, LogRangeRequest{Src: c.Remote, Dst: c.Local, From: c.InqSeq})
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("connection %s -> %s: log of %s: %w", c.Local, c.Remote, owner, err))
			continue
		}
		if reply.Live == nil {
			errs = append(errs, fmt.Errorf("connection %s -> %s: %s has no live state of it", c.Local, c.Remote, owner))
			continue
		}
		conns = append(conns, c)
		peers[c.Tuple] = restore.Peer{
			Live: *reply.Live, LiveAge: reply.LiveAge + time.Since(asked), Logged: data,
		}
		// Asked now, while nothing runs at this end: the peer's record ends where its socket does.
		qctx, cancel = context.WithTimeout(ctx, time.Minute)
		r.checks[c.Tuple] = a.fetchResentCheck(qctx, owner, c.Tuple, c.OutqSeq)
		cancel()
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	plan, err := restore.NewPlan(conns, peers, restore.RestoredMSS)
	r.plan = plan
	return err
}

// startAckClamp loads the ACK clamp and attaches it to the cluster interface, and to loopback for jobs
// restored on the host of their peer (basic mode).
func (a *Agent) startAckClamp() error {
	c, err := a.openAckClamp()
	if err != nil {
		return err
	}
	iface, _, err := hostInterface(a.cfg.Cluster.Listen.Addr())
	for _, name := range []string{iface, "lo"} {
		if err != nil {
			break
		}
		var l netlink.Link
		if l, err = netlink.LinkByName(name); err == nil {
			err = c.Attach(l.Attrs().Index)
		}
	}
	if err != nil {
		c.Close()
		return err
	}
	a.clamp = c
	return nil
}

func planSummary(p restore.Plan) string {
	var inject, resend int64
	for _, c := range p.Conns {
		inject += int64(len(c.Inject))
		resend += int64(c.Resend)
	}
	return fmt.Sprintf("%d connection(s): %d bytes injected, %d bytes to re-send, initcwnd %d", len(p.Conns), inject, resend, p.InitCwnd)
}

// waitReplay waits until every restored connection has re-sent the bytes its peer already had: from then
// on the job produces new bytes, and the peers' TCP discarded the re-sent ones as duplicates. The restored
// socket's progress is read from the ACK clamp (or, without it, from the sender-side log's flow state).
func (a *Agent) waitReplay(ctx context.Context, r *restoring) (string, error) {
	timeout := a.cfg.Failover.ReplayTimeout.Duration
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var total int64
	var clamped uint64
	for _, c := range r.plan.Conns {
		if c.Resend == 0 {
			continue
		}
		total += int64(c.Resend)
		target := c.Conn.OutqSeq + c.Resend
		flow := c.Conn.Tuple
		if slices.Contains(r.replayed, flow) {
			continue
		}
		for {
			sent, ok := a.sentUpTo(flow)
			if ok && int32(sent-target) >= 0 {
				break
			}
			if cur, _, _ := a.Job(r.job.ID, 0); cur.State != JobRunning {
				return "", fmt.Errorf("job %s ended (%s) before it re-sent what %s had", r.job.ID, cur.State, c.Conn.Remote)
			}
			select {
			case <-ctx.Done():
				return "", fmt.Errorf("connection %s -> %s: the restored job did not re-send what its peer had received (up to sequence %d) within %s (failover.replay_timeout): it diverged from the execution its peers saw (it waits for a message they will never send) or is stuck", c.Conn.Local, c.Conn.Remote, target, timeout)
			case <-time.After(5 * time.Millisecond):
			}
		}
		if a.clamp != nil {
			st, _ := a.clamp.Release(flow)
			clamped += st.Clamped
		}
	}
	return fmt.Sprintf("%d bytes re-sent and discarded by the peers; %d peer ACKs clamped", total, clamped), nil
}

// replayAndVerify waits for a restored job's replay and checks every byte it re-sent. A job that does not
// re-send what its peers had within the replay timeout (it diverged and waits for a message nobody will
// send, or re-sent fewer bytes) or whose bytes fail the check is killed before anything re-protects it:
// from there on its peers would get bytes of a different execution, or of one nobody can vouch for. The
// recovery ends with a named failure, never a hang and never a job of unknown fidelity.
func (a *Agent) replayAndVerify(ctx context.Context, r *restoring) (string, error) {
	if r.stopKeeping != nil {
		defer r.stopKeeping()
	}
	detail, err := a.waitReplay(ctx, r)
	if err == nil {
		var vdetail string
		vdetail, err = a.verifyResent(ctx, r)
		detail += "; " + vdetail
	}
	if err != nil {
		a.killJob(r.job.ID, err)
	}
	return detail, err
}

// sentUpTo is how far a restored socket has sent on flow.
func (a *Agent) sentUpTo(flow tcpflow.Tuple) (uint32, bool) {
	if a.clamp != nil {
		st, err := a.clamp.State(flow)
		return st.SndNxt, err == nil
	}
	if a.netlog != nil {
		st, ok, err := a.netlog.cap.FlowState(flow)
		return st.SndNxt, ok && err == nil
	}
	return 0, false
}
