// Package detect is the protector's watchdog over the node it protects (RADIC: every node sends
// heartbeats to the next node in the ring, whose watchdog raises a suspicion when they stop).
//
// It is a pure state machine: the caller passes the current time to every call and owns the clock, the
// network and the follow-up. A suspicion is not a failure: RADIC confirms it first (a silent sender may
// just be checkpointing or restarting), so a suspect is reported once and stays quiet until the caller
// clears it (it answered) or a new beat arrives.
package detect

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
)

// Long operations a sender may announce in Beat.Busy: during them it may be unable to send beats on
// time (a CRIU dump freezes the sender's jobs, a restore loads them), and RADIC does not take that
// silence for a failure.
const (
	BusyCheckpoint = "checkpoint"
	BusyRestore    = "restore"
)

// Beat is one heartbeat.
type Beat struct {
	From string    `json:"from"`
	Seq  uint64    `json:"seq"`
	Busy string    `json:"busy,omitempty"` // "", BusyCheckpoint or BusyRestore
	Jobs []string  `json:"jobs,omitempty"` // jobs running on the sender: what to restore if it fails
	Sent time.Time `json:"sent"`           // sender's clock; only compared with the same sender's beats
	// Run tells the sender's runs apart (random, drawn at its start; 0 from an agent that sends none): a
	// beat of a new run is recorded whatever its Seq and Sent, a restarted sender's clock may be behind.
	Run uint64 `json:"run,omitempty"`
	// Uncovered are the sender's jobs whose replica lacks connections they opened since, as its last
	// check found: a restore from that replica, or an older one, could not rebuild them.
	Uncovered []Uncovered `json:"uncovered,omitempty"`
	// Unlisted counts the jobs the receiver left out of Jobs, past the most it keeps of a beat; never on
	// the wire.
	Unlisted int `json:"-"`
}

// Uncovered names a job and the replica that lacks some of its connections.
type Uncovered struct {
	Job     string `json:"job"`
	Replica string `json:"replica"`
}

// clone copies the beat's slices, which the watchdog keeps and hands out.
func (b Beat) clone() Beat {
	b.Jobs, b.Uncovered = slices.Clone(b.Jobs), slices.Clone(b.Uncovered)
	return b
}

// Config sets how long silence is tolerated.
type Config struct {
	Timeout time.Duration // silence before suspecting
	// BusyGrace is extra silence allowed while the last beat said Busy, to a member whose host still
	// answers (Suspect.InGrace): a busy member is suspected after Timeout like any other, and the caller
	// checks its host before treating the suspicion as one.
	BusyGrace time.Duration
	// MaxCheckGap is the longest gap between two calls of Suspects that counts as on time (0: any). A later
	// call means the watchdog itself was not scheduled (a starved or stopped host): beats may be queued
	// unread behind the same stall, so the silence it measured is not evidence. It suspects nobody then,
	// nor for another MaxCheckGap, the time its host needs to read what was queued.
	MaxCheckGap time.Duration
}

// Validate checks the configuration; the watchdog needs a positive Timeout and a non-negative BusyGrace.
func (c Config) Validate() error {
	var errs []error
	if c.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("heartbeat timeout %s must be positive", c.Timeout))
	}
	if c.BusyGrace < 0 {
		errs = append(errs, fmt.Errorf("heartbeat busy grace %s must not be negative", c.BusyGrace))
	}
	if c.MaxCheckGap < 0 {
		errs = append(errs, fmt.Errorf("watchdog max check gap %s must not be negative (0: no check)", c.MaxCheckGap))
	}
	return errors.Join(errs...)
}

// Suspect is a watched member that has been silent too long.
type Suspect struct {
	Name     string
	LastBeat time.Time     // when its last beat arrived (zero if none ever did)
	Silence  time.Duration // since its last beat, or since watching started if later
	Since    time.Time     // when that silence began: the start of Silence, on this host's clock
	// Watched is when watching it last started (Watch; a Clear does not move it): a beat before it came while
	// it was some other member's predecessor, or before a ring change made it ours again.
	Watched   time.Time
	Jobs      []string    // from its last beat
	Uncovered []Uncovered // from its last beat
	Unlisted  int         // jobs its last beat named past those kept in Jobs (Beat.Unlisted)
	// Busy is what its last beat said it was doing ("" for nothing); InGrace, that this beat arrived at
	// most Timeout+BusyGrace ago. A host that is checkpointing or restoring may starve its agent's beats,
	// not its kernel: a suspect in grace whose host still completes a TCP handshake is left alone (and
	// Cleared), one whose host does not is no different from any other suspect.
	Busy    string
	InGrace bool
}

