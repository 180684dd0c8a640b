package agent

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/internal/autogroup"
	"github.com/ftkit/ftkit/internal/tickgrid"
	"golang.org/x/sys/unix"
)

// Failure detection follows RADIC: every node sends heartbeats to its protector (the next node of the
// ring) over one long-lived authenticated connection; the protector's watchdog suspects its predecessor
// after heartbeat.timeout of silence (longer while the last beat said the predecessor was checkpointing
// or restoring, which can stall a host), then confirms before declaring a failure: a direct probe of the
// suspect's agent, and the suspect's other neighbour is asked whether it still reaches it. Only then does
// the protector, which holds the suspect's replicas, start the fail-over. Both confirmations run in
// parallel and are bounded by heartbeat.probe_timeout, a beat that arrives meanwhile refutes the
// suspicion, and a watchdog that itself ran late suspects nobody (detect.Config.MaxCheckGap).

// watchdogConfig is the watchdog of this configuration. Its checks run every half interval; one that comes
// more than half a timeout after the previous one means this agent was not scheduled, and the silence it
// measured may be its own (corosync runs at realtime priority for the same reason; see docs/detection.md).
func watchdogConfig(c Config) detect.Config {
	return detect.Config{Timeout: c.Heartbeat.Timeout.Duration, BusyGrace: c.Heartbeat.BusyGrace.Duration,
		MaxCheckGap: max(c.Heartbeat.Timeout.Duration/2, 2*c.Heartbeat.Interval.Duration)}
}

// stallTick and stallLimit time the agent's watch over its own scheduling (watchSelf): ticks every half
// interval, on the watchdog's grid (a quarter interval doubled the instants the idle agent woke at: with
// the self-fence's pings, 598-624 context switches a second against 433-470 without both), a stall when
// one is later than a quarter timeout, well below the probe timeout.
func stallTick(c Config) time.Duration  { return c.Heartbeat.Interval.Duration / 2 }
func stallLimit(c Config) time.Duration { return c.Heartbeat.Timeout.Duration / 4 }

// watchSelf ticks the stall monitor: a failed confirmation taken while this agent stalled is not
// evidence (watchPredecessor).
func (a *Agent) watchSelf(ctx context.Context) {
	tickgrid.Every(ctx, stallTick(a.cfg), func() { a.stalls.Tick(time.Now()) })
}

// keepPriority gives every thread of the agent heartbeat.nice, with SCHED_RESET_ON_FORK so that the
// processes it starts run at nice 0. The flag also resets the Go runtime's new threads (created by clone),
// so it is applied again every second: a thread the runtime adds runs at nice 0 for at most that long.
// The agent's autogroup gets it too (package autogroup: against jobs in other sessions only the group's
// value counts).
func (a *Agent) keepPriority(ctx context.Context) {
	if a.cfg.Heartbeat.Nice == 0 {
		return
	}
	if err := autogroup.Set(a.cfg.Heartbeat.Nice); err != nil {
		a.log.Warn("heartbeat.nice: this agent's autogroup keeps its priority, so that jobs in other sessions weigh as much as the agent", "err", err)
	}
	apply := func() {
		tids, err := os.ReadDir("/proc/self/task")
		if err != nil {
			a.log.Warn("heartbeat.nice: list this agent's threads", "err", err)
			return
		}
		for _, t := range tids {
			tid, err := strconv.Atoi(t.Name())
			if err != nil {
				continue
			}
			attr := unix.SchedAttr{Policy: unix.SCHED_NORMAL, Flags: unix.SCHED_FLAG_RESET_ON_FORK, Nice: int32(a.cfg.Heartbeat.Nice)}
			if err := unix.SchedSetAttr(tid, &attr, 0); err != nil && !errors.Is(err, unix.ESRCH) {
				a.log.Warn("heartbeat.nice: set the nice value of a thread (needs CAP_SYS_NICE)", "tid", tid, "err", err)
				return
			}
		}
	}
	apply()
	tickgrid.Every(ctx, time.Second, apply)
}

