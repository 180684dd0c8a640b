package coordinated

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/tickgrid"
)

// attempts is how often a coordinated snapshot is tried when its check finds a byte in no snapshot
// (acknowledged by a receiver after its dump, before its sender's), or a host's dump asks for it again
// (clusterapi.CodeRetry: a connection reached a frozen job's listen queue after its freeze looked).
const attempts = 3

// Members is what a coordinator needs of its cluster.
type Members interface {
	// Alive are the names of the alive members in this host's view.
	Alive() []string
	// Coordinate runs one phase on host: a peer's agent, or this host's own when host is this one.
	Coordinate(ctx context.Context, host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error)
}

// Coordinator drives the cuts and rollbacks this host coordinates.
type Coordinator struct {
	Self    string // this host's name
	Members Members
	Records Records
	// Underway keeps the cuts under way here until they are committed or given up: an agent restarted
	// meanwhile gives them up (AbortLeft).
	Underway Underway
	Log      *slog.Logger
}

// Snapshot takes a cut of run (of user owner; nil: of the one user with a run of that name) across the
// cluster, trying again when the snapshots do not fit together or a host's dump asks for it.
func (c *Coordinator) Snapshot(ctx context.Context, run string, owner *uint32) (*Cut, error) {
	if err := clusterapi.ValidRunName(run); err != nil {
		return nil, err
	}
	var errs []error
	for range attempts {
		cut, err := c.take(ctx, run, owner)
		var torn *TornError
		if !errors.As(err, &torn) && !clusterapi.Retry(err) {
			return cut, err
		}
		c.Log.Warn("coordinated snapshot not taken; taking it again", "run", run, "err", err)
		errs = append(errs, err)
		// After a random pause: two coordinators whose cuts met on two hosts must not meet again.
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("run %s: %w", run, errors.Join(append(errs, ctx.Err())...))
		case <-time.After(rand.N(retryJitter)):
		}
	}
	return nil, fmt.Errorf("run %s: %d coordinated snapshots in a row were not taken: %w", run, attempts, errors.Join(errs...))
}

// retryJitter bounds the random pause before another attempt of a cut.
const retryJitter = 500 * time.Millisecond

