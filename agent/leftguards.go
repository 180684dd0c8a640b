package agent

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/restore"
)

// A recovery guards the restored connections (restore.Guard) before CRIU restores them, and CRIU deletes
// the guard when it unlocks the network; a failed restore's agent deletes it. An agent killed in between
// left it up for good: every packet of those connections and every connection request to the job's
// addresses, a later restore's of the same addresses included, dropped on this host. The restore's work
// directory (workCopy) outlives that agent and holds the dump's run id, which names the guard: the next
// agent removes the guard when it starts, unless a shim of the job runs, whose CRIU may still restore under
// it.

// leftRestore is a restore's work directory a previous agent left, with the run id that names its guard.
type leftRestore struct {
	Job, RunID, Work string
}

// staleGuards are the guards of left that no restore needs any more. restoring reports whether a restore
// of a job may still run here (a shim of the job runs, or its cgroup has processes): its CRIU needs the
// guard until it unlocks the network, and deletes it then. A run id that such a restore holds is kept,
// whichever directory names it too.
func staleGuards(left []leftRestore, restoring func(job string) bool) []leftRestore {
	needed := map[string]bool{}
	for _, l := range left {
		if restoring(l.Job) {
			needed[l.RunID] = true
		}
	}
	var stale []leftRestore
	for _, l := range left {
		if !needed[l.RunID] {
			stale = append(stale, l)
		}
	}
	return stale
}

// leftRestores lists the restores' work directories in dir with the run ids of their dumps. One whose name
// does not tell its job, or whose dump has no usable run id, is left out: whether its restore still runs,
// or which guard it made, is unknown.
func leftRestores(dir string) ([]leftRestore, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var left []leftRestore
	for _, e := range ents {
		job, _, ok := parseWorkName(e.Name())
		if !e.IsDir() || !ok {
			continue
		}
		work := filepath.Join(dir, e.Name())
		if runID, err := restore.RunID(work); err == nil {
			left = append(left, leftRestore{Job: job, RunID: runID, Work: work})
		}
	}
	return left, nil
}

// removeLeftGuards removes the guards the restores a previous agent left still hold, in this host's
// network namespace and in their jobs' networks, but those a running restore may need (staleGuards). Call
// it at start, before any restore: a new restore of the same snapshot makes a guard of the same name.
func (a *Agent) removeLeftGuards(ctx context.Context) {
	dir := filepath.Join(a.cfg.StateDir, "restore")
	left, err := leftRestores(dir)
	if err != nil {
		a.log.Error("cannot list the restores' work directories: a restore guard an interrupted restore left is not removed", "dir", dir, "err", err)
		return
	}
	restoring := func(job string) bool { return populated(a.layout().cgroup(job)) || heldOpen(a.shimLog(job)) }
	for _, l := range staleGuards(left, restoring) {
		a.removeLeftGuard(ctx, "", l)
		// A job with an address of its own was guarded inside its network (parseWorkName checked its id).
		name := jobNetName(a.cfg.Name, l.Job)
		if ok, err := jobnet.Exists(name); err == nil && ok {
			a.removeLeftGuard(ctx, name, l)
		}
	}
}

// removeLeftGuard removes l's guard in job network netns ("" for this host's namespace) if it is there.
func (a *Agent) removeLeftGuard(ctx context.Context, netns string, l leftRestore) {
	var n *JobNet
	if netns != "" {
		n = &JobNet{Name: netns}
	}
	var removed bool
	err := inJobNet(n, func() error {
		// Looked up first: deleting a missing table still waits for the kernel's grace period.
		ok, err := restore.GuardExists(ctx, l.RunID)
		if err != nil || !ok {
			return err
		}
		removed = true
		return restore.Unguard(ctx, l.RunID)
	})
	if err != nil {
		a.log.Error("could not remove the restore guard an interrupted restore left: the restored connections' packets and connection requests to the job's addresses stay dropped here; delete the table by hand (nft delete table inet TABLE, in the job network if netns is set)",
			"job", l.Job, "netns", netns, "table", restore.GuardTable(l.RunID), "work", l.Work, "err", err)
		return
	}
	if removed {
		a.log.Warn("removed the restore guard a previous agent left: it was killed before CRIU restored the job, and nothing restores it here now",
			"job", l.Job, "netns", netns, "table", restore.GuardTable(l.RunID), "work", l.Work)
	}
}
