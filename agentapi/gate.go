package agentapi

import (
	"sync"
	"time"
)

// checkpointGate spaces the manual checkpoints each non-root uid asks for by checkpoint.min_interval: the
// floor on job intervals would mean little if any user could ask for a dump in a loop.
type checkpointGate struct {
	every time.Duration
	mu    sync.Mutex
	last  map[uint32]time.Time
}

func newCheckpointGate(every time.Duration) *checkpointGate {
	return &checkpointGate{every: every, last: map[uint32]time.Time{}}
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