// setBusy records that this host is in a long operation (detect.BusyCheckpoint or BusyRestore) until the
// returned func is called; heartbeats carry it. A beat goes at once: the operation may starve the next
// ones (a large dump on a loaded host), and the protector must know before their silence makes it suspect.
func (a *Agent) setBusy(what string) func() {
	end := a.busy.begin(what)
	select {
	case a.beatNow <- struct{}{}:
	default: // one is due already
	}
	return end
}

// busyOps counts the long operations in progress by kind: a checkpoint may run while a restore does.
type busyOps struct {
	mu sync.Mutex
	n  map[string]int
}

func (b *busyOps) begin(what string) (end func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.n == nil {
		b.n = map[string]int{}
	}
	b.n[what]++
	return sync.OnceFunc(func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		b.n[what]--
	})
}

// current is the operation a heartbeat announces: a restore before a checkpoint, "" for none.
func (b *busyOps) current() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, what := range []string{detect.BusyRestore, detect.BusyCheckpoint} {
		if b.n[what] > 0 {
			return what
		}
	}
	return ""
}

// sendBeats keeps a heartbeat stream to the current protector: a beat every interval, and one at once
// (beatNow) when a job's replica is found to lack connections, so that the protector learns it before a
// failure could make it restore that replica, and when a long operation begins (setBusy).
func (a *Agent) sendBeats(ctx context.Context) {
	b := beatStream{shared: &a.beating, run: rand.Uint64() | 1}
	defer b.close()
	// On the grid of the interval (tickgrid), with the agent's other loops.
	interval := a.cfg.Heartbeat.Interval.Duration
	next := func(now time.Time) time.Time { return now.Add(tickgrid.Until(now, interval)) }
	due := next(time.Now())
	tick := time.NewTimer(time.Until(due))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.beatNow:
			a.sendBeat(ctx, &b)
		case <-tick.C:
			// Not the channel's value: since Go 1.23 it is the instant the timer was due, not when this
			// goroutine ran.
			woke, was := time.Now(), due
			due = next(woke)
			tick.Reset(time.Until(due))
			a.sendBeat(ctx, &b)
			a.loops.Mark(loopBeats, time.Now())
			// A beat that left a quarter timeout after its instant is the sender's share of a silence its
			// protector may take for a failure: say whether this agent woke late (a starved host) or the
			// beat took long to go.
			if sent := time.Now(); sent.Sub(was) > a.cfg.Heartbeat.Timeout.Duration/4 {
				a.log.Info("heartbeat sent late", "protector", b.to, "late", sent.Sub(was).Round(time.Millisecond),
					"woke_late", woke.Sub(was).Round(time.Millisecond), "took", sent.Sub(woke).Round(time.Millisecond))
			}
		}
	}
}

// beatStream is the heartbeat stream to the current protector.
type beatStream struct {
	c      *clusterapi.BeatStream
	to     string
	run    uint64 // this agent's run (detect.Beat.Run)
	seq    uint64
	shared *beatContact
}

func (b *beatStream) open(to string, c *clusterapi.BeatStream) {
	b.c, b.to = c, to
	b.shared.set(to, c)
}

func (b *beatStream) close() {
	if b.c != nil {
		b.shared.set("", nil)
		b.c.Close()
		b.c = nil
	}
}

// beatContact shares the open heartbeat stream with the self-fence: the protector's TCP acknowledges the
// beats, which proves contact with its host as a ping answered would, without a request of its own.
type beatContact struct {
	mu sync.Mutex
	to string
	c  *clusterapi.BeatStream
}

func (b *beatContact) set(to string, c *clusterapi.BeatStream) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.to, b.c = to, c
}

// last returns the member the stream goes to and when the newest write of it that the member's host
// acknowledged began; false if there is no stream or nothing of it was acknowledged yet.
func (b *beatContact) last() (string, time.Time, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.c == nil {
		return "", time.Time{}, false
	}
	at, ok := b.c.Acked()
	return b.to, at, ok
}

