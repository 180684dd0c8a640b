package ship

import "sync"

// DiffHistory remembers, per job, whether diffing its snapshots against a base paid. A diff reads and
// hashes the whole base, then every block of the new files, and the protector rebuilds the files from
// both: for a job that rewrites all its memory between snapshots (a stencil's grids) that is more CPU than
// the transfer itself, on both hosts, for not one byte less on the wire. After a diff that took less than
// a sixteenth of the snapshot from its base (or that the protector refused), the job's next
// skipAfterUselessDiff transfers go whole; then a diff is tried again, so a job whose writes slow down
// gets it back. The zero value is ready to use; it is safe for concurrent use.
type DiffHistory struct {
	mu   sync.Mutex
	skip map[string]int // job -> whole transfers left before the next diff
}

const (
	skipAfterUselessDiff = 4
	// maxDiffHistory bounds the jobs remembered (a job that ended while skipping stays until then): a
	// full history is cleared, which only costs the next diffs.
	maxDiffHistory = 4096
)

// Diff reports whether job's next transfer may diff against a base (SendOptions.NoDelta is its negation),
// and counts a whole one against the job's skips.
func (h *DiffHistory) Diff(job string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	n, ok := h.skip[job]
	if !ok {
		return true
	}
	if n <= 1 {
		delete(h.skip, job)
	} else {
		h.skip[job] = n - 1
	}
	return false
}

// Record notes how a transfer of job went: a diff that took less than a sixteenth of the snapshot from
// its base, or that the protector refused, makes the job's next transfers whole.
func (h *DiffHistory) Record(job string, s *Sent) {
	if s == nil || (s.BaseID == "" && !s.DeltaRefused) {
		return // sent whole: nothing learnt
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if !s.DeltaRefused && s.CopiedBytes >= s.Bytes/16 {
		delete(h.skip, job)
		return
	}
	if h.skip == nil || len(h.skip) >= maxDiffHistory {
		h.skip = map[string]int{}
	}
	h.skip[job] = skipAfterUselessDiff
}
