package coordinated

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
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
}

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

	mu    sync.Mutex // orders Freeze and the end
	ended bool
}

// ErrEnded is a Freeze of a hold that has ended.
var ErrEnded = errors.New("the hold of the run's jobs ended (its coordinator failed, or it held them too long): they stay thawed")

// HoldKey names the hold of a request's run: runs are per user.
func HoldKey(req clusterapi.CoordinateRequest) string { return fmt.Sprintf("%d/%s", *req.UID, req.Run) }

// Begin records h as key's hold, which end (called once, by End) releases; without word from its
// coordinator the hold ends by itself after HoldMax, and expired is called. A run already held is refused,
// and end is not called: the jobs are the other hold's.
func (hs *Holds[J]) Begin(key string, h *Hold[J], end func(), expired func()) error {
	h.end = sync.OnceFunc(func() {
		h.mu.Lock()
		h.ended = true
		h.mu.Unlock()
		end()
	})
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if old, ok := hs.m[key]; ok {
		return fmt.Errorf("a coordinated snapshot of the run is under way here (%s)", old.Cut)
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
