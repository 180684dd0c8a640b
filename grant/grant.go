// Package grant holds, per job, the highest incarnation a cluster member has granted and to whom, and the
// majority rule that turns members' grants into the right to run a job.
//
// A job must have exactly one live incarnation in the cluster. The job started on its node is incarnation
// 0; a snapshot records the incarnation that took it, and restoring a snapshot of incarnation k creates
// incarnation k+1. Before it restores, a restorer asks every non-failed member of its membership view
// (itself included) to grant (job, k+1) to its restore attempt (the holder). A member grants n only if it
// has granted nothing >= n to another holder, and persists the grant before answering. The restorer runs
// the job only if a majority of the members granted and none refused: two restores of incarnation k
// snapshots race for k+1 and at most one wins (two majorities of one view share a member, which grants
// only one of them); a restore of an older snapshot after k+1 was granted is refused by every member that
// granted k+1. A restorer that does not get to run the job gives its grants back (Release), so that a later
// attempt may have the same incarnation.
package grant

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/ftkit/ftkit/internal/atomicfile"
)

// ErrConflict means the incarnation asked for, or a newer one, is granted to another holder: the job runs
// (or is being restored) elsewhere.
var ErrConflict = errors.New("incarnation already granted")

// Record is what a member granted last for one job.
type Record struct {
	Incarnation uint64    `json:"incarnation"`
	Holder      string    `json:"holder"` // the restore attempt it was granted to
	Host        string    `json:"host"`   // the member that runs that restore, as authenticated
	Granted     time.Time `json:"granted"`
	// Seen is the last request about the job: when the registry is full, the longest unseen job goes.
	Seen time.Time `json:"seen"`
	// Released: the holder gave the incarnation back before running it; another holder may have it.
	Released bool `json:"released,omitempty"`
}

// Limits of the strings a record holds: they come from other members and end up in messages.
const (
	maxJob    = 128
	maxHolder = 256 // "failover:" and a failure id (node name and time)
	maxHost   = 128
)

// Validate checks a record, e.g. one received from another member, before it is used in a message.
func (r Record) Validate() error {
	if r.Incarnation == 0 {
		return errors.New("grant record of incarnation 0: incarnation 0 is the job's start and is never granted")
	}
	if err := checkText("holder", r.Holder, maxHolder); err != nil {
		return err
	}
	return checkText("host", r.Host, maxHost)
}

// checkText accepts 1..limit bytes of printable ASCII.
func checkText(what, s string, limit int) error {
	if s == "" || len(s) > limit {
		return fmt.Errorf("%s must be 1..%d bytes, got %d", what, limit, len(s))
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return fmt.Errorf("%s %q: byte %#x is not printable ASCII", what, s, s[i])
		}
	}
	return nil
}

// Request asks for incarnation Incarnation of Job for Holder, a restore attempt running on Host.
type Request struct {
	Job         string
	Incarnation uint64
	Holder      string
	Host        string
}

func (q Request) validate() error {
	if err := checkText("job", q.Job, maxJob); err != nil {
		return err
	}
	if q.Incarnation == 0 {
		return fmt.Errorf("job %s: incarnation 0 is the job's start and is never granted", q.Job)
	}
	if err := checkText("holder", q.Holder, maxHolder); err != nil {
		return err
	}
	return checkText("host", q.Host, maxHost)
}

// ConflictError is a member's refusal: Record is its grant that stands in the way.
type ConflictError struct {
	Job    string
	Asked  uint64
	Record Record
}

func (e *ConflictError) Error() string {
	return fmt.Sprintf("job %s: incarnation %d refused: %s", e.Job, e.Asked, describe(e.Record))
}

func (e *ConflictError) Unwrap() error { return ErrConflict }

// describe says what a record means, for refusals.
func describe(r Record) string {
	if r.Released {
		return fmt.Sprintf("incarnation %d was granted to %s on %s at %s and given back unused", r.Incarnation, r.Holder, r.Host, clock(r.Granted))
	}
	return fmt.Sprintf("incarnation %d was granted to %s on %s at %s", r.Incarnation, r.Holder, r.Host, clock(r.Granted))
}

