package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/dump"
	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/internal/heldconns"
	"github.com/ftkit/ftkit/internal/version"
	"github.com/ftkit/ftkit/ring"
)

// Layout of a snapshot directory (ckpt/dump writes it).
const (
	snapImages  = dump.ImagesDir
	snapOutputs = dump.OutputsDir
	snapJob     = dump.JobFile
)

// SnapshotResult describes one snapshot taken by this agent.
type SnapshotResult struct {
	Manifest *ckpt.Manifest `json:"manifest"`
	Shipped  bool           `json:"shipped"`
	ShipErr  string         `json:"ship_error,omitempty"`
	// Shipping cost: snapshot bytes, bytes on the wire (compressed), and wall time.
	ShipBytes    int64         `json:"ship_bytes,omitempty"`
	ShipWire     int64         `json:"ship_wire_bytes,omitempty"`
	ShipDuration time.Duration `json:"ship_duration_ns,omitempty"`
	// ShipCopied is what of ShipBytes the protector took from its base (a diff) instead of the wire.
	ShipCopied int64 `json:"ship_copied_bytes,omitempty"`
}

// snapshot dumps one running job and keeps it running (uncoordinated). If frozen, the caller froze the
// job's cgroup (semi-coordinated): CRIU dumps it frozen and leaves it frozen. hashWhileDumping hashes its
// memory images as CRIU writes them (dump.Options.HashWhileDumping: a migration, whose stop counts the
// hash pass).
func (a *Agent) snapshot(ctx context.Context, j Job, frozen, hashWhileDumping bool) (*ckpt.Manifest, error) {
	if a.replays.has(j.ID) {
		return nil, fmt.Errorf("snapshot of job %s: %w", j.ID, ErrReplaying)
	}
	defer a.setBusy(detect.BusyCheckpoint)()
	if a.netlog != nil {
		defer a.netlog.node.HoldTrims()() // until SentPrefix has read the connections' last blocks
	}
	if err := a.waitPagesIn(ctx, j.ID); err != nil {
		return nil, err
	}
	j.LazyWork = "" // every page is in: the record the snapshot carries names no images of this host
	// The snapshot's connections are one batch of address lookups.
	owners := a.ownerLookup(ctx)
	copySnaps := sync.OnceValue(func() []*ckpt.Manifest { return a.copySnapshots(j) })
	opts := dump.Options{
		Job: j.ID, PID: j.PID, Record: j, Logger: a.log,
		Info: ckpt.Info{CRIUVersion: a.criuVersion.String(), KernelRelease: version.KernelRelease(), Mode: a.cfg.Checkpoint.Mode},
		SentPrefix: func(ctx context.Context, images string, c image.TCPConn) (*ckpt.SentPrefix, error) {
			// Only a peer on another member survives this host and checks what a restore re-sends to it.
			if owner := owners(c.Remote.Addr()); owner != "" && owner != a.cfg.Name {
				return a.sentPrefix(ctx, images, c, copySnaps)
			}
			return nil, nil
		},
		Outputs: a.outputsOf(j),
	}
	// A host mount unmounted since the job started stays in the job's copy of the namespace; CRIU would
	// dump it by content or refuse it. The restore does the same for the mounts gone from its host
	// (image.PruneGoneMounts): the job then sees at that path what the host's other processes see.
	if skip, err := a.staleMounts.Gone(j.ID, j.PID); err != nil {
		a.log.Warn("the job's mounts could not be compared with the host's: its snapshot leaves none out", "job", j.ID, "err", err)
	} else if len(skip) > 0 {
		a.log.Info("mounts of the job's namespace that the host has since unmounted are left out of its snapshot", "job", j.ID, "mounts", skip)
		opts.SkipMounts = skip
	}
	if (a.det.Positions() || a.det.Pessimistic()) && !frozen {
		// The threads' readiness calls must be read at the point the dump catches the job, and a process
		// held after a receive call must not be dumped stopped (record's ReleaseForDump): it is frozen for the dump
		// instead of stopped by CRIU, and thawed as soon as CRIU is done.
		if err := a.freezeJob(ctx, j); err != nil {
			return nil, fmt.Errorf("snapshot of job %s: %w", j.ID, err)
		}
		opts.Dumped = sync.OnceFunc(func() { a.thaw(j) })
		defer opts.Dumped()
		frozen = true
	}
	if frozen {
		restop, err := a.det.ReleaseForDump(j.ID, j.Cgroup)
		defer restop()
		if err != nil {
			return nil, fmt.Errorf("snapshot of job %s: %w", j.ID, err)
		}
		if thaw := opts.Dumped; thaw != nil {
			opts.Dumped = func() { restop(); thaw() }
		} else {
			opts.Dumped = restop
		}
		opts.FreezeCgroup = j.Cgroup
		polls, ok, err := a.det.PollsAtDump(j.Cgroup)
		if err != nil {
			return nil, fmt.Errorf("snapshot of job %s: read its threads' readiness calls: %w", j.ID, err)
		}
		opts.Info.Positions, opts.Info.Polls = ok, polls
	}
	opts.HashWhileDumping = hashWhileDumping
	// A dump is bounded (checkpoint.dump_timeout): its CRIU is killed at the deadline, before the job is
	// thawed. Unbounded, a CRIU that hung kept the job frozen and ckptMu held, every later snapshot, migration
	// and rollback of the host waiting behind it.
	dctx, cancel := context.WithTimeout(ctx, a.dumpTimeout())
	defer cancel()
	m, err := dump.Take(dctx, a.store, a.dumperFor(j), opts)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			return nil, fmt.Errorf("snapshot of job %s: not done in checkpoint.dump_timeout (%s): CRIU killed and the snapshot dropped: %w", j.ID, a.dumpTimeout(), err)
		}
		return nil, err
	}
	a.metrics.SnapshotTaken(m.DumpDuration, m.Stats.FrozenTime, m.TotalSize())
	return m, nil
}

