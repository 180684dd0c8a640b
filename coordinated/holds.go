package coordinated

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/atomicfile"
)

// HoldMax is how long a host keeps a run's jobs frozen for a coordinator that does not come back
// (crashed, cut off) before the host's dump; then it thaws them by itself and the cut is given up. After the
// dump it waits as long as the coordinator waits for the slowest host's (Pause).
const HoldMax = time.Minute

// Holds are the runs whose jobs this host holds frozen for a coordinator, by run (HoldKey); J is the
// agent's record of a job.
type Holds[J any] struct {
	mu sync.Mutex
	m  map[string]*Hold[J]
	// aborted are the cuts given up here before their freeze began a hold (Abort), which Begin refuses.
	aborted map[abortedKey]abortedCut
}

// abortedKey is a cut of a run (HoldKey) given up before its freeze held the run here.
type abortedKey struct{ run, cut string }

type abortedCut struct {
	coordinator string
	until       time.Time
}

// maxAborted bounds the cuts Abort remembers: every alive member may send aborts.
const maxAborted = 1024

// Hold is one run's jobs held frozen for one cut.
type Hold[J any] struct {
	Cut         string
	Coordinator string    // the member whose freeze this is: when it is declared failed, the hold ends
	Frozen      time.Time // when the freeze began
	// FrozenFor is from the freeze to the thaw (End).
	FrozenFor time.Duration
	Jobs      []J
	Dumped    []*ckpt.Manifest
	timer     *time.Timer
	end       func() // thaws the jobs and gives back what the freeze took, once

	mu    sync.Mutex // orders Freeze, Dump and the end
	ended bool
	// dumps counts the Dump calls under way, stopDumps cancels them; an end meanwhile is left to the last
	// of them (endAfterDumps), release being the end the caller gave Begin.
	dumps         int
	stopDumps     map[*int]context.CancelFunc
	endAfterDumps bool
	release       func()
}

// ErrEnded is a Freeze of a hold that has ended.
var ErrEnded = errors.New("the hold of the run's jobs ended (its coordinator failed, or it held them too long): they stay thawed")

// HoldKey names the hold of a request's run: runs are per user.
func HoldKey(req clusterapi.CoordinateRequest) string { return fmt.Sprintf("%d/%s", *req.UID, req.Run) }

// Begin records h as key's hold, which end (called once, by End) releases; without word from its
// coordinator the hold ends by itself after HoldMax, and expired is called. A run already held is refused,
// and end is not called: the jobs are the other hold's.
func (hs *Holds[J]) Begin(key string, h *Hold[J], end func(), expired func()) error {
	h.release = end
	h.end = sync.OnceFunc(func() {
		h.mu.Lock()
		h.ended = true
		if h.dumps > 0 {
			// A dump under way: it is stopped, and the last one to return thaws the jobs and gives back
			// what the freeze took (Dump), never before.
			for _, stop := range h.stopDumps {
				stop()
			}
			h.endAfterDumps = true
			h.mu.Unlock()
			return
		}
		h.mu.Unlock()
		end()
	})
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if old, ok := hs.m[key]; ok {
		return fmt.Errorf("a coordinated snapshot of the run is under way here (%s)", old.Cut)
	}
	if a, ok := hs.aborted[abortedKey{key, h.Cut}]; ok && a.coordinator == h.Coordinator && time.Now().Before(a.until) {
		return fmt.Errorf("cut %s was given up by its coordinator before its freeze here: %w", h.Cut, ErrEnded)
	}
	if hs.m == nil {
		hs.m = map[string]*Hold[J]{}
	}
	hs.m[key] = h
	h.timer = time.AfterFunc(HoldMax, func() {
		if hs.End(key, h.Cut) != nil {
			expired()
		}
	})
	return nil
}

// Get is key's hold for cut, or nil.
func (hs *Holds[J]) Get(key, cut string) *Hold[J] {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if h := hs.m[key]; h != nil && h.Cut == cut {
		return h
	}
	return nil
}

// Freeze runs freeze (which freezes h's jobs again, after they were thawed to accept a connection) and
// makes now h's Frozen, unless h has ended (ErrEnded). The end, which thaws the jobs, runs either before or
// after it, never during: a hold that has ended never leaves its jobs frozen.
func (h *Hold[J]) Freeze(freeze func() error) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.ended {
		return ErrEnded
	}
	h.Frozen = time.Now()
	return freeze()
}

