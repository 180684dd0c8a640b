package detect

import (
	"sync"
	"time"
)

// Stalls watches this host's own scheduling (Lifeguard's "local health"): a ticker calls Tick every
// period, and a tick more than limit late means the process was not running. A failed confirmation
// taken while this host stalled is not evidence against the suspect: the probes' answers may have been
// waiting, unread, behind the same stall. It is safe for concurrent use.
type Stalls struct {
	period, limit time.Duration
	mu            sync.Mutex
	prev          time.Time // the last tick
	last          time.Time // the tick that ended the most recent stall
	n             uint64
}

// NewStalls returns a monitor of ticks expected every period, late beyond limit.
func NewStalls(period, limit time.Duration) *Stalls {
	return &Stalls{period: period, limit: limit}
}

// Tick records a tick at now.
func (s *Stalls) Tick(now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.prev.IsZero() && now.Sub(s.prev) > s.period+s.limit {
		s.last = now
		s.n++
	}
	s.prev = now
}

// Since reports whether this host stalled at some point after t, up to now: a late tick after t, or a
// tick overdue at now (a stall still going on). Before the first tick nothing is known, and it says no.
func (s *Stalls) Since(t, now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.prev.IsZero() {
		return false
	}
	return s.last.After(t) || now.Sub(s.prev) > s.period+s.limit
}

// Count is how many stalls were seen.
func (s *Stalls) Count() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}
