// Package failurelog keeps the timelines of the failures an agent knows of: one Failure per node failure (or
// planned migration), with the Stages of its recovery. The protector that handles a failure writes its
// timeline; every agent receives copies with the membership views, so `ftctl events` works on any host. The
// copies come from other nodes, so the log bounds everything in them, and it is kept on disk so that a
// restarted agent still shows them.
package failurelog

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/ftkit/ftkit/internal/atomicfile"
)

// A Failure is the timeline of one node failure and its recovery, kept by the protector that handled it
// and copied to every agent with the membership view (so `ftctl events` works on any host).
type Failure struct {
	ID string `json:"id"`
	// Kind is "" for a failure, "migration" (agent.KindMigration) for a planned one (Node: the host it left).
	Kind      string    `json:"kind,omitempty"`
	Node      string    `json:"node"`      // the failed node
	Protector string    `json:"protector"` // who detected it and coordinated the recovery
	Target    string    `json:"target"`    // where its jobs were restored (a spare, or the protector in basic mode)
	Basic     bool      `json:"basic,omitempty"`
	LastBeat  time.Time `json:"last_beat"` // the failed node's last heartbeat
	Detected  time.Time `json:"detected"`
	Stages    []Stage   `json:"stages"`
	// StagesDropped counts the stages left out between the first and the newest MaxStages-1 (a recovery
	// of very many jobs).
	StagesDropped int       `json:"stages_dropped,omitempty"`
	Jobs          []string  `json:"jobs"`
	Done          bool      `json:"done"`
	Error         string    `json:"error,omitempty"` // set if recovery failed or is incomplete
	Updated       time.Time `json:"updated"`
	// TakenOver is the failure of this one's target, whose recovery took its jobs over: the target
	// failed during this recovery.
	TakenOver string `json:"taken_over,omitempty"`
	// Received is when this agent first learned of the failure (wrote it, merged a copy of it, or read it
	// from disk at start), on its own clock; it goes neither on the wire nor to disk. Detected and Updated
	// are the protector's wall clock: an age measured here is measured from Received, never from them.
	Received time.Time `json:"-"`
}

// A Stage is one step of a recovery.
type Stage struct {
	Name   string    `json:"name"` // detected, spare claimed, snapshot fetched, images rewritten, restored, replay done, re-protected
	Job    string    `json:"job,omitempty"`
	Host   string    `json:"host"`
	Start  time.Time `json:"start"`
	End    time.Time `json:"end"`
	Detail string    `json:"detail,omitempty"`
	Error  string    `json:"error,omitempty"`
}

// Duration is how long the stage took.
func (s Stage) Duration() time.Duration { return s.End.Sub(s.Start) }

// Bounds of the failure log. It travels inside every membership view message, whose size is bounded, and comes
// from other nodes, so neither the number of failures nor anything in one may grow without bound.
const (
	MaxFailures = 100  // the most recent ones are kept
	MaxStages   = 32   // per failure: the first (detection) and the newest
	MaxJobs     = 256  // job ids listed per failure
	maxText     = 1024 // bytes of an error or a stage's detail: room for a whole recovery error
	maxName     = 128  // bytes of an id, a node, host, job or stage name
	// maxFile bounds the log's file: MaxFailures timelines at the bounds above take about 11 MB, 70 MB
	// if every byte of their texts is one that JSON escapes to six.
	maxFile = 128 << 20
)

// Log holds the failures an agent knows of, on disk so that a restarted agent still shows them.
type Log struct {
	mu sync.Mutex
	// saveMu orders the saves: each lists the log and writes it as one step, so that a save that listed
	// an older log cannot rename its file over a newer one's.
	saveMu sync.Mutex
	path   string
	self   string // the agent's member name: the protector of the timelines it writes
	byID   map[string]*Failure
	// unsaved: a copy merged from a peer is not on disk yet (Merge does not write; Save clears it).
	unsaved bool
}

// Open reads the log kept in dir (failures.json) of the agent of member self, or starts an empty one.
func Open(dir, self string) (*Log, error) {
	l := &Log{path: filepath.Join(dir, "failures.json"), self: self, byID: map[string]*Failure{}}
	b, err := atomicfile.ReadBounded(l.path, maxFile)
	if errors.Is(err, fs.ErrNotExist) {
		return l, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the failure history %s (move it away to start with an empty one): %w", l.path, err)
	}
	var fs []*Failure
	if err := json.Unmarshal(b, &fs); err != nil {
		return nil, fmt.Errorf("%s is corrupt (move it away to start with an empty failure history): %w", l.path, err)
	}
	now := time.Now() // when this agent learned of them, as far as it can tell: at the latest now
	for _, f := range fs {
		if f != nil && validID(f.ID) {
			f.bound()
			f.Received = now
			l.byID[f.ID] = f
		}
	}
	l.trim() // a file written before the log was bounded
	return l, nil
}

