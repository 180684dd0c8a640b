package ship

import "sync"

// DiffHistory remembers, per job, whether diffing its snapshots against a base paid. A diff hashes every
// block of the new files (and reads and hashes the whole base, unless its index was kept), and the
// protector rebuilds the files from both: for a job that rewrites all its memory between snapshots (a stencil's grids) that is more CPU than
// the transfer itself, on both hosts, for not one byte less on the wire. After a diff that took less than
// a sixteenth of the snapshot from its base (or that the protector refused), the job's next
// skipAfterUselessDiff transfers go whole; then a diff is tried again, so a job whose writes slow down
// gets it back. It also keeps the index of each job's last snapshot sent (Sent.Index), the base its next
// diff is likely to get offered, so that the diff does not read that base again. The zero value is ready
// to use; it is safe for concurrent use.
type DiffHistory struct {
	mu    sync.Mutex
	skip  map[string]int        // job -> whole transfers left before the next diff
	bases map[string]*BaseIndex // job -> index of its last snapshot sent
	size  int64                 // of bases' indexes, bytes
}

const (
	skipAfterUselessDiff = 4
	// maxDiffHistory bounds the jobs remembered (a job that ended while skipping stays until then): a
	// full history is cleared, which only costs the next diffs.
	maxDiffHistory = 4096
	// maxBaseIndexes bounds the memory of the indexes kept (8 bytes per 4 KiB block of a snapshot: 128 GiB
	// of snapshots); past it the indexes kept are dropped, which costs the next diffs a read of their base.
	maxBaseIndexes = 256 << 20
)

// Base is the index of job's last snapshot sent, or nil: SendOptions.Base for its next transfer.
func (h *DiffHistory) Base(job string) *BaseIndex {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.bases[job]
}

// Forget drops what is kept of job (it ended or left this host).
func (h *DiffHistory) Forget(job string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.keepBase(job, nil)
	delete(h.skip, job)
}

// keepBase keeps s.Index as job's base, or forgets job's if there is none; call with h.mu held.
func (h *DiffHistory) keepBase(job string, s *Sent) {
	if old := h.bases[job]; old != nil {
		h.size -= old.Size()
		delete(h.bases, job)
	}
	if s == nil || s.Index == nil {
		return
	}
	n := s.Index.Size()
	if n > maxBaseIndexes {
		return
	}
	if h.bases == nil || h.size+n > maxBaseIndexes || len(h.bases) >= maxDiffHistory {
		h.bases, h.size = map[string]*BaseIndex{}, 0
	}
	h.bases[job] = s.Index
	h.size += n
}

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
// its base, or that the protector refused, makes the job's next transfers whole. The transfer's Index
// replaces the job's base.
func (h *DiffHistory) Record(job string, s *Sent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.keepBase(job, s)
	if s == nil || (s.BaseID == "" && !s.DeltaRefused) {
		return // sent whole: nothing learnt
	}
	if !s.DeltaRefused && s.CopiedBytes >= s.Bytes/16 {
		delete(h.skip, job)
		return
	}
	if h.skip == nil || len(h.skip) >= maxDiffHistory {
		h.skip = map[string]int{}
	}
	h.skip[job] = skipAfterUselessDiff
}