type beat struct {
	b  Beat
	at time.Time
}

type watch struct {
	since     time.Time // silence counts from max(since, last beat's arrival)
	watched   time.Time // when Watch started it
	suspected bool
}

// Watchdog tracks heartbeats and the members being watched. It is safe for concurrent use.
type Watchdog struct {
	cfg     Config
	mu      sync.Mutex
	last    map[string]beat
	watched map[string]*watch
	checked time.Time // the last call of Suspects
	resume  time.Time // no suspicion before this: the watchdog itself was late (MaxCheckGap)
	late    uint64    // late checks so far
}

// NewWatchdog returns a watchdog watching nobody. cfg should pass Validate: with a non-positive Timeout
// every watched member is suspected as soon as any time passes.
func NewWatchdog(cfg Config) *Watchdog {
	return &Watchdog{cfg: cfg, last: map[string]beat{}, watched: map[string]*watch{}}
}

// Watch starts (or restarts) watching name, typically when the ring makes it our predecessor. Its silence
// counts from now, even if an older beat is known: the ring change, not the member, is what is new.
func (w *Watchdog) Watch(name string, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.watched[name] = &watch{since: now, watched: now}
}

// Unwatch stops watching name; its last beat is kept.
func (w *Watchdog) Unwatch(name string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.watched, name)
}

// Gap is the time between two consecutive recorded beats of one sender, as each side measured it.
type Gap struct {
	Arrived time.Duration // between their arrivals, on this host's clock
	Sent    time.Duration // between their sending, on the sender's clock
	Missing uint64        // beats of the sender's sequence between them that were never recorded
}

// Sender reports whether most of the gap went between the sender's two writes (its interval included:
// an on-time beat's gap is the sender's) rather than into delivering the later beat (the network, this
// host's kernel or its agent). Each side's figure is two readings of its own clock, so the hosts' clocks
// need not agree.
func (g Gap) Sender() bool { return g.Sent >= g.Arrived/2 }

// Beat records a heartbeat that arrived at now, from a watched member or not (a ring change may make
// the sender watched later). A beat older than the last one recorded from the same sender (a lower or
// equal Seq of the same Run, or from a sender without Run one not sent later) is a duplicate or arrived out of
// order and is ignored; a beat of another Run, or from a sender without Run a lower Seq sent later, is a
// restarted sender and is recorded. A recorded beat ends any suspicion of its sender. ok says that
// gap is the one since the sender's previous beat (the beat is recorded and continues its sequence), so
// that a long silence can be told apart: a late sender or late delivery.
func (w *Watchdog) Beat(b Beat, now time.Time) (gap Gap, ok bool) {
	if b.From == "" {
		return Gap{}, false
	}
	b = b.clone()
	w.mu.Lock()
	defer w.mu.Unlock()
	prev, heard := w.last[b.From]
	restarted := heard && b.Run != prev.b.Run
	// Within one Run the Seq only grows: a lower one came late, even if the sender's wall clock, stepped
	// back since, says it was sent later. Sent tells a restart only from an agent that sends no Run.
	if heard && !restarted && b.Seq <= prev.b.Seq && (b.Run != 0 || !b.Sent.After(prev.b.Sent)) {
		return Gap{}, false
	}
	w.last[b.From] = beat{b: b, at: now}
	if wt := w.watched[b.From]; wt != nil {
		wt.suspected = false
		// A Clear ahead of time (a caller backing off from a member that stayed silent) holds only while it
		// stays silent: from a beat on, its silence counts from the beat, or a crash soon after it would be
		// suspected only when that wait ran out.
		if wt.since.After(now) {
			wt.since = now
		}
	}
	if !heard || restarted || b.Seq <= prev.b.Seq {
		return Gap{}, false
	}
	return Gap{Arrived: now.Sub(prev.at), Sent: b.Sent.Sub(prev.b.Sent), Missing: b.Seq - prev.b.Seq - 1}, true
}

