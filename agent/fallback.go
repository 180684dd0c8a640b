package agent

import "github.com/ftkit/ftkit/ckpt"

// A replica can fail verification on its holder (a flipped bit on disk), and fail-over then restores the
// one before it. That older snapshot is restorable only while its peers still log what they sent since it.
// So the sender-side log is released one replicated snapshot behind the newest, except when a sender asked
// for the snapshot because its log is under pressure: then its memory comes first and the newest snapshot
// is the floor.

// previousSnapshot is the newest snapshot of job taken on node, older than id, whose manifest reads and
// that another member holds (replicated): nil if there is none.
func previousSnapshot(store *ckpt.Store, job, node, id string) *ckpt.Manifest {
	ids, err := store.List(job, node)
	if err != nil {
		return nil
	}
	for _, older := range ids { // newest first
		if older >= id { // ids start with the UTC time of the dump
			continue
		}
		if m, err := store.Manifest(job, older); err == nil && m.Replicated() {
			return m
		}
	}
	return nil
}

// releaseBase is the snapshot whose receive points a newly replicated snapshot m lets the senders trim
// to: m itself under log pressure (urgent), else the replicated snapshot before it; nil releases nothing
// (m is the job's first here: its senders keep everything until the next one).
func (a *Agent) releaseBase(m *ckpt.Manifest, urgent bool) *ckpt.Manifest {
	if urgent {
		return m
	}
	return previousSnapshot(a.store, m.Job, a.cfg.Name, m.ID)
}

// restoreFloor is the oldest snapshot of job a restore may start from: the replicated snapshot before
// the newest (see above), or the newest if it is the only one; nil if none is replicated.
func (a *Agent) restoreFloor(job string) *ckpt.Manifest {
	newest := a.newestReplicated(job)
	if newest == nil {
		return nil
	}
	if prev := previousSnapshot(a.store, job, newest.Node, newest.ID); prev != nil {
		return prev
	}
	return newest
}
