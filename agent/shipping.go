package agent

import (
	"sync"
	"time"
)

// shippingDumps are the jobs whose dump is being shipped to its protector, not yet recorded as their replica
// (recordReplica), with when the dump began. The scheduler asks it before a snapshot due only for connections
// the job's replica lacks: a dump begun after those connections were listed holds them, and a second one
// would freeze the job for nothing.
type shippingDumps struct {
	mu    sync.Mutex
	began map[string]time.Time // by job id
}

func (s *shippingDumps) begin(job string, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.began == nil {
		s.began = map[string]time.Time{}
	}
	s.began[job] = at
}

// end forgets the dump of job begun at at, shipped or not; a later dump of the job is kept.
func (s *shippingDumps) end(job string, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.began[job].Equal(at) {
		delete(s.began, job)
	}
}

// covers reports whether a dump of j being shipped began after the listing that found j's new connections:
// it holds every one of them still open. If it fails to ship, they stay listed and the scheduler retries.
func (s *shippingDumps) covers(j Job) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	at, ok := s.began[j.ID]
	return ok && len(j.NewConns) > 0 && at.After(j.ConnsChecked)
}
