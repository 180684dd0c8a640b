package agent

import (
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"github.com/ftkit/ftkit/internal/atomicfile"
)

// A Failure is the timeline of one node failure and its recovery, kept by the protector that handled it
// and copied to every agent with the membership view (so `ftctl events` works on any host).
type Failure struct {
	ID        string    `json:"id"`
	Node      string    `json:"node"`      // the failed node
	Protector string    `json:"protector"` // who detected it and coordinated the recovery
	Target    string    `json:"target"`    // where its jobs were restored (a spare, or the protector in basic mode)
	Basic     bool      `json:"basic,omitempty"`
	LastBeat  time.Time `json:"last_beat"` // the failed node's last heartbeat
	Detected  time.Time `json:"detected"`
	Stages    []Stage   `json:"stages"`
	Jobs      []string  `json:"jobs"`
	Done      bool      `json:"done"`
	Error     string    `json:"error,omitempty"` // set if recovery failed or is incomplete
	Updated   time.Time `json:"updated"`
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

// Stage names, in the order a recovery goes through them.
const (
	StageDetected  = "detected"
	StageClaimed   = "spare claimed"
	StageFetched   = "snapshot fetched"
	StageRewritten = "images rewritten"
	StageRestored  = "restored"
	StageReplayed  = "replay done"
	StageProtected = "re-protected"
)

// failureLog holds the failures this agent knows of, on disk so that a restarted agent still shows them.
type failureLog struct {
	mu   sync.Mutex
	path string
	byID map[string]*Failure
}

func openFailureLog(dir string) (*failureLog, error) {
	l := &failureLog{path: filepath.Join(dir, "failures.json"), byID: map[string]*Failure{}}
	b, err := os.ReadFile(l.path)
	if errors.Is(err, fs.ErrNotExist) {
		return l, nil
	}
	if err != nil {
		return nil, err
	}
	var fs []*Failure
	if err := json.Unmarshal(b, &fs); err != nil {
		return nil, err
	}
	for _, f := range fs {
		l.byID[f.ID] = f
	}
	return l, nil
}

// merge keeps the most recently updated copy of a failure.
func (l *failureLog) merge(f *Failure) {
	if f == nil || f.ID == "" {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if cur, ok := l.byID[f.ID]; !ok || f.Updated.After(cur.Updated) {
		c := *f
		c.Stages = append([]Stage(nil), f.Stages...)
		l.byID[f.ID] = &c
	}
}

// update changes a failure under the lock and stamps it.
func (l *failureLog) update(id string, fn func(*Failure)) {
	l.mu.Lock()
	defer l.mu.Unlock()
	f, ok := l.byID[id]
	if !ok {
		f = &Failure{ID: id}
		l.byID[id] = f
	}
	fn(f)
	f.Updated = time.Now()
}

// keepNewest forgets all but the n most recently updated failures: other agents' timelines arrive with
// every view exchange, and what an agent keeps must stay bounded.
func (l *failureLog) keepNewest(n int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.byID) <= n {
		return
	}
	all := make([]*Failure, 0, len(l.byID))
	for _, f := range l.byID {
		all = append(all, f)
	}
	sort.Slice(all, func(i, j int) bool { return all[i].Updated.After(all[j].Updated) })
	for _, f := range all[n:] {
		delete(l.byID, f.ID)
	}
}

// list returns copies, oldest first.
func (l *failureLog) list() []*Failure {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]*Failure, 0, len(l.byID))
	for _, f := range l.byID {
		c := *f
		c.Stages = append([]Stage(nil), f.Stages...)
		out = append(out, &c)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Detected.Before(out[j].Detected) })
	return out
}

func (l *failureLog) save() error {
	return atomicfile.WriteJSON(l.path, l.list())
}

func (a *Agent) saveFailures() {
	if err := a.failures.save(); err != nil {
		a.log.Warn("save failure timelines", "err", err)
	}
}

// Failures returns the failure timelines this agent knows of, oldest first.
func (a *Agent) Failures() []*Failure { return a.failures.list() }