// take is one attempt: list, freeze, dump, thaw (and replicate), check, commit.
func (c *Coordinator) take(ctx context.Context, run string, owner *uint32) (*Cut, error) {
	hosts, uid, err := c.RunHosts(ctx, run, owner)
	if err != nil {
		return nil, err
	}
	cut := &Cut{Run: run, UID: uid, ID: "cut-" + time.Now().UTC().Format("20060102T150405.000"), Taken: time.Now().UTC()}
	req := func(phase clusterapi.CoordPhase) clusterapi.CoordinateRequest {
		return clusterapi.CoordinateRequest{Run: run, UID: &uid, Cut: cut.ID, Phase: phase}
	}
	// Recorded before any host freezes, forgotten once every host was told the cut's end: a restarted
	// coordinator keeps its incarnation, no view declares it failed, and without the record its hosts would
	// hold the cut until their bounds (AbortLeft).
	if err := c.Underway.begin(run, uid, cut.ID, hosts); err != nil {
		return nil, fmt.Errorf("coordinated snapshot of run %s not taken, nothing frozen: %w", run, err)
	}
	defer func() {
		if err := c.Underway.end(run, uid, cut.ID); err != nil {
			c.Log.Warn("a coordinated snapshot that ended is still recorded as under way: the next agent sends its hosts its abort again (a no-op)", "run", run, "cut", cut.ID, "err", err)
		}
	}()
	abort := func(why error) error {
		c.onHosts(context.WithoutCancel(ctx), hosts, func(string) clusterapi.CoordinateRequest { return req(clusterapi.CoordAbort) })
		if cause := context.Cause(ctx); cause != nil && !errors.Is(why, cause) {
			why = fmt.Errorf("%w (%w)", why, cause)
		}
		return fmt.Errorf("coordinated snapshot of run %s given up, its jobs thawed: %w", run, why)
	}
	// A host of the run that fails never answers (a powered-off host sends no reset): its call would
	// wait as long as a dump may take (clusterapi.MaxCoordStep), the other hosts holding the run frozen,
	// and their snapshot lock, which the run's rollback after that failure needs.
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stopWatch := c.cancelUnlessAlive(ctx, hosts, cancel)
	defer stopWatch()
	if _, err := c.onHosts(ctx, hosts, func(string) clusterapi.CoordinateRequest { return req(clusterapi.CoordFreeze) }); err != nil {
		return nil, abort(err)
	}
	dumped, err := c.onHosts(ctx, hosts, func(string) clusterapi.CoordinateRequest { return req(clusterapi.CoordDump) })
	if err != nil {
		return nil, abort(err)
	}
	// Thawing replicates the dumps: a cut is recorded only once every part of it is on a protector.
	replicated, err := c.onHosts(ctx, hosts, func(string) clusterapi.CoordinateRequest { return req(clusterapi.CoordThaw) })
	for _, rep := range replicated {
		cut.Frozen = max(cut.Frozen, rep.Frozen)
	}
	if err != nil {
		// A thaw that did not reach its host (a reset connection, ctx ended by another host's failure) left
		// that host's hold, its jobs frozen and its snapshot lock taken, until the hold's bound after its
		// dump (clusterapi.MaxCoordStep): the abort ends it now, and is a no-op where the thaw did.
		c.onHosts(context.WithoutCancel(ctx), hosts, func(string) clusterapi.CoordinateRequest { return req(clusterapi.CoordAbort) })
		return nil, fmt.Errorf("coordinated snapshot of run %s not recorded: %w", run, err)
	}
	// A cut not recorded is given up on every host (the abort, after the thaw, only unpins its snapshots
	// there, Uncommitted): another cut of the run no longer replaces its pins.
	giveUp := func() {
		c.onHosts(context.WithoutCancel(ctx), hosts, func(string) clusterapi.CoordinateRequest { return req(clusterapi.CoordAbort) })
	}
	var parts []clusterapi.CutPart
	for _, h := range hosts {
		parts = append(parts, dumped[h].Parts...)
		if len(replicated[h].Parts) != len(dumped[h].Parts) {
			giveUp()
			return nil, fmt.Errorf("coordinated snapshot of run %s not recorded: %s replicated %d of its %d parts", run, h, len(replicated[h].Parts), len(dumped[h].Parts))
		}
	}
	if err := Check(parts); err != nil {
		giveUp()
		return nil, err
	}
	for i := range parts {
		parts[i].Conns = nil // checked; the record names the snapshots, which hold them
	}
	cut.Parts = parts
	stopWatch() // every part is replicated: the cut holds whatever fails now
	// Every alive member keeps the record, so that any of them can roll the run back.
	commit := req(clusterapi.CoordCommit)
	commit.Parts = parts
	// As every peer's client would: a cut its members cannot record (jobs started since the list took it past
	// MaxCutParts, a host's dump reply naming no snapshot) is refused here, not recorded on this host alone,
	// whose own commit no client validates.
	if err := commit.Validate(); err != nil {
		giveUp()
		return nil, fmt.Errorf("%w: coordinated snapshot of run %s not recorded: %w", ErrRefused, run, err)
	}
	// Nor one longer than a peer's server reads (thousands of jobs with long names): every peer refused it,
	// the cut was recorded on this host alone, and the peers' pins of its snapshots, never committed, held
	// their jobs' replication until the pins' bound.
	if b, err := json.Marshal(commit); err != nil || len(b) > clusterapi.MaxMessage {
		giveUp()
		if err == nil {
			err = fmt.Errorf("its commit of %d parts is %d bytes, a member reads at most %d (use message logging: recovery \"message-logging\")", len(parts), len(b), clusterapi.MaxMessage)
		}
		return nil, fmt.Errorf("%w: coordinated snapshot of run %s not recorded: %w", ErrRefused, run, err)
	}
	// Forgotten before the commit is sent, not after: a commit that reached some members only must not be
	// given up on the others by a restarted agent, whose abort would unpin the snapshots those records name.
	if err := c.Underway.end(run, uid, cut.ID); err != nil {
		giveUp()
		return nil, fmt.Errorf("coordinated snapshot of run %s not recorded: %w", run, err)
	}
	if _, err := c.onHosts(ctx, c.Members.Alive(), func(string) clusterapi.CoordinateRequest { return commit }); err != nil {
		c.Log.Warn("coordinated snapshot recorded on some members only", "run", run, "cut", cut.ID, "err", err)
	}
	c.Log.Info("coordinated snapshot of a run", "run", run, "cut", cut.ID, "jobs", len(parts), "hosts", len(hosts), "frozen_ms", cut.Frozen.Milliseconds())
	return cut, nil
}

// aliveEvery is how often a coordinator looks whether the hosts of a cut under way are still alive.
const aliveEvery = 250 * time.Millisecond

