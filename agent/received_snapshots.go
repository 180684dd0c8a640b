package agent

import (
	"sync"
	"time"
)

// freshFor is how long a snapshot this agent received counts as verified: the receive checked every
// file's sha256 as it arrived, before the commit. A restore that follows the transfer at once (a migration,
// a fail-over whose snapshot was prefetched during the fence wait) then reads the manifest instead of
// hashing every file a second time: 0.07 s for 100 MiB and 0.6 s for 1 GiB here, all of it while the job
// is stopped. A snapshot older than that, or any after an agent restart, is verified again before a
// restore.
const freshFor = 30 * time.Second

// freshReceipts remembers when each snapshot was received and verified, by job and id.
type freshReceipts struct {
	mu sync.Mutex
	at map[[2]string]time.Time
}

// note records that snapshot id of job was received and verified now.
func (f *freshReceipts) note(job, id string, now time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.at == nil {
		f.at = map[[2]string]time.Time{}
	}
	for k, t := range f.at {
		if now.Sub(t) > freshFor {
			delete(f.at, k)
		}
	}
	f.at[[2]string{job, id}] = now
}

// fresh reports whether snapshot id of job was received and verified less than freshFor ago.
func (f *freshReceipts) fresh(job, id string, now time.Time) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, ok := f.at[[2]string{job, id}]
	return ok && now.Sub(t) <= freshFor && !now.Before(t)
}