func validID(id string) bool { return id != "" && len(id) <= maxName }

// bound clips a failure to the log's limits.
func (f *Failure) bound() {
	if n := len(f.Stages); n > MaxStages {
		// Keep the detection (the start of the timeline) and the newest stages (where the recovery is).
		kept := append([]Stage{f.Stages[0]}, f.Stages[n-(MaxStages-1):]...)
		f.StagesDropped += n - len(kept)
		f.Stages = kept
	}
	for i := range f.Stages {
		st := &f.Stages[i]
		st.Name, st.Job, st.Host = clip(st.Name, maxName), clip(st.Job, maxName), clip(st.Host, maxName)
		st.Detail, st.Error = clip(st.Detail, maxText), clip(st.Error, maxText)
	}
	// A copy: the caller may still hold the slice it set.
	f.Jobs = append([]string(nil), f.Jobs[:min(len(f.Jobs), MaxJobs)]...)
	for i := range f.Jobs {
		f.Jobs[i] = clip(f.Jobs[i], maxName)
	}
	f.Node, f.Protector, f.Target = clip(f.Node, maxName), clip(f.Protector, maxName), clip(f.Target, maxName)
	f.Kind, f.TakenOver = clip(f.Kind, maxName), clip(f.TakenOver, maxName)
	f.Error = clip(f.Error, maxText)
}

// clip cuts s to at most n bytes, at a character boundary, marking the cut.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const mark = "..."
	cut := n - len(mark)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark
}

// clone is a copy of f that shares none of its slices.
func (f *Failure) clone() *Failure {
	c := *f
	c.Stages = append([]Stage(nil), f.Stages...)
	c.Jobs = append([]string(nil), f.Jobs...)
	return &c
}

// when orders failures: by detection, or by the last update for one not yet stamped.
func (f *Failure) when() time.Time {
	if f.Detected.IsZero() {
		return f.Updated
	}
	return f.Detected
}

// trim drops failures beyond MaxFailures; call with l.mu held. It drops the oldest timeline of the
// protector that has the most in the log, this agent's own last. The agent acts on timelines (TakeOver and
// a migration resumed at start read its own; a rejoin waits for another protector's recovery under way):
// a member that sends made-up timelines by the hundred, dated after every real one (or its clock far
// ahead), must push only its own out, not an unfinished recovery another protector or this agent
// coordinates.
func (l *Log) trim() {
	if len(l.byID) <= MaxFailures {
		return
	}
	all := make([]*Failure, 0, len(l.byID))
	for _, f := range l.byID {
		all = append(all, f)
	}
	sortFailures(all)
	byProtector := map[string][]*Failure{} // each oldest first
	for _, f := range all {
		byProtector[f.Protector] = append(byProtector[f.Protector], f)
	}
	for excess := len(all) - MaxFailures; excess > 0; excess-- {
		most := ""
		for p, fs := range byProtector {
			if len(fs) == 0 {
				continue
			}
			if m := byProtector[most]; len(m) == 0 || l.larger(p, fs, most, m) {
				most = p
			}
		}
		delete(l.byID, byProtector[most][0].ID)
		byProtector[most] = byProtector[most][1:]
	}
}

// larger reports whether protector p's timelines fs leave the log before q's timelines gs (trim): this
// agent's own last, then the protector with more first, ties to the one whose oldest is older (by name
// then, so that agents trim the same ones of others).
func (l *Log) larger(p string, fs []*Failure, q string, gs []*Failure) bool {
	if po, qo := l.self != "" && p == l.self, l.self != "" && q == l.self; po != qo {
		return qo
	}
	if len(fs) != len(gs) {
		return len(fs) > len(gs)
	}
	if a, b := fs[0].when(), gs[0].when(); !a.Equal(b) {
		return a.Before(b)
	}
	return p < q
}

// sortFailures orders oldest first (ties by id, so that agents trim the same ones of others).
func sortFailures(fs []*Failure) {
	sort.Slice(fs, func(i, j int) bool {
		if wi, wj := fs[i].when(), fs[j].when(); !wi.Equal(wj) {
			return wi.Before(wj)
		}
		return fs[i].ID < fs[j].ID
	})
}