// Dump runs dump, the dump of h's jobs, unless h has ended (ErrEnded), with a context that ends when h
// does. The end (its coordinator declared failed, an abort, HoldMax) does not thaw the jobs or give back
// what the freeze took while dump runs: it cancels it, and the jobs thaw once it has returned (ErrEnded
// then). Before, the end thawed them and gave back the snapshot lock under a dump that went on: it dumped
// jobs no longer frozen for the cut, beside the run's rollback, which takes that lock to stop them.
func (h *Hold[J]) Dump(ctx context.Context, dump func(context.Context) error) error {
	h.mu.Lock()
	if h.ended {
		h.mu.Unlock()
		return ErrEnded
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	key := new(int)
	if h.stopDumps == nil {
		h.stopDumps = map[*int]context.CancelFunc{}
	}
	h.dumps++
	h.stopDumps[key] = cancel
	h.mu.Unlock()

	err := dump(ctx)

	h.mu.Lock()
	h.dumps--
	delete(h.stopDumps, key)
	last := h.dumps == 0 && h.endAfterDumps
	ended := h.ended
	h.mu.Unlock()
	if last {
		h.release()
	}
	if ended {
		return errors.Join(ErrEnded, err)
	}
	return err
}

// Pause stops h's clock while the host works for its cut (a dump takes as long as it needs); the returned
// function starts it again, for as long as the coordinator waits for the other hosts' dumps
// (clusterapi.MaxCoordStep): it thaws every host once the slowest one is done, and a host whose dump ended
// first must not give the cut up meanwhile (a launcher's host beside one dumping eight 8 GiB ranks never
// had its run cut). A coordinator declared failed ends the hold at once (EndOf).
func (h *Hold[J]) Pause() (resume func()) {
	h.timer.Stop()
	return func() { h.timer.Reset(max(HoldMax, clusterapi.MaxCoordStep)) }
}

// End ends key's hold for cut, if there is one: its end runs (the jobs thaw). It returns the hold, nil if
// there was none.
func (hs *Holds[J]) End(key, cut string) *Hold[J] {
	hs.mu.Lock()
	h := hs.m[key]
	if h == nil || h.Cut != cut {
		hs.mu.Unlock()
		return nil
	}
	delete(hs.m, key)
	hs.mu.Unlock()
	h.timer.Stop()
	h.end()
	h.mu.Lock()
	h.FrozenFor = time.Since(h.Frozen)
	h.mu.Unlock()
	return h
}

// Abort ends key's hold for cut, as End does, for coordinator's abort of the cut. Without one, the freeze of
// cut may still be under way here (waiting for the snapshot lock, or for pages): it is refused when it comes
// (Begin), until its own bound (clusterapi.MaxCoordStep). Before, such an abort was lost, and the freeze that
// came after it held the run's jobs frozen, and the snapshot lock, until HoldMax.
func (hs *Holds[J]) Abort(key, cut, coordinator string) *Hold[J] {
	hs.mu.Lock()
	if h := hs.m[key]; h != nil && h.Cut == cut {
		hs.mu.Unlock()
		return hs.End(key, cut)
	}
	defer hs.mu.Unlock()
	now := time.Now()
	for k, a := range hs.aborted {
		if now.After(a.until) {
			delete(hs.aborted, k)
		}
	}
	if hs.aborted == nil {
		hs.aborted = map[abortedKey]abortedCut{}
	}
	if len(hs.aborted) < maxAborted {
		hs.aborted[abortedKey{key, cut}] = abortedCut{coordinator: coordinator, until: now.Add(clusterapi.MaxCoordStep)}
	}
	return nil
}

// EndOf ends the holds whose coordinator failed says failed, and returns them. Such a cut never
// completes, and its hold would keep the run's jobs frozen, and whatever the freeze took, until HoldMax:
// a task farm's rollback after its coordinator's crash waited 55 s for it.
func (hs *Holds[J]) EndOf(failed func(coordinator string) bool) []*Hold[J] {
	hs.mu.Lock()
	ended := map[string]*Hold[J]{}
	for key, h := range hs.m {
		if failed(h.Coordinator) {
			ended[key] = h
		}
	}
	hs.mu.Unlock()
	var out []*Hold[J]
	for key, h := range ended {
		if hs.End(key, h.Cut) != nil {
			out = append(out, h)
		}
	}
	return out
}

// Len is how many runs are held.
func (hs *Holds[J]) Len() int {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	return len(hs.m)
}

// Uncommitted are the snapshots a host dumped for cuts that are not yet committed there, by run
// (HoldKey). Retention keeps them as it keeps a recorded cut's: from the thaw, which gives back the
// snapshot lock, to the commit, a scheduled snapshot of the same job (auto mode, an operator's) may be
// taken, replicated and pruned, and with keep = 1 it deleted the cut's snapshot; the commit then recorded a
// cut naming a snapshot that no longer existed, and the run's previous cut, no longer pinned, went too.
// With a file (Open) the pins outlive the agent: a restart between the thaw and the commit lost them, and
// the restarted agent's first snapshots of the jobs (taken at once) pruned the cut's, here and on the
// protector, before the commit recorded it.
type Uncommitted struct {
	mu      sync.Mutex
	path    string // "": in memory only
	m       map[uncommittedKey]uncommitted
	changed chan struct{} // closed by Done (Settle)
}

// uncommittedRecord is a pin as its file keeps it.
type uncommittedRecord struct {
	Run         string              `json:"run"`
	Cut         string              `json:"cut"`
	Coordinator string              `json:"coordinator"`
	Until       time.Time           `json:"until"`
	Orphaned    bool                `json:"orphaned,omitempty"`
	Snaps       map[string][]string `json:"snaps"`
}

// Open keeps u's pins in path from now on, and pins again those it holds that have not reached their bound
// (a previous agent's). A missing file is no pins.
func (u *Uncommitted) Open(path string) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.path = path
	b, err := atomicfile.ReadBounded(path, clusterapi.MaxMessage*16)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	var recs []uncommittedRecord
	if err == nil {
		err = json.Unmarshal(b, &recs)
	}
	if err != nil {
		return fmt.Errorf("read the pins of uncommitted cuts: %w", err)
	}
	now := time.Now()
	for _, r := range recs {
		if now.After(r.Until) || r.Until.After(now.Add(uncommittedMax)) {
			continue // past its bound, or not a bound this host set (a clock set back): never waited for forever
		}
		if u.m == nil {
			u.m = map[uncommittedKey]uncommitted{}
		}
		u.m[uncommittedKey{r.Run, r.Cut}] = uncommitted{snaps: r.Snaps, until: r.Until, coordinator: r.Coordinator, orphaned: r.Orphaned}
	}
	return nil
}