// sendBeat sends one beat on b, (re)opening it to the current protector as needed.
func (a *Agent) sendBeat(ctx context.Context, b *beatStream) {
	p, ok := a.protector()
	if !ok || p.Name != b.to {
		b.close()
	}
	if !ok {
		return
	}
	if b.c == nil {
		// The stream lives as long as ctx; each beat must be written within the heartbeat timeout.
		conn, err := a.peers().Heartbeats(ctx, p.Name, a.cfg.Heartbeat.Timeout.Duration)
		if err != nil {
			a.log.Debug("heartbeat: protector unreachable", "protector", p.Name, "err", err)
			a.metrics.Heartbeat(false)
			return
		}
		b.open(p.Name, conn)
	}
	b.seq++
	busy := a.busy.current()
	var jobs []string
	var uncovered []detect.Uncovered
	for _, j := range a.Jobs(0) {
		if j.State == JobRunning {
			jobs = append(jobs, j.ID)
			if j.Protected() && len(j.NewConns) > 0 {
				uncovered = append(uncovered, detect.Uncovered{Job: j.ID, Replica: j.Replica.Snapshot})
			}
		}
	}
	err := b.c.Send(detect.Beat{From: a.cfg.Name, Seq: b.seq, Run: b.run, Busy: busy, Jobs: jobs, Uncovered: uncovered, Sent: time.Now()})
	a.metrics.Heartbeat(err == nil)
	if err != nil {
		a.log.Debug("heartbeat lost", "protector", b.to, "err", err)
		b.close()
	}
}

// watchPredecessor runs the watchdog over this node's predecessor and starts a fail-over once a suspicion
// is confirmed.
func (a *Agent) watchPredecessor(ctx context.Context) {
	watching := ""
	var late uint64
	// On the grid of half the heartbeat interval, with the agent's other loops, and once more just after
	// the predecessor's silence would pass the timeout (Watchdog.Due): its beats are on the grid of the
	// interval too, so the check at that instant finds the silence a hair short of the timeout, and the
	// next one would come half an interval later (detection took 30 ms longer at a 75 ms interval).
	tickgrid.EveryOrAt(ctx, a.cfg.Heartbeat.Interval.Duration/2, func() time.Time {
		now := time.Now()
		a.loops.Mark(loopWatchdog, now)
		if n := a.watchdog.LateChecks(); n != late {
			late = n
			a.log.Warn("this agent's watchdog ran late (starved host?): no suspicion until it runs on time again", "late_checks", n)
		}
		pred, ok := a.View().Predecessor(a.cfg.Name)
		if !ok {
			pred.Name = ""
		}
		if pred.Name != watching {
			if watching != "" {
				a.watchdog.Unwatch(watching)
			}
			if pred.Name != "" {
				a.watchdog.Watch(pred.Name, now)
				a.log.Info("watching predecessor", "node", pred.Name)
			}
			watching = pred.Name
		}
		suspects := a.watchdog.Suspects(now)
		for _, s := range suspects {
			if s.Name != watching {
				continue
			}
			// The predecessor's kernel is asked at the same time as the usual probes, so that a dead host costs
			// no more: a busy predecessor keeps its grace while it answers, and one whose agent is silent while
			// its host answers is not failed over without a fence command (judge).
			hostUp := make(chan error, 1)
			go func() { hostUp <- a.hostAnswers(ctx, s.Name) }()
			if !s.InGrace {
				a.log.Warn("predecessor suspected", "node", s.Name, "silence", s.Silence.Round(time.Millisecond))
			}
			why, alive := a.confirm(ctx, s.Name)
			hostErr := errHostNotAsked
			if s.InGrace || !alive {
				hostErr = <-hostUp
			}
			v, why := judge(probed{
				inGrace: s.InGrace, agentAlive: alive, why: why, hostAnswers: hostErr == nil,
				heard: a.watchdog.HeardSince(s.Name, now), stalled: a.stalls.Since(now.Add(-s.Silence), time.Now()),
				fenceCommand: len(a.cfg.Failover.FenceCommand) > 0,
			})
			switch v {
			case verdictBusy:
				a.log.Info("predecessor silent while busy, its host answers: waiting up to heartbeat.busy_grace",
					"node", s.Name, "busy", s.Busy, "silence", s.Silence.Round(time.Millisecond))
				a.metrics.BusySilence()
				a.watchdog.Clear(s.Name, time.Now())
				continue
			case verdictUnresponsive:
				a.metrics.UnresponsiveAgent()
				a.log.Error("predecessor's agent does not answer but its host does: not failing over, its jobs may still run there; "+
					"restart ftagent there, or configure failover.fence_command so that such a host is powered off and its jobs restored",
					"node", s.Name, "silence", s.Silence.Round(time.Millisecond))
				a.watchdog.Clear(s.Name, time.Now())
				continue
			case verdictCleared:
				a.metrics.Suspicion(true)
				a.log.Info("suspicion cleared", "node", s.Name, "why", why)
				a.watchdog.Clear(s.Name, time.Now())
				continue
			}
			if s.InGrace {
				a.log.Warn("predecessor suspected: silent while busy, and neither its agent nor its host answers",
					"node", s.Name, "busy", s.Busy, "silence", s.Silence.Round(time.Millisecond), "err", hostErr)
			}
			a.metrics.Suspicion(false)
			// A node cut off from the ring sees its predecessor fall silent too: if its own protector (another
			// node) does not answer either, this node is the one isolated, and it fences itself instead.
			if p, ok := a.protector(); ok && p.Name != s.Name {
				if _, reached := a.reaches(ctx, p.Name); !reached {
					a.log.Error("predecessor silent, but this node's protector does not answer either: this node is cut off, not failing over",
						"node", s.Name, "protector", p.Name)
					a.watchdog.Clear(s.Name, time.Now())
					continue
				}
			}
			// A node back from a partition holds the view it had before: it may have been replaced while away,
			// and its predecessor's silence is then its own absence. Learn the newest view before acting.
			a.refreshView(ctx, s.Name)
			if p, ok := a.View().Predecessor(a.cfg.Name); !ok || p.Name != s.Name {
				a.log.Warn("not failing over: the newest view says this node no longer watches it (replaced while cut off?)",
					"node", s.Name, "epoch", a.View().Epoch)
				a.watchdog.Clear(s.Name, time.Now())
				continue
			}
			s.Jobs = a.replicas.since(s.Name, s.LastBeat, s.Jobs)
			if !a.cfg.Failover.Automatic {
				if err := a.declared.fail(s.Name, a.incarnationOf(s.Name), s.Since); err != nil {
					a.log.Warn("not declaring it failed: the node answered after its silence began", "node", s.Name, "err", err)
					continue
				}
				a.log.Error("node failed; automatic fail-over is off: restore its jobs with `ftctl restore`", "node", s.Name, "jobs", s.Jobs,
					"jobs_not_listed", s.Unlisted)
				a.recordFailure(s, time.Now())
				continue
			}
			go a.failover(context.WithoutCancel(ctx), s, time.Now())
		}
		if len(suspects) > 0 {
			a.watchdog.Checked(time.Now()) // the confirmations' probes took this time, not a stall of the watchdog
		}
		if due, ok := a.watchdog.Due(); ok {
			return due.Add(time.Millisecond)
		}
		return time.Time{}
	})
}