// outputsOf is job j's directory and which of its files are the job's outputs, for a snapshot to copy.
func (a *Agent) outputsOf(j Job) dump.Outputs {
	l := a.layout()
	return dump.Outputs{
		Dir: l.dir(j.ID), UID: j.UID, Own: stdoutName + " and " + stderrName,
		Name: func(path string) (string, bool) { return l.outputName(j.ID, path) },
	}
}

// protectorOf is where a snapshot of a job with placement p goes first: the member standing for the run's
// next host after this one (ring.View.RunProtector), or, for a job without a placement and when no other
// host of its run is alive, this node's ring protector (the next alive node of the ring).
func (a *Agent) protectorOf(v ring.View, p *Placement) (ring.Member, bool) {
	if p != nil {
		if m, ok := v.RunProtector(p.Hosts, a.cfg.Name); ok {
			return m, true
		}
	}
	return v.Protector(a.cfg.Name)
}

// shipToProtector streams a snapshot of a job with placement p, committed moments ago, to the job's
// protector (protectorOf) and records the replica. If the protector does not answer, the next node of the
// ring takes its place, so the ring re-forms around a member that left. The files are not hashed again as
// they are sent (ship.SendOptions.JustCommitted: the commit hashed them, the protector checks every byte):
// a second sha256 pass over every snapshot was 0.65% of all CPU while compare's c ran (perf, 2026-11-27).
func (a *Agent) shipToProtector(ctx context.Context, m *ckpt.Manifest, p *Placement) (*ship.Sent, error) {
	// Not before the job's cut still to commit is recorded (or given up): its arrival would have the
	// protector prune the cut's replica, which nothing pins there yet (coordinated.Uncommitted.Settle).
	if err := a.uncommitted.Settle(ctx, m.Job, m.ID, func() {
		a.log.Info("snapshot's replication waits for the commit of the job's coordinated snapshot", "job", m.Job, "snapshot", m.ID)
	}); err != nil {
		return nil, fmt.Errorf("ship %s: %w", m.ID, err)
	}
	var errs []error
	v := a.View()
	candidates := func(yield func(string) bool) {
		if first, ok := a.protectorOf(v, p); ok && !yield(first.Name) {
			return
		}
		// Once around the ring at most: a host no longer alive in the view is never reached again.
		prot, ok := v.Protector(a.cfg.Name)
		for range v.Members {
			if !ok || prot.Name == a.cfg.Name || !yield(prot.Name) {
				return
			}
			prot, ok = v.Protector(prot.Name)
		}
	}
	// A job that rewrote nearly all its memory since its last snapshot gains nothing from a diff.
	// Its last snapshot sent is the base the protector most likely offers: its index, kept from that
	// transfer, spares this one a read of the base.
	opts := ship.SendOptions{JustCommitted: true, NoDelta: !a.diffs.Diff(m.Job), Base: a.diffs.Base(m.Job), KeepIndex: true}
	tried := map[string]bool{}
	for prot := range candidates {
		if tried[prot] || prot == a.cfg.Name {
			continue
		}
		tried[prot] = true
		sent, err := a.shipTo(ctx, prot, m, opts)
		if err == nil {
			a.diffs.Record(m.Job, sent)
			return sent, nil
		}
		errs = append(errs, err)
		var remote *ship.RemoteError
		if errors.As(err, &remote) || ctx.Err() != nil {
			return nil, errors.Join(errs...) // the protector answered and refused: do not go around it
		}
		a.log.Warn("protector unreachable; trying the next node of the ring", "protector", prot, "err", err)
	}
	errs = append(errs, errors.New("no other node left in the ring"))
	return nil, fmt.Errorf("ship %s: %w", m.ID, errors.Join(errs...))
}