// Merge keeps the most recently updated copy of a failure that member peer sent, and reports whether it
// kept it. The copy is clipped to the log's bounds, and the oldest failures leave the log when it is full.
//
// Only a failure's protector writes its timeline, and agents act on what timelines say (a target's failure
// takes over the unfinished recoveries its protector's log lists on it, a migration left unfinished is
// resumed at start, a failed member is not admitted back while its recovery is under way, a spare frees
// its claim once the recovery says done). So a copy is merged only from its protector, and only over a
// timeline of the same protector: a member (buggy, restored from an old disk, its clock far ahead, or
// malicious) cannot replace another's timeline, with a newer stamp that wins every merge, nor make one up
// in another's name, and this agent's own are never replaced (peer is never this agent). Copies of other
// members' timelines that a peer relays are left out: each protector sends its own to every member.
func (l *Log) Merge(peer string, f *Failure) bool {
	if f == nil || !validID(f.ID) || peer == "" || peer == l.self || f.Protector != peer {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	cur, ok := l.byID[f.ID]
	if ok && (cur.Protector != peer || !f.Updated.After(cur.Updated)) {
		return false
	}
	c := f.clone()
	c.bound()
	// Stamped here, on this host's clock, when the failure first arrived: the protector's Detected is its
	// wall clock, which may be far behind or ahead of this host's.
	c.Received = time.Now()
	if ok {
		c.Received = cur.Received
	}
	l.byID[f.ID] = c
	l.trim()
	_, kept := l.byID[f.ID]
	l.unsaved = l.unsaved || kept
	return kept
}

// Known reports whether the log holds failure id.
func (l *Log) Known(id string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.byID[id]
	return ok
}

// Unsaved reports whether a copy merged from a peer is not on disk yet: the caller Saves when it chooses
// (a peer may send an update with every small message, and each Save writes the whole log).
func (l *Log) Unsaved() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.unsaved
}

// Update changes a failure under the lock and stamps it.
func (l *Log) Update(id string, fn func(*Failure)) {
	l.mu.Lock()
	defer l.mu.Unlock()
	f, ok := l.byID[id]
	if !ok {
		f = &Failure{ID: id, Received: time.Now()}
		l.byID[id] = f
	}
	fn(f)
	f.bound()
	f.stamp()
	l.trim()
}

// stamp sets f.Updated to now, or just after its previous stamp if this host's clock went back since (NTP
// stepping a clock that ran ahead): a member keeps only a copy stamped after the one it holds (Merge), and
// would ignore every change until the clock caught up, the recovery's end among them.
func (f *Failure) stamp() {
	now := time.Now()
	if !now.After(f.Updated) {
		now = f.Updated.Add(time.Nanosecond)
	}
	f.Updated = now
}

// TakeOver marks the unfinished recoveries that protector coordinates on target as taken over by the
// recovery of failure by (target's own failure), and returns their jobs, each with the node it was
// restored from: a spare that fails while it restores a failed node's jobs takes them down with it, and
// they come back from that node's replicas.
func (l *Log) TakeOver(protector, target, by string) map[string]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	jobs := map[string]string{}
	for _, f := range l.byID {
		if f.Done || f.Kind != "" || f.Protector != protector || f.Target != target || f.ID == by || f.TakenOver != "" {
			continue
		}
		f.TakenOver = by
		f.stamp()
		for _, j := range f.Jobs {
			jobs[j] = f.Node
		}
	}
	return jobs
}

// GiveBack clears the marks TakeOver set for failure by, whose recovery ended before it changed the view
// (its node beat again, no majority, nothing restorable): the node stays a member and is failed over
// again later, and that retry must take the recoveries over anew; kept, the mark made TakeOver skip them,
// and the earlier recoveries counted on a failure that restored nothing. It reports whether it cleared any.
func (l *Log) GiveBack(by string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	cleared := false
	for _, f := range l.byID {
		if f.TakenOver == by && !f.Done {
			f.TakenOver = ""
			f.stamp()
			cleared = true
		}
	}
	return cleared
}

// List returns copies, oldest first.
func (l *Log) List() []*Failure {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]*Failure, 0, len(l.byID))
	for _, f := range l.byID {
		out = append(out, f.clone())
	}
	sortFailures(out)
	return out
}

// Newest returns the most recent failures this agent coordinates whose JSON encoding, as a list, takes at
// most budget bytes, oldest first: what fits in a view message next to the view. Others' timelines stay
// out: a member keeps a copy only from its protector (Merge), and ordered by their protectors' clocks
// among this agent's own, those of a protector whose clock is ahead filled the budget and left out this
// agent's recovery under way, which the other members then did not know of (a rejoin mid-recovery).
func (l *Log) Newest(budget int) []*Failure {
	all := l.List()
	if l.self != "" {
		all = slices.DeleteFunc(all, func(f *Failure) bool { return f.Protector != l.self })
	}
	used := len("[]")
	i := len(all)
	for i > 0 {
		b, err := json.Marshal(all[i-1])
		if err != nil || used+len(b)+1 > budget { // +1: the comma
			break
		}
		used += len(b) + 1
		i--
	}
	return all[i:]
}

// Save writes the log to its file (write, fsync, rename).
func (l *Log) Save() error {
	l.saveMu.Lock()
	defer l.saveMu.Unlock()
	// Cleared before the listing: a copy merged after it is marked again, for the next Save.
	l.mu.Lock()
	l.unsaved = false
	l.mu.Unlock()
	if err := atomicfile.WriteJSON(l.path, l.List()); err != nil {
		l.mu.Lock()
		l.unsaved = true
		l.mu.Unlock()
		return err
	}
	return nil
}