// cancelUnlessAlive cancels ctx once one of hosts is no longer an alive member in this host's view, until
// the returned function stops it.
func (c *Coordinator) cancelUnlessAlive(ctx context.Context, hosts []string, cancel context.CancelCauseFunc) (stop func()) {
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(aliveEvery)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			alive := c.Members.Alive()
			for _, h := range hosts {
				if !slices.Contains(alive, h) {
					cancel(fmt.Errorf("host %s of the run is no longer an alive member", h))
					return
				}
			}
		}
	}()
	return sync.OnceFunc(func() { close(done) })
}

// RunHosts asks every alive member which jobs of run (of user owner; nil: of the one user who has a run
// of that name) it runs, and returns the members that run some and the run's user.
func (c *Coordinator) RunHosts(ctx context.Context, run string, owner *uint32) ([]string, uint32, error) {
	alive := c.Members.Alive()
	listed, err := c.list(ctx, alive, run, owner)
	if err != nil {
		return nil, 0, err
	}
	users := map[uint32]bool{}
	var hosts []string
	jobs := 0
	for _, h := range alive {
		if len(listed[h].Jobs) > 0 {
			hosts = append(hosts, h)
		}
		jobs += len(listed[h].Jobs)
		for _, u := range listed[h].Owners {
			users[u] = true
		}
	}
	switch {
	case len(hosts) == 0:
		return nil, 0, fmt.Errorf("%w: run %s has no running job on an alive member (a job joins a run with its spec's run, `ftctl mpirun` sets it)", ErrNoRun, run)
	case len(users) > 1:
		return nil, 0, fmt.Errorf("%w: runs named %s of users %v: name the user (--uid)", ErrRefused, run, slices.Sorted(maps.Keys(users)))
	case jobs > clusterapi.MaxCutParts:
		return nil, 0, fmt.Errorf("%w: run %s has %d jobs, a coordinated snapshot holds at most %d (use message logging: recovery \"message-logging\")", ErrRefused, run, jobs, clusterapi.MaxCutParts)
	}
	var uid uint32
	for u := range users {
		uid = u
	}
	return hosts, uid, nil
}

// list asks hosts which jobs of run (of user owner, nil: of any user) they run.
func (c *Coordinator) list(ctx context.Context, hosts []string, run string, owner *uint32) (map[string]clusterapi.CoordinateReply, error) {
	listed, err := c.onHosts(ctx, hosts, func(string) clusterapi.CoordinateRequest {
		return clusterapi.CoordinateRequest{Run: run, UID: owner, Cut: "list", Phase: clusterapi.CoordList}
	})
	if err != nil {
		return nil, fmt.Errorf("list the jobs of run %s: %w", run, err)
	}
	return listed, nil
}

// onHosts runs the phase req(host) on each host at once and returns the replies by host; the error
// names every host that failed.
func (c *Coordinator) onHosts(ctx context.Context, hosts []string, req func(host string) clusterapi.CoordinateRequest) (map[string]clusterapi.CoordinateReply, error) {
	type result struct {
		host string
		rep  clusterapi.CoordinateReply
		err  error
	}
	out := make(chan result, len(hosts))
	for _, h := range hosts {
		go func() {
			r := req(h)
			rep, err := c.Members.Coordinate(ctx, h, r)
			if err != nil {
				err = fmt.Errorf("%s on %s: %w", r.Phase, h, err)
			}
			out <- result{h, rep, err}
		}()
	}
	reps := map[string]clusterapi.CoordinateReply{}
	var errs []error
	for range hosts {
		r := <-out
		reps[r.host] = r.rep
		errs = append(errs, r.err)
	}
	return reps, errors.Join(errs...)
}