// shipTo streams committed snapshot m to peer and records the replica; opts may say more about m
// (JustCommitted, Base), its Peer and Logger are set here.
func (a *Agent) shipTo(ctx context.Context, peer string, m *ckpt.Manifest, opts ship.SendOptions) (*ship.Sent, error) {
	// A protector that does not accept the connection in time is skipped (the next node of the ring takes
	// the replica); the transfer itself may take as long as it needs.
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	c, err := a.peers().Ship(dctx, peer)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("ship %s to %s: %w", m.ID, peer, err)
	}
	defer c.Close()
	opts.Peer, opts.Logger = peer, a.log
	sent, err := ship.Send(ctx, c, a.store, m.Job, m.ID, opts)
	if err != nil {
		return nil, fmt.Errorf("ship %s to %s: %w", m.ID, peer, err)
	}
	a.metrics.SnapshotShipped(sent.Bytes, sent.WireBytes, sent.Duration)
	a.log.Info("snapshot shipped", "job", m.Job, "snapshot", m.ID, "protector", peer, "bytes", sent.Bytes,
		"wire_bytes", sent.WireBytes, "ms", sent.Duration.Milliseconds(),
		"mb_per_s", float64(sent.Bytes)/1e6/max(sent.Duration.Seconds(), 1e-6))
	return sent, nil
}

// Checkpoint snapshots the given running jobs now (all of this host's if ids is empty), ships each
// snapshot, and prunes old ones. In semi-coordinated mode all of them are frozen together first.
func (a *Agent) Checkpoint(ctx context.Context, ids []string, uid uint32) ([]SnapshotResult, error) {
	return a.checkpoint(ctx, ids, uid, nil)
}