// save writes u's pins to its file (Open), if it has one; u.mu held.
func (u *Uncommitted) save() error {
	if u.path == "" {
		return nil
	}
	recs := []uncommittedRecord{}
	for k, p := range u.m {
		recs = append(recs, uncommittedRecord{Run: k.run, Cut: k.cut, Coordinator: p.coordinator, Until: p.until, Orphaned: p.orphaned, Snaps: p.snaps})
	}
	if err := atomicfile.WriteJSON(u.path, recs); err != nil {
		return fmt.Errorf("keep the pins of uncommitted cuts: %w", err)
	}
	return nil
}

// uncommittedKey is a cut of a run (HoldKey): two cuts of one run may both be thawed and uncommitted here
// (an operator's beside the scheduled one, the first's thaw giving the snapshot lock to the second's freeze).
type uncommittedKey struct{ run, cut string }

type uncommitted struct {
	snaps map[string][]string // job -> snapshot ids
	until time.Time
	// coordinator is the member whose cut it is: it alone commits or gives it up (Done). The hold, which
	// names it too, ends at the thaw; another member's abort afterwards unpinned the cut's snapshots.
	coordinator string
	// orphaned: a view declared the coordinator failed, and its commit never comes here (Orphan).
	orphaned bool
}

// uncommittedMax bounds how long a cut's snapshots stay pinned without its commit: the coordinator commits
// once every host has replicated its dumps (each within clusterapi.MaxCoordStep), or gave the cut up.
const uncommittedMax = clusterapi.MaxCoordStep + HoldMax