// Last returns name's last recorded beat and when it arrived.
func (w *Watchdog) Last(name string) (Beat, time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	l, ok := w.last[name]
	if !ok {
		return Beat{}, time.Time{}, false
	}
	return l.b.clone(), l.at, true
}

// Suspects returns, sorted by name, the watched members silent for longer than Timeout, saying which of
// them are still within their BusyGrace (Suspect.InGrace). Each suspicion is reported once,
// until Clear or a new beat from the suspect ends it. The caller calls it periodically: a call more than
// MaxCheckGap after the previous one suspects nobody (see Config.MaxCheckGap).
func (w *Watchdog) Suspects(now time.Time) []Suspect {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.cfg.MaxCheckGap > 0 {
		if !w.checked.IsZero() && now.Sub(w.checked) > w.cfg.MaxCheckGap {
			w.late++
			w.resume = now.Add(w.cfg.MaxCheckGap)
		}
		w.checked = now
		if now.Before(w.resume) {
			return nil
		}
	}
	var out []Suspect
	for name, wt := range w.watched {
		if wt.suspected {
			continue
		}
		from := w.silentSince(name, wt)
		silence := now.Sub(from)
		if silence <= w.cfg.Timeout {
			continue
		}
		wt.suspected = true
		s := Suspect{Name: name, Silence: silence, Since: from, Watched: wt.watched}
		if l, heard := w.last[name]; heard {
			b := l.b.clone()
			s.LastBeat, s.Jobs, s.Uncovered, s.Unlisted, s.Busy = l.at, b.Jobs, b.Uncovered, b.Unlisted, b.Busy
			s.InGrace = b.Busy != "" && now.Sub(l.at) <= w.cfg.Timeout+w.cfg.BusyGrace
		}
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b Suspect) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// silentSince is when name's silence began.
func (w *Watchdog) silentSince(name string, wt *watch) time.Time {
	from := wt.since
	if l, heard := w.last[name]; heard && l.at.After(from) {
		from = l.at
	}
	return from
}

// Due returns the first instant at which a call of Suspects could suspect a watched member not suspected
// yet, if no beat comes before: when its silence reaches the timeout (or, after a late check, when the
// watchdog resumes). ok is false if there is none. A caller checking on a grid calls Suspects just after
// it too: the beats may be on the same grid, and the check at that instant would find a silence a hair
// short of the timeout.
func (w *Watchdog) Due() (due time.Time, ok bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for name, wt := range w.watched {
		if wt.suspected {
			continue
		}
		if at := w.silentSince(name, wt).Add(w.cfg.Timeout); !ok || at.Before(due) {
			due, ok = at, true
		}
	}
	if ok && due.Before(w.resume) {
		due = w.resume
	}
	return due, ok
}

// Clear ends a suspicion that confirmation refuted (the suspect answered): its silence counts from now,
// and it will be suspected again only after another full timeout. now may be ahead of the clock (a caller
// backing off from a member that stays silent); a beat from the member ends that wait. Clearing a name not
// watched does nothing.
func (w *Watchdog) Clear(name string, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if wt := w.watched[name]; wt != nil {
		*wt = watch{since: now, watched: wt.watched}
	}
}

// Checked tells the watchdog its caller spent the time until now on purpose (confirming a suspicion, whose
// probes take up to their timeout): the next call's gap counts from now, not as the watchdog's own lateness.
func (w *Watchdog) Checked(now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if now.After(w.checked) {
		w.checked = now
	}
}

// LateChecks is how many calls of Suspects came more than MaxCheckGap after the previous one: how often
// this host's own scheduling, not a peer's silence, held suspicion back.
func (w *Watchdog) LateChecks() uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.late
}

// HeardSince reports whether a beat from name arrived after t: a suspect that beats again while its
// suspicion is being confirmed is alive, whatever the probes said.
func (w *Watchdog) HeardSince(name string, t time.Time) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	l, ok := w.last[name]
	return ok && l.at.After(t)
}