// checkpoint is Checkpoint for the scheduler too: still, if set, is asked again once the previous
// snapshot is done (a snapshot due because a job opened connections may have been overtaken by one that
// holds them), and the snapshot is skipped unless it holds for some job (semi-coordinated mode: all of
// them are snapshotted then) or for each job (otherwise). A snapshot of every job (no ids) leaves out
// the jobs being replayed (ErrReplaying); one of named jobs is refused if a named job is.
func (a *Agent) checkpoint(ctx context.Context, ids []string, uid uint32, still func(Job) bool) ([]SnapshotResult, error) {
	// A job named twice is one job: counted twice, the check below took it for a job that is not running.
	ids = slices.Compact(slices.Sorted(slices.Values(ids)))
	var replaying []string
	running := func() []Job {
		var jobs []Job
		for _, j := range a.Jobs(uid) {
			if j.State == JobRunning && (len(ids) == 0 || slices.Contains(ids, j.ID)) {
				jobs = append(jobs, j)
			}
		}
		jobs, replaying = a.replays.split(jobs)
		return jobs
	}
	jobs := running()
	if len(ids) > 0 && len(jobs)+len(replaying) != len(ids) {
		return nil, fmt.Errorf("%w: some of %v are not running on %s", ErrNoJob, ids, a.cfg.Name)
	}
	if len(ids) > 0 && len(replaying) > 0 {
		return nil, fmt.Errorf("snapshot of job(s) %s: %w", strings.Join(replaying, ", "), ErrReplaying)
	}
	a.ckptMu.Lock()
	if still != nil {
		jobs = running()
		keep := slices.DeleteFunc(slices.Clone(jobs), func(j Job) bool { return !still(j) })
		switch {
		case len(keep) == 0:
			a.ckptMu.Unlock()
			return nil, nil
		case a.cfg.Checkpoint.Mode != SemiCoordinated:
			jobs = keep
		}
	}
	var manifests []*ckpt.Manifest
	var errs []error
	var strays map[string][]string
	asked := jobs
	began := map[string]time.Time{}
	if a.cfg.Checkpoint.Mode == SemiCoordinated {
		// Named jobs, or a user's, are not all of the host's: the jobs they talk to are dumped with them.
		start := time.Now()
		dumped, ms, err := a.semiCoordinated(ctx, jobs, len(ids) > 0 || uid != 0)
		jobs, manifests, errs = dumped, ms, append(errs, a.peerErrorFor(uid, err))
		strays = strayLocalConns(ms, a.onThisHost)
		for _, m := range ms {
			began[m.Job] = start
		}
	} else {
		for _, j := range jobs {
			// No other retry: the one transient failure seen (two parasites racing to mkdir "/proc.crtools",
			// EEXIST) cannot happen since each job has a /proc of its own (shim/jobinit.go).
			start := time.Now()
			m, err := a.snapshotAccepted(ctx, j)
			if err != nil {
				errs = append(errs, fmt.Errorf("job %s: %w", j.ID, err))
				continue
			}
			a.policyFor(j.ID).Observe(time.Duration(m.DumpDuration))
			manifests = append(manifests, m)
			began[m.Job] = start
		}
	}
	for job, at := range began {
		a.shipping.begin(job, at)
		defer a.shipping.end(job, at)
	}
	// The dumps are done: shipping them needs no lock, and must not hold up a migration, a rollback or the
	// next snapshot while it waits on a protector that died (its connect timeout).
	a.ckptMu.Unlock()
	placements := map[string]*Placement{}
	for _, j := range jobs {
		placements[j.ID] = j.Spec.Placement
	}
	res := a.replicate(ctx, manifests, placements, strays)
	if uid != 0 { // the snapshots of another user's jobs dumped with the caller's are not the caller's to see
		res = resultsOf(res, asked)
	}
	return res, errors.Join(errs...)
}

// acceptWait bounds how long a snapshot of a running job waits for it to accept the connections waiting in
// its listen queues, which CRIU cannot dump (criu.ErrInFlight; checkpoint.accept_wait). A program accepts
// within moments unless it is busy elsewhere (a ring rank that still connects to its next one; an MPI
// library accepts only when the program calls it): the snapshot then fails, naming the cause, and a
// scheduled one is taken later.
func (a *Agent) acceptWait() time.Duration { return a.cfg.Checkpoint.AcceptWait.Duration }

// dumpTimeout bounds one dump of a job (checkpoint.dump_timeout; unset in an agent built without Defaults:
// the largest it may be).
func (a *Agent) dumpTimeout() time.Duration {
	if d := a.cfg.Checkpoint.DumpTimeout.Duration; d > 0 {
		return d
	}
	return clusterapi.MaxCoordStep
}

// snapshotAccepted is snapshot of running job j, taken again once j has accepted the connections that failed
// its dump (whenAccepted).
func (a *Agent) snapshotAccepted(ctx context.Context, j Job) (*ckpt.Manifest, error) {
	return whenAccepted(ctx, a.acceptWait(), func() (*ckpt.Manifest, error) { return a.snapshot(ctx, j, false, false) }, a.acceptsWaiting(j))
}

// acceptsWaiting returns what lists j's listening sockets that hold connections j has not accepted yet, for
// whenAccepted; the first time it finds one, the log says the snapshot waits.
func (a *Agent) acceptsWaiting(j Job) func() ([]netip.AddrPort, error) {
	return a.acceptsWaitingIn([]Job{j})
}

// acceptsWaitingIn is acceptsWaiting for jobs, which it lists together (one socket table per network
// namespace).
func (a *Agent) acceptsWaitingIn(jobs []Job) func() ([]netip.AddrPort, error) {
	logged := false
	return func() ([]netip.AddrPort, error) {
		var waiting []netip.AddrPort
		var ids []string
		groups, nets := byNetns(jobs)
		for key, group := range groups {
			var cgroups []string
			for _, j := range group {
				cgroups = append(cgroups, j.Cgroup)
			}
			socks, err := heldconns.Inodes(cgroups...)
			if err != nil {
				return nil, err
			}
			var held map[string]heldconns.Held
			if err := inJobNet(nets[key], func() (err error) {
				held, err = heldconns.List(socks)
				return err
			}); err != nil {
				return nil, err
			}
			for _, j := range group {
				if p := held[j.Cgroup].Pending; len(p) > 0 {
					waiting, ids = append(waiting, p...), append(ids, j.ID)
				}
			}
		}
		if len(waiting) > 0 && !logged {
			logged = true
			a.log.Info("a connection waits in a listen queue of the job, which CRIU cannot dump: the snapshot waits for the job to accept it",
				"jobs", ids, "listeners", waiting, "for_at_most", a.acceptWait())
		}
		return waiting, nil
	}
}