// RollBack stops every job of cut's run, on every host, then restores each from its part where it runs
// now (the alive members are asked), or on its host if it runs nowhere; a part whose host is not alive and
// that runs nowhere is restored on target (a spare in place of a failed host; "": refused). held says
// whether this host holds a part's snapshot; stage gets the stages.
func (c *Coordinator) RollBack(ctx context.Context, cut *Cut, target string, held func(clusterapi.CutPart) bool, stage func(Stage)) error {
	alive := c.Members.Alive()
	listed, err := c.list(ctx, alive, cut.Run, &cut.UID)
	if err != nil {
		// A job of the run nobody could ask about could run on: a restored copy would be a second one.
		return fmt.Errorf("run %s not rolled back: where its jobs run is not known: %w", cut.Run, err)
	}
	where := map[string]string{} // job -> the host it runs on now
	for h, rep := range listed {
		for _, j := range rep.Jobs {
			where[j] = h
		}
	}
	byHost, hosts, err := Place(cut, where, alive, target, c.Self, held)
	if err != nil {
		return err
	}
	done := func(name string, from time.Time, err error) {
		stage(Stage{Name: name, Hosts: hosts, Start: from, End: time.Now(), Detail: fmt.Sprintf("run %s, cut %s", cut.Run, cut.ID), Err: err})
	}
	phase := func(p clusterapi.CoordPhase) func(string) clusterapi.CoordinateRequest {
		return func(h string) clusterapi.CoordinateRequest {
			return clusterapi.CoordinateRequest{Run: cut.Run, UID: &cut.UID, Cut: cut.ID, Phase: p, Parts: byHost[h]}
		}
	}
	// Every host holds (fetching it if need be) and verifies its parts before any job stops: a rollback
	// that could not restore a part would leave the whole run dead.
	start := time.Now()
	_, err = c.onHosts(ctx, hosts, phase(clusterapi.CoordPrepare))
	done(StagePrepared, start, err)
	if err != nil {
		return fmt.Errorf("run %s not rolled back to cut %s, nothing stopped: %w", cut.Run, cut.ID, err)
	}
	// Every job stops before any is restored: a restored job must never exchange with a live old one.
	start = time.Now()
	_, err = c.onHosts(ctx, hosts, phase(clusterapi.CoordStop))
	done(StageStopped, start, err)
	if err == nil {
		from := time.Now()
		_, err = c.onHosts(ctx, hosts, phase(clusterapi.CoordRestore))
		done(StageRolledBack, from, err)
	}
	if err != nil {
		return fmt.Errorf("rollback of run %s to cut %s failed: %w; `ftctl status` on its hosts shows which jobs run", cut.Run, cut.ID, err)
	}
	c.Log.Info("run rolled back to its coordinated snapshot", "run", cut.Run, "cut", cut.ID, "jobs", len(cut.Parts), "hosts", hosts, "ms", time.Since(start).Milliseconds())
	return nil
}

// AfterFailure recovers the failed host's jobs whose runs roll back as a whole: those in coordinated
// mode (coordinated), and, if message logging failed (mlErr), those in auto mode. Each such run rolls back
// to its cut, the failed host's parts on target. It returns what is left unrecovered (nil if every job of
// the failed host runs again).
func (c *Coordinator) AfterFailure(ctx context.Context, failed, target string, jobs, coordinated []string, mlErr error, held func(clusterapi.CutPart) bool, stage func(Stage)) error {
	// A run is its name and its user's: two users may both call theirs "farm".
	runs := map[Run]*Cut{}
	var order []Run
	rolled := map[string]bool{}
	for _, j := range jobs {
		cut, p := c.Records.With(j)
		switch {
		case cut == nil:
			continue
		case slices.Contains(coordinated, j), mlErr != nil && p.Recovery == RecoveryAuto:
		default:
			continue
		}
		k := Run{Name: cut.Run, UID: cut.UID}
		if _, ok := runs[k]; !ok {
			runs[k] = cut
			order = append(order, k)
		}
	}
	if len(order) == 0 {
		return mlErr
	}
	var errs []error
	for _, run := range order {
		cut := runs[run]
		why := "coordinated mode"
		if mlErr != nil {
			why = "message logging failed: " + mlErr.Error()
		}
		c.Log.Warn("rolling a whole run back to its coordinated snapshot", "run", run.Name, "uid", run.UID, "cut", cut.ID, "failed", failed, "target", target, "why", why)
		if err := c.RollBack(ctx, cut, target, held, stage); err != nil {
			errs = append(errs, err)
			continue
		}
		for _, p := range cut.Parts {
			rolled[p.Job] = true
		}
	}
	// A job neither message logging nor a rollback brought back keeps message logging's error, or is named.
	var left []string
	for _, j := range jobs {
		if !rolled[j] && (mlErr != nil || slices.Contains(coordinated, j)) {
			left = append(left, j)
		}
	}
	if len(left) > 0 {
		if mlErr == nil {
			mlErr = fmt.Errorf("job(s) %s of %s were not rolled back with their runs", strings.Join(left, ", "), failed)
		}
		return errors.Join(append(errs, mlErr)...)
	}
	return errors.Join(errs...)
}