// probed is what a suspicion's confirmation found out about the predecessor.
type probed struct {
	inGrace      bool   // its last beat said busy, and its busy_grace has not run out
	agentAlive   bool   // its agent answered a probe, directly or through its other neighbour
	why          string // how it answered
	hostAnswers  bool   // its kernel completed or refused a TCP handshake
	heard        bool   // a beat of it arrived during the confirmation
	stalled      bool   // this agent stalled while it measured the silence or probed
	fenceCommand bool   // a fence command can power its host off
}

// verdict is what a suspicion leads to.
type verdict int

const (
	verdictFailed       verdict = iota // declared failed (if nothing else stops the fail-over)
	verdictBusy                        // a busy predecessor whose host answers: left alone within its grace
	verdictCleared                     // alive, or the silence is no evidence
	verdictUnresponsive                // its agent is silent while its host answers: not failed over
)

// judge decides a suspicion, with why for a cleared one.
func judge(p probed) (verdict, string) {
	switch {
	case p.inGrace && (p.agentAlive || p.hostAnswers):
		return verdictBusy, ""
	case p.agentAlive:
		return verdictCleared, p.why
	case p.heard:
		return verdictCleared, "it sent a heartbeat during confirmation"
	case p.stalled:
		// The silence and the failed probes were measured by this agent: if it stalled meanwhile (a starved
		// host), the beats and answers may be sitting unread behind the stall.
		return verdictCleared, "this agent itself stalled while measuring the silence or probing (starved host?); not evidence"
	case p.hostAnswers && !p.fenceCommand:
		// A host that completes a TCP handshake is up and reachable: it is not cut off, so it will not fence
		// itself, and its agent (hung, stopped or starved) will not either. Restoring its jobs elsewhere would
		// run them twice; only a fence command, which powers the host off first, makes that safe.
		return verdictUnresponsive, ""
	}
	return verdictFailed, ""
}