// acceptPoll is how often the listen queues are looked at while a snapshot waits for them.
const acceptPoll = 20 * time.Millisecond

// whenAccepted runs dump, and again each time it fails on a connection waiting in a listen queue
// (criu.ErrInFlight) once waiting lists no such queue, for up to wait in all. The failed dump cost the job
// only the moment CRIU held it.
func whenAccepted(ctx context.Context, wait time.Duration, dump func() (*ckpt.Manifest, error), waiting func() ([]netip.AddrPort, error)) (*ckpt.Manifest, error) {
	deadline := time.Now().Add(wait)
	for {
		m, err := dump()
		if !errors.Is(err, criu.ErrInFlight) {
			return m, err
		}
		queues, werr := untilAccepted(ctx, deadline, waiting)
		switch {
		case werr != nil:
			return nil, fmt.Errorf("%w (while it waited for the job to accept: %w)", err, werr)
		case len(queues) > 0:
			return nil, fmt.Errorf("%w: the job did not accept them within %s (listeners %v): snapshot it again once it has; the schedule retries",
				err, wait, queues)
		case time.Now().After(deadline):
			return nil, fmt.Errorf("%w: new connections kept arriving for %s: snapshot it again later", err, wait)
		}
	}
}

// untilAccepted looks at the listen queues (waiting) every acceptPoll until they are empty (nil), or
// returns what they hold once deadline has passed.
func untilAccepted(ctx context.Context, deadline time.Time, waiting func() ([]netip.AddrPort, error)) ([]netip.AddrPort, error) {
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(acceptPoll):
		}
		queues, err := waiting()
		if err != nil || len(queues) == 0 {
			return nil, err
		}
		if time.Now().After(deadline) {
			return queues, nil
		}
	}
}

// acceptBeforeDump looks at the listen queues of frozen jobs (waiting): a connection waiting in one would
// fail their dump (criu.ErrInFlight), and frozen they cannot accept it. If one waits and deadline has not
// passed, it thaws them (thaw), waits until they have accepted (untilAccepted) and returns again: freeze
// them and look once more. Past deadline it returns the queues that still hold connections.
func acceptBeforeDump(ctx context.Context, deadline time.Time, waiting func() ([]netip.AddrPort, error), thaw func()) (again bool, queues []netip.AddrPort) {
	// A queue that cannot be read is left to the dump, whose error names what CRIU found.
	if queues, err := waiting(); err != nil || len(queues) == 0 || time.Now().After(deadline) {
		return false, queues
	}
	thaw()
	untilAccepted(ctx, deadline, waiting) // what it found is looked at again once the jobs are frozen
	return true, nil
}

// freezeAccepted freezes jobs (freeze) and, while a connection waits in their listen queues (waiting),
// thaws them (thaw) until they have accepted it and freezes them again (acceptBeforeDump), for up to wait
// in all: a dump of the frozen jobs then meets no connection they have not accepted.
func freezeAccepted(ctx context.Context, wait time.Duration, freeze func() error, thaw func(), waiting func() ([]netip.AddrPort, error)) error {
	for deadline := time.Now().Add(wait); ; {
		if err := freeze(); err != nil {
			return err
		}
		again, queues := acceptBeforeDump(ctx, deadline, waiting, thaw)
		if len(queues) > 0 {
			return fmt.Errorf("%w: the jobs did not accept the connections waiting in their listen queues (%v) within %s: snapshot them again once they have",
				criu.ErrInFlight, queues, wait)
		}
		if !again {
			return nil
		}
	}
}

// resultsOf keeps the results of snapshots of jobs.
func resultsOf(res []SnapshotResult, jobs []Job) []SnapshotResult {
	return slices.DeleteFunc(res, func(r SnapshotResult) bool {
		return !slices.ContainsFunc(jobs, func(j Job) bool { return j.ID == r.Manifest.Job })
	})
}

