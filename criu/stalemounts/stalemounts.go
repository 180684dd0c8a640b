// Package stalemounts finds the mounts of a job's mount namespace that are copies of host mounts the host
// has since unmounted, so that a dump leaves them out (CRIU's skip-mnt) instead of dumping or failing on
// them.
//
// Why: a job runs in a copy of its host's mount namespace whose mounts are slaves of the host's
// (shim/jobinit.go). The host's unmounts reach the copy only for the mounts the host shares, so on a host
// whose mounts are private (a container, this project's CI machine) a mount unmounted after the job
// started stays in the job's copy. CRIU records a mount of the job as external
// only if it finds its file system among its own (the host's) mounts; it dumps any other by content: the
// whole of a stale tmpfs, for as long as the job runs, and a refusal for a file system it cannot dump by
// content (an NFS home, a ramfs) or whose mount point went while it dumped (seen in CI: "mnt: Can't open
// ./var/lib/ftkit/labs/.../snapshots"). A mount the job made itself (a root job may) has no host
// counterpart either and must be dumped, so a mount counts as a copy of a host mount only if the host had
// its file system mounted at an earlier look (Tracker.Gone, at every snapshot).
package stalemounts

import (
	"fmt"
	"os"
	"slices"
	"sync"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

type dev struct{ major, minor int }

// copies are the mounts of one job's namespace seen as copies of host mounts: mount ID to device. A
// mount ID may be reused after an unmount, so an entry holds only while ID and device both match.
type copies map[int]dev

// Tracker remembers, per job, which mounts of its namespace were copies of host mounts.
type Tracker struct {
	mu   sync.Mutex
	jobs map[string]jobCopies
}

type jobCopies struct {
	pid    int // the job's root: a restored job has a new namespace, whose mount IDs are unrelated
	copies copies
}

// Gone returns the mount points, in the namespace of job's root process pid, of the copies of host mounts
// the host no longer has, with every mount below them, for CRIU's skip-mnt. It first records the mounts
// whose file system the host has mounted now, for the next call.
func (t *Tracker) Gone(job string, pid int) ([]string, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return nil, fmt.Errorf("read the mounts of job %s: %w", job, err)
	}
	jobMounts, err := mountinfo.GetMountsFromReader(f, nil)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("read the mounts of job %s (pid %d): %w", job, pid, err)
	}
	// The host's namespace is the agent's: CRIU, its child, matches external mounts against it.
	hostMounts, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, fmt.Errorf("read the host's mounts: %w", err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.jobs == nil {
		t.jobs = map[string]jobCopies{}
	}
	for id, jc := range t.jobs { // forget the jobs that ended
		if id != job && unix.Kill(jc.pid, 0) == unix.ESRCH {
			delete(t.jobs, id)
		}
	}
	jc := t.jobs[job]
	if jc.pid != pid {
		jc = jobCopies{pid: pid}
	}
	skip, next := gone(jobMounts, hostMounts, jc.copies)
	t.jobs[job] = jobCopies{pid: pid, copies: next}
	return skip, nil
}

// gone is Gone's pure part: seen are the copies found at the previous look; it returns the mount points
// to skip and the copies to remember.
func gone(job, host []*mountinfo.Info, seen copies) ([]string, copies) {
	onHost := map[dev]bool{}
	for _, m := range host {
		onHost[dev{m.Major, m.Minor}] = true
	}
	next := copies{}
	stale := map[int]bool{}
	for _, m := range job {
		d := dev{m.Major, m.Minor}
		if onHost[d] {
			next[m.ID] = d
		} else if was, ok := seen[m.ID]; ok && was == d {
			next[m.ID] = d
			stale[m.ID] = true
		}
	}
	// Every mount below a stale one goes with it: CRIU needs a mount's parent.
	byID := map[int]*mountinfo.Info{}
	for _, m := range job {
		byID[m.ID] = m
	}
	below := func(m *mountinfo.Info) bool {
		for hops := 0; hops < len(job); hops++ { // a parent cycle ends the walk
			p, ok := byID[m.Parent]
			if !ok || p == m {
				return false
			}
			if stale[p.ID] {
				return true
			}
			m = p
		}
		return false
	}
	var skip, kept []string
	for _, m := range job {
		if stale[m.ID] || below(m) {
			skip = append(skip, m.Mountpoint)
		} else {
			kept = append(kept, m.Mountpoint)
		}
	}
	// CRIU skips by path: a path a mount that stays shares is not skipped, and CRIU refuses the dump as
	// before rather than drop a mount the job still has from the host.
	skip = slices.DeleteFunc(skip, func(p string) bool { return slices.Contains(kept, p) })
	slices.Sort(skip)
	return slices.Compact(skip), next
}