// Add pins dumped, the snapshots of cut of key's run, which coordinator coordinates, until Done or
// uncommittedMax. Those of another cut of the run stay pinned: replacing them let this cut's replication
// prune a cut still to commit (keep = 1), which was then recorded naming a deleted snapshot. A torn cut's
// coordinator gives it up (Done). An error says the pin is not in the file (Open): it holds in memory only.
func (u *Uncommitted) Add(key, cut, coordinator string, dumped []*ckpt.Manifest) error {
	snaps := map[string][]string{}
	for _, m := range dumped {
		snaps[m.Job] = append(snaps[m.Job], m.ID)
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.m == nil {
		u.m = map[uncommittedKey]uncommitted{}
	}
	u.m[uncommittedKey{key, cut}] = uncommitted{snaps: snaps, until: time.Now().Add(uncommittedMax), coordinator: coordinator}
	return u.save()
}

// Coordinator is the member that coordinates cut of key's run, whose snapshots are pinned here, or "" if
// none are.
func (u *Uncommitted) Coordinator(key, cut string) string {
	u.mu.Lock()
	defer u.mu.Unlock()
	p, ok := u.m[uncommittedKey{key, cut}]
	if !ok || time.Now().After(p.until) {
		return ""
	}
	return p.coordinator
}

// Done unpins the snapshots of cut of key's run, as coordinator says: the cut is recorded (the record pins
// them) or given up. Another member's word leaves them pinned: it does not coordinate the cut (its own cut
// given the same id, or one acting for a cut it does not coordinate), and retention would prune them before
// the coordinator's commit names them.
func (u *Uncommitted) Done(key, cut, coordinator string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	k := uncommittedKey{key, cut}
	if p, ok := u.m[k]; !ok || p.coordinator != coordinator {
		return
	}
	delete(u.m, k)
	// Not written, the pin stays in the file: a restarted agent keeps it until its bound, as it would one
	// whose commit never came.
	_ = u.save()
	if u.changed != nil {
		close(u.changed)
		u.changed = nil
	}
}

// Orphan marks the cuts whose coordinator failed says failed, and returns how many it marked. A member
// not alive in this host's view is refused, so such a cut is never committed here, and Settle no longer
// waits for it: the next replication of its jobs waited out uncommittedMax, 11 minutes, for a commit that
// could not come. Its snapshots stay pinned until then: its commit may have reached other members before
// the coordinator failed, and a rollback to it, right after that failure, needs this host's parts.
func (u *Uncommitted) Orphan(failed func(coordinator string) bool) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	n := 0
	for k, p := range u.m {
		if !p.orphaned && failed(p.coordinator) {
			p.orphaned = true
			u.m[k] = p
			n++
		}
	}
	if n > 0 {
		_ = u.save() // not written: a restarted agent waits for the commit until the pin's bound, as before
	}
	if n > 0 && u.changed != nil {
		close(u.changed)
		u.changed = nil
	}
	return n
}

// Settle waits until no snapshot of job but except is pinned by a cut not yet committed here (its commit
// or abort, Done, its coordinator's failure, Orphan, or uncommittedMax), or ctx ends; waiting is called
// once if it has to wait. A snapshot
// shipped to the job's protector meanwhile has the protector prune its older replicas (keep = 1) with
// the cut's among them: its pin is this host's, and the protector pins it only once it records the cut,
// at the commit. The cut was then recorded with its part's only copy on the host whose failure it is to
// outlive.
func (u *Uncommitted) Settle(ctx context.Context, job, except string, waiting func()) error {
	for first := true; ; first = false {
		u.mu.Lock()
		now := time.Now()
		var until time.Time
		for key, p := range u.m {
			if now.After(p.until) {
				delete(u.m, key)
				continue
			}
			other := slices.ContainsFunc(p.snaps[job], func(id string) bool { return id != except })
			if other && !p.orphaned && (until.IsZero() || p.until.Before(until)) {
				until = p.until
			}
		}
		if until.IsZero() {
			u.mu.Unlock()
			return nil
		}
		if u.changed == nil {
			u.changed = make(chan struct{})
		}
		changed := u.changed
		u.mu.Unlock()
		if first && waiting != nil {
			waiting()
		}
		t := time.NewTimer(time.Until(until))
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("wait for the commit of the cut that holds an earlier snapshot of job %s: %w", job, ctx.Err())
		case <-changed:
		case <-t.C:
		}
		t.Stop()
	}
}

// Pinned are job's snapshots of cuts not yet committed.
func (u *Uncommitted) Pinned(job string) []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	var out []string
	now := time.Now()
	for key, p := range u.m {
		if now.After(p.until) {
			delete(u.m, key)
			continue
		}
		out = append(out, p.snaps[job]...)
	}
	return out
}