// Schedule takes the coordinated snapshots of the runs due names (each with its jobs' shortest interval),
// at that interval since the run's newest cut, until ctx ends. Of the hosts that run a part of a run, the
// first by name coordinates; the others only take part. The coordinator tries a failed cut again sooner,
// and looks whether its newest cut holds every job of the run (pace): a rank that starts after the run's
// first cut, which an MPI launch makes likely, could not be rolled back until the next.
func (c *Coordinator) Schedule(ctx context.Context, due func() map[Run]time.Duration) {
	paces := map[Run]*pace{}
	tickgrid.Every(ctx, time.Second, func() {
		now := time.Now()
		runs := due()
		for k, iv := range runs {
			p := paces[k]
			if p == nil {
				p = &pace{}
				paces[k] = p
			}
			newest, _ := c.Records.Load(k.Name, &k.UID) // nil: none recorded, or an unreadable record
			take, look := p.next(now, iv, newest)
			forJobs := false
			if look {
				out, err := c.outOf(ctx, newest)
				p.lookedAt(now, len(out) > 0)
				if err != nil || len(out) == 0 {
					continue
				}
				c.Log.Info("jobs of a run are not in its newest coordinated snapshot (started after it): taking one now",
					"run", k.Name, "uid", k.UID, "cut", newest.ID, "jobs", out)
				take, forJobs = true, true
			}
			if !take {
				continue
			}
			p.tried = now
			hosts, _, err := c.RunHosts(ctx, k.Name, &k.UID)
			switch {
			case err != nil:
				p.took(false, forJobs)
				c.Log.Warn("scheduled coordinated snapshot: the run's jobs cannot be listed; retrying", "run", k.Name, "uid", k.UID,
					"in", backoff(p.failed, iv), "err", err)
				continue
			case slices.Min(hosts) != c.Self:
				*p = pace{tried: now} // another host coordinates
				continue
			}
			p.coordinates = true
			_, err = c.Snapshot(ctx, k.Name, &k.UID)
			p.took(err == nil, forJobs)
			if err != nil {
				c.Log.Warn("scheduled coordinated snapshot failed; retrying", "run", k.Name, "uid", k.UID, "in", backoff(p.failed, iv), "err", err)
			}
		}
		for k := range paces {
			if _, ok := runs[k]; !ok {
				delete(paces, k)
			}
		}
	})
}

// outOf lists the jobs of cut's run that cut does not hold.
func (c *Coordinator) outOf(ctx context.Context, cut *Cut) ([]string, error) {
	listed, err := c.list(ctx, c.Members.Alive(), cut.Run, &cut.UID)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, rep := range listed {
		for _, j := range rep.Jobs {
			if !cut.Holds(j) {
				out = append(out, j)
			}
		}
	}
	slices.Sort(out)
	return out, nil
}

// retryFirst is how long after a failed cut, or after its newest cut, the coordinator of a run tries or looks
// again, doubling up to the run's interval.
const retryFirst = 2 * time.Second

// backoff is the wait before the nth retry or look: retryFirst, doubling, at most iv.
func backoff(n int, iv time.Duration) time.Duration {
	return min(iv, retryFirst<<min(max(n, 1)-1, 16))
}

// pace is what Schedule keeps of one run.
type pace struct {
	tried       time.Time // the last attempt this host coordinated or declined
	coordinates bool      // this host coordinated the last attempt
	failed      int       // the attempts in a row that failed
	looks       int       // counts the gaps before the next look (backoff), from the newest cut
	looked      time.Time // the last look
	// streak counts the cuts in a row taken for jobs the cut before lacked: a run whose jobs keep coming
	// (a job per task) is looked at, and frozen for them, ever less often, never more than its interval asks.
	streak int
}

// lookedAt records a look at now, which found jobs of the run that its newest cut lacks or not.
func (p *pace) lookedAt(now time.Time, missing bool) {
	p.looked = now
	if !missing {
		p.looks++
		p.streak = 0
	}
}

// took records the end of a cut this host coordinated, taken for jobs its predecessor lacked (forJobs) or
// on the interval: the next look comes backoff(streak+1) after it.
func (p *pace) took(ok, forJobs bool) {
	if !ok {
		p.failed++
		return
	}
	p.failed = 0
	if forJobs {
		p.streak++
	}
	p.looks = p.streak
}

// next says whether to take a cut of a run of interval iv now, or first look whether its newest cut
// (nil: none) holds every job of the run. A host that coordinates the run tries a failed cut again after
// backoff, and looks after backoff since the newest cut or the last look; any host takes a cut an interval
// after the newest or its last attempt, whichever is later (the first at once).
func (p *pace) next(now time.Time, iv time.Duration, newest *Cut) (take, look bool) {
	last := p.tried
	if newest != nil && newest.Taken.After(last) {
		last = newest.Taken
	}
	switch {
	case p.failed > 0:
		return now.Sub(p.tried) >= backoff(p.failed, iv), false
	case now.Sub(last) >= iv:
		return true, false
	case p.coordinates && newest != nil:
		since := newest.Taken
		if p.looked.After(since) {
			since = p.looked
		}
		return false, now.Sub(since) >= backoff(p.looks+1, iv)
	}
	return false, false
}
