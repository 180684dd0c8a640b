package agentapi

import (
	"sync"
	"time"
)

// checkpointGate spaces the manual checkpoints each non-root uid asks for by checkpoint.min_interval: the
// floor on job intervals would mean little if any user could ask for a dump in a loop.
//
// It also lets each non-root uid have one checkpoint under way at a time. Spacing the requests alone does
// not space the dumps: every request waits for the host's snapshot lock, so requests sent once per interval
// while a dump takes longer (a large job, or one that does not accept its waiting connections) piled up
// there, and one user's dumps held the lock back to back, delaying other users' scheduled snapshots and the
// operator's migrations for as long as the user kept the requests open.
type checkpointGate struct {
	every   time.Duration
	mu      sync.Mutex
	last    map[uint32]time.Time
	running map[uint32]bool // uids with a checkpoint under way
}

func newCheckpointGate(every time.Duration) *checkpointGate {
	return &checkpointGate{every: every, last: map[uint32]time.Time{}, running: map[uint32]bool{}}
}

// start marks a checkpoint of uid under way until end is called, or reports false if one already is.
func (g *checkpointGate) start(uid uint32) (end func(), ok bool) {
	if uid == 0 {
		return func() {}, true
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.running[uid] {
		return nil, false
	}
	g.running[uid] = true
	return sync.OnceFunc(func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		delete(g.running, uid)
	}), true
}

// allow records a request of uid at now, or says how long it must wait.
func (g *checkpointGate) allow(uid uint32, now time.Time) (time.Duration, bool) {
	if uid == 0 {
		return 0, true
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for u, t := range g.last { // the map holds at most the uids of the last interval
		if now.Sub(t) >= g.every {
			delete(g.last, u)
		}
	}
	if t, ok := g.last[uid]; ok {
		return g.every - now.Sub(t), false
	}
	g.last[uid] = now
	return 0, true
}

// giveBack undoes the request of uid that allow recorded at at: one the agent refused before any dump
// (a job that is not running, or being replayed) must not cost the user its checkpoint for the interval.
func (g *checkpointGate) giveBack(uid uint32, at time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if t, ok := g.last[uid]; ok && t.Equal(at) {
		delete(g.last, uid)
	}
}