func clock(t time.Time) string { return t.UTC().Format("15:04:05 UTC") }

// Options bound a registry.
type Options struct {
	// MaxJobs bounds the jobs remembered; beyond it the longest unseen go (0: DefaultMaxJobs).
	MaxJobs int
	// MaxAge: a job not asked about for this long is forgotten (0: DefaultMaxAge).
	MaxAge time.Duration
}

// Defaults: a record is about 250 bytes, so a full registry is about 1 MB; a job restored and then not
// restored again for 90 days is forgotten (its older snapshots are long pruned by then, and the check
// against the job's node answering still applies).
const (
	DefaultMaxJobs = 4096
	DefaultMaxAge  = 90 * 24 * time.Hour
)

// maxFile bounds the registry file read at Open; a full registry is far below it.
const maxFile = 16 << 20

// fileFormat is the persisted form.
type fileFormat struct {
	Version int               `json:"version"`
	Jobs    map[string]Record `json:"jobs"`
}

const formatVersion = 1

// Registry is one member's grants, persisted at a path (written, fsynced and renamed before a grant is
// answered). It is safe for concurrent use.
type Registry struct {
	path string
	opts Options
	mu   sync.Mutex
	jobs map[string]Record
}

// Open loads the registry at path; a missing file is an empty registry. A file that cannot be read is an
// error, never an empty registry: forgetting grants could let a job run twice.
func Open(path string, opts Options) (*Registry, error) {
	if opts.MaxJobs <= 0 {
		opts.MaxJobs = DefaultMaxJobs
	}
	if opts.MaxAge <= 0 {
		opts.MaxAge = DefaultMaxAge
	}
	r := &Registry{path: path, opts: opts, jobs: map[string]Record{}}
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return r, nil
	}
	if err != nil {
		return nil, fmt.Errorf("open grant registry: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxFile+1))
	if err != nil {
		return nil, fmt.Errorf("read grant registry %s: %w", path, err)
	}
	bad := func(err error) error {
		return fmt.Errorf("grant registry %s is unreadable (%w); it records which incarnation of each job this member let run: restore it from a backup, or remove it only if no restored job runs anywhere", path, err)
	}
	if len(b) > maxFile {
		return nil, bad(fmt.Errorf("larger than %d bytes", maxFile))
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var ff fileFormat
	if err := dec.Decode(&ff); err != nil {
		return nil, bad(err)
	}
	if ff.Version != formatVersion {
		return nil, bad(fmt.Errorf("format version %d, this agent reads %d", ff.Version, formatVersion))
	}
	for job, rec := range ff.Jobs {
		if err := checkText("job", job, maxJob); err != nil {
			return nil, bad(err)
		}
		if err := rec.Validate(); err != nil {
			return nil, bad(fmt.Errorf("job %s: %w", job, err))
		}
		r.jobs[job] = rec
	}
	return r, nil
}

// Grant grants q.Incarnation of q.Job to q.Holder unless this member granted that incarnation to another
// holder that kept it, or granted a newer one; then it returns a *ConflictError. Asking again for the
// same incarnation with the same holder succeeds (a retried request). The grant is on disk before Grant
// returns nil.
func (r *Registry) Grant(q Request, now time.Time) (Record, error) {
	if err := q.validate(); err != nil {
		return Record{}, err
	}
	now = now.UTC().Round(0)
	r.mu.Lock()
	defer r.mu.Unlock()
	cur, ok := r.jobs[q.Job]
	if ok {
		cur.Seen = now
		r.jobs[q.Job] = cur
		switch {
		case q.Incarnation < cur.Incarnation,
			q.Incarnation == cur.Incarnation && (cur.Holder != q.Holder || cur.Host != q.Host) && !cur.Released:
			r.saveSeen()
			return Record{}, &ConflictError{Job: q.Job, Asked: q.Incarnation, Record: cur}
		case q.Incarnation == cur.Incarnation && !cur.Released:
			r.saveSeen()
			return cur, nil // the same request again
		}
	}
	rec := Record{Incarnation: q.Incarnation, Holder: q.Holder, Host: q.Host, Granted: now, Seen: now}
	next := r.with(q.Job, rec, now)
	if err := r.save(next); err != nil {
		return Record{}, err
	}
	r.jobs = next
	return rec, nil
}

// Release gives back incarnation n of job granted to holder on host: the holder will not run it. It is a
// no-op if this member's grant is another one (newer, or another holder's).
func (r *Registry) Release(job string, n uint64, holder, host string, now time.Time) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	cur, ok := r.jobs[job]
	if !ok || cur.Incarnation != n || cur.Holder != holder || cur.Host != host || cur.Released {
		return nil
	}
	cur.Released, cur.Seen = true, now.UTC().Round(0)
	next := r.with(job, cur, now)
	if err := r.save(next); err != nil {
		return err
	}
	r.jobs = next
	return nil
}

// Lookup returns this member's grant for job, if any.
func (r *Registry) Lookup(job string) (Record, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec, ok := r.jobs[job]
	return rec, ok
}

// HeldOn returns, per job, this member's grants not given back to restores on host.
func (r *Registry) HeldOn(host string) map[string]Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]Record{}
	for job, rec := range r.jobs {
		if rec.Host == host && !rec.Released {
			out[job] = rec
		}
	}
	return out
}