// errHostNotAsked stands for a host whose answer was not awaited: its agent answered.
var errHostNotAsked = errors.New("host not asked: its agent answered")

// hostAnswers checks that name's host still runs, whatever its agent does: its kernel completes a TCP
// handshake (or refuses it) within the probe timeout.
func (a *Agent) hostAnswers(ctx context.Context, name string) error {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.ProbeTimeout())
	defer cancel()
	return a.peers().HostAnswers(ctx, name)
}

// refreshView exchanges views with every alive member but the suspect (which does not answer: waiting
// for it would delay every fail-over by a request timeout), adopting any newer one.
func (a *Agent) refreshView(ctx context.Context, suspect string) {
	a.exchangeViews(ctx, suspect, "view not exchanged")
}

// confirm checks a suspect before it is declared failed: it is alive if its host answers a direct probe
// or if its other neighbour still reaches it. Both questions are asked at once, so confirmation costs one
// probe timeout.
func (a *Agent) confirm(ctx context.Context, name string) (why string, alive bool) {
	type answer struct {
		why   string
		alive bool
	}
	answers := make(chan answer, 2)
	go func() {
		why, ok := a.reaches(ctx, name)
		answers <- answer{why, ok}
	}()
	asked := 1
	if other, ok := a.View().Predecessor(name); ok && other.Name != a.cfg.Name {
		asked++
		go func() {
			ok := a.askReach(ctx, other.Name, name)
			answers <- answer{other.Name + " still reaches it", ok}
		}()
	}
	for range asked {
		if ans := <-answers; ans.alive {
			return ans.why, true
		}
	}
	return "", false
}

// askReach asks member via whether it reaches member name.
func (a *Agent) askReach(ctx context.Context, via, name string) bool {
	// The other neighbour probes the suspect with the same deadline: its answer needs that and a round trip.
	ctx, cancel := context.WithTimeout(ctx, 2*a.cfg.ProbeTimeout())
	defer cancel()
	r, err := a.peers().Probe(ctx, via, clusterapi.ProbeRequest{Name: name})
	if err != nil {
		return false // the other neighbour is gone too (or does not answer): nobody reaches the suspect
	}
	return r.Reachable
}

// serveProbe answers whether this host reaches member req.Name.
func (a *Agent) serveProbe(req clusterapi.ProbeRequest) (clusterapi.ProbeReply, error) {
	if _, ok := a.member(req.Name); !ok {
		return clusterapi.ProbeReply{Name: req.Name}, fmt.Errorf("%q is not a cluster member", req.Name)
	}
	_, ok := a.reaches(context.Background(), req.Name)
	return clusterapi.ProbeReply{Name: req.Name, Reachable: ok}, nil
}

// probePing pings member name's agent, bounded by the probe timeout: the one question of whether a member
// answers, for confirmation, majority checks and fail-overs.
func (a *Agent) probePing(ctx context.Context, name string) error {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.ProbeTimeout())
	defer cancel()
	_, err := a.Ping(ctx, name)
	return err
}

// reaches reports whether member name's host is up: its agent answers a ping within the heartbeat timeout,
// or its kernel refuses the connection. A refusal means the host runs but its agent does not (crashed or
// restarting): its jobs run on under their shims, so restoring them elsewhere would run them twice.
func (a *Agent) reaches(ctx context.Context, name string) (why string, ok bool) {
	err := a.probePing(ctx, name)
	switch {
	case err == nil:
		return "its agent answered a direct probe", true
	case errors.Is(err, syscall.ECONNREFUSED):
		a.log.Warn("the host answers but its agent does not: not failing over; restart ftagent there", "node", name)
		return "its host refused the connection (up, agent down)", true
	}
	return "", false
}