// replicate ships each committed snapshot to its job's protector (placements: the jobs' placements), records
// the replicas, lets the senders trim their logs, and prunes old snapshots. strays names, by snapshot, the
// connections that other snapshots of its freeze do not complete (strayLocalConns).
func (a *Agent) replicate(ctx context.Context, manifests []*ckpt.Manifest, placements map[string]*Placement, strays map[string][]string) []SnapshotResult {
	if len(manifests) > 0 {
		// Part of the checkpoint for the protector's watchdog: a 1 GiB transfer and the commit and pruning
		// that end it load both hosts (the detect soak's two false suspicions of 2026-11-29 each began as
		// such a transfer ended, 5 s after the dump's busy flag had gone).
		defer a.setBusy(detect.BusyCheckpoint)()
	}
	var out []SnapshotResult
	for _, m := range manifests {
		res := SnapshotResult{Manifest: m}
		sent, err := a.shipToProtector(ctx, m, placements[m.Job])
		if err != nil {
			res.ShipErr = err.Error()
			a.metrics.ShipFailed()
			a.log.Warn("snapshot not replicated", "job", m.Job, "snapshot", m.ID, "err", err)
		} else {
			res.Manifest, res.Shipped = sent.Manifest, true
			res.ShipBytes, res.ShipWire, res.ShipDuration, res.ShipCopied = sent.Bytes, sent.WireBytes, sent.Duration, sent.CopiedBytes
			a.recordReplica(ctx, sent.Manifest, strays[m.ID]) // the job is protected from here on
			// Durable on the protector: the senders may now drop what the snapshot before it had received
			// (this one's, if a sender asked for it under log pressure).
			if base := a.releaseBase(sent.Manifest, a.asked.Load() != askIdle); base != nil {
				a.announceReceivePoints(ctx, base)
			}
			a.pruneOwn(ctx, m.Job)
		}
		out = append(out, res)
	}
	return out
}

// Snapshots lists the snapshots held on this host, newest first: its jobs' own and the replicas it keeps
// as a protector. A non-root caller sees only snapshots of its own jobs.
func (a *Agent) Snapshots(job string, uid uint32) ([]*ckpt.Manifest, error) {
	jobs := []string{job}
	if job == "" {
		var err error
		if jobs, err = a.store.Jobs(); err != nil {
			return nil, err
		}
	}
	var out []*ckpt.Manifest
	for _, jid := range jobs {
		ids, err := a.store.List(jid, "")
		if err != nil {
			return nil, err
		}
		for _, id := range ids {
			// A user's listing, which any user may repeat at will, reads the manifests (up to 16 MiB each) of
			// its own snapshots only: the bounded job record says whose a snapshot is.
			if uid != 0 && !a.ownsSnapshotAt(jid, id, uid) {
				continue
			}
			m, err := a.store.Manifest(jid, id)
			if err != nil {
				a.log.Warn("unreadable snapshot manifest", "job", jid, "snapshot", id, "err", err)
				continue
			}
			out = append(out, m)
		}
	}
	return out, nil
}

// ownsSnapshot reports whether the job record inside the snapshot belongs to uid. The record may be a
// peer's (a replica), read here for any user's listing before any verification: it is read as a restore
// reads it (snapshotRecord), bounded and through no link, so that one of any size cannot exhaust the
// agent's memory.
func (a *Agent) ownsSnapshot(m *ckpt.Manifest, uid uint32) bool {
	return a.ownsSnapshotAt(m.Job, m.ID, uid)
}

// ownsSnapshotAt is ownsSnapshot for snapshot id of job, before its manifest is read (job and id valid).
func (a *Agent) ownsSnapshotAt(job, id string, uid uint32) bool {
	j, err := a.recordAt(job, id)
	return err == nil && j.UID == uid
}

// pruneOwn deletes job's snapshots past retention (checkpoint.keep), once a newer one is replicated; those
// a cut pins, recorded or not yet committed, stay.
func (a *Agent) pruneOwn(ctx context.Context, job string) {
	if pruned, err := a.store.Prune(ctx, job, a.cfg.Checkpoint.Keep, a.pinnedSnapshots(job)...); err != nil {
		a.log.Warn("prune snapshots", "job", job, "err", err)
	} else if len(pruned) > 0 {
		a.log.Debug("pruned snapshots", "job", job, "ids", pruned)
	}
}