// Len is the number of jobs remembered.
func (r *Registry) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.jobs)
}

// with returns a copy of the registry with job set to rec and the bounds applied: jobs unseen for MaxAge
// go, then, until MaxJobs remain (never job itself): released grants first, then those of rec's host, then
// the others, each the longest unseen first. A member that asks for grants of made-up jobs evicts its own
// grants before another host's: before, it evicted the grants of running jobs, and a stale restore of one
// of them could be granted an incarnation that runs.
func (r *Registry) with(job string, rec Record, now time.Time) map[string]Record {
	next := make(map[string]Record, len(r.jobs)+1)
	for j, cur := range r.jobs {
		if now.Sub(cur.Seen) <= r.opts.MaxAge {
			next[j] = cur
		}
	}
	next[job] = rec
	if len(next) <= r.opts.MaxJobs {
		return next
	}
	var others []string
	for j := range next {
		if j != job {
			others = append(others, j)
		}
	}
	rank := func(r Record) int {
		switch {
		case r.Released:
			return 0
		case r.Host == rec.Host:
			return 1
		}
		return 2
	}
	sort.Slice(others, func(a, b int) bool {
		ra, rb := next[others[a]], next[others[b]]
		if ka, kb := rank(ra), rank(rb); ka != kb {
			return ka < kb
		}
		if !ra.Seen.Equal(rb.Seen) {
			return ra.Seen.Before(rb.Seen)
		}
		return others[a] < others[b]
	})
	for _, j := range others[:len(next)-r.opts.MaxJobs] {
		delete(next, j)
	}
	return next
}

// saveSeen persists a refreshed Seen: kept in memory only, a grant that restores keep asking about aged
// out from its older time after a restart, and a stale restore got an older incarnation. Best effort: the
// answer stands either way (a refusal turned into an error would let a majority without this member win),
// and the next change writes Seen again.
func (r *Registry) saveSeen() { _ = r.save(r.jobs) }

func (r *Registry) save(jobs map[string]Record) error {
	b, err := json.MarshalIndent(fileFormat{Version: formatVersion, Jobs: jobs}, "", "  ")
	if err != nil {
		return fmt.Errorf("encode grant registry: %w", err)
	}
	if err := atomicfile.WriteFile(r.path, append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("save grant registry (the grant is refused, nothing changed): %w", err)
	}
	return nil
}
