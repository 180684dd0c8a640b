package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/jobfs"
	"github.com/ftkit/ftkit/shim"
)

// maxJobRecord bounds the job record a snapshot carries: a few hundred bytes plus the job's argv and env.
const maxJobRecord = 4 << 20

// snapshotRecord reads the job record a snapshot carries, as it is (snapshotJob validates it).
func (a *Agent) snapshotRecord(m *ckpt.Manifest) (Job, error) {
	return a.recordAt(m.Job, m.ID)
}

// recordAt is snapshotRecord for snapshot id of job, whose manifest need not have been read.
func (a *Agent) recordAt(job, id string) (Job, error) {
	var j Job
	b, err := atomicfile.ReadBounded(filepath.Join(a.store.Path(job, id), snapJob), maxJobRecord)
	if err == nil {
		err = json.Unmarshal(b, &j)
	}
	if err != nil {
		return Job{}, fmt.Errorf("snapshot %s has no usable job record: %w", id, err)
	}
	return j, nil
}

// snapshotJob reads the job record a snapshot carries and validates it, with the manifest's paths, against
// this agent's layout: both come from whichever node took the snapshot.
func (a *Agent) snapshotJob(m *ckpt.Manifest) (Job, error) {
	j, err := a.snapshotRecord(m)
	if err != nil {
		return Job{}, err
	}
	if err := checkPeerJob(a.layout(), m, &j); err != nil {
		return Job{}, fmt.Errorf("%w; refusing to restore it", err)
	}
	if j.Net != nil {
		_, own, err := a.cfg.ClusterNetwork()
		if err == nil {
			err = checkPeerJobNet(j.Net, own, a.memberAddrs())
		}
		if err != nil {
			return Job{}, fmt.Errorf("snapshot %s: %w; refusing to restore it", m.ID, err)
		}
	}
	return j, nil
}

// workCopy lays out the snapshot's images in a working directory that restoreJob removes.
func (a *Agent) workCopy(m *ckpt.Manifest) (string, error) {
	// One directory per attempt: a manual restore and a fail-over of the same snapshot may prepare on one
	// host at once, and the loser of the incarnation claim removes its own copy, never the winner's.
	var rnd [4]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return "", err
	}
	work := filepath.Join(a.cfg.StateDir, "restore", m.Job+"-"+m.ID+"-"+hex.EncodeToString(rnd[:]))
	if err := linkTree(filepath.Join(a.store.Path(m.Job, m.ID), snapImages), work); err != nil {
		// Nobody else removes a copy never handed out: its links, or its partial copies (a full disk), stay.
		if rerr := criu.RemoveWorkDir(work); rerr != nil {
			a.log.Warn("restore's partial work directory not removed", "dir", work, "err", rerr)
		}
		return "", fmt.Errorf("prepare images for restore: %w", err)
	}
	return work, nil
}

// outputJournalDir is the directory of a restore's work directory where restoreOutputs keeps what it
// changes, until the restore succeeds.
const outputJournalDir = "output-journal"

// restoreJob puts the job's output files back to their snapshot sizes and restores the images in work
// under a new shim on this host; work is removed afterwards. A restore that fails leaves the output files
// as it found them. beforeRun, if not nil, runs once the job's cgroup is recorded here and before CRIU
// restores its processes (a replay of receive positions arms its first stops there).
func (a *Agent) restoreJob(ctx context.Context, m *ckpt.Manifest, j Job, work string, beforeRun func() error) (*Job, error) {
	keepWork := false
	defer func() {
		if !keepWork {
			if err := criu.RemoveWorkDir(work); err != nil {
				a.log.Warn("restore's work directory not removed", "dir", work, "err", err)
			}
		}
	}()
	if err := a.refuseWhileFenced(); err != nil {
		return nil, err
	}
	// Whatever asked (a recovery request repeated or resumed, a migration resumed, a manual restore): a
	// copy of the job running here already must not get a second one beside it.
	a.mu.Lock()
	cur := a.byID[j.ID]
	runs := cur != nil && cur.State == JobRunning
	runsPID := 0
	if runs {
		runsPID = cur.PID
	}
	a.mu.Unlock()
	if runs {
		return nil, fmt.Errorf("job %s already runs on %s (pid %d): snapshot %s is not restored beside it", j.ID, a.cfg.Name, runsPID, m.ID)
	}
	// Before anything of the job's is touched (its outputs cut back): a refused snapshot changes nothing.
	if err := checkImageCreds(work, j.UID, j.GID); err != nil {
		return nil, fmt.Errorf("restore from snapshot %s: %w", m.ID, err)
	}
	if err := a.reserveRestoredAddr(j); err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", m.ID, err)
	}
	// The address stays reserved until the restored job is listed (addressHeld), or its network is
	// deleted; a network that could not be deleted holds it by its name (deleteJobNet) until it is.
	addrReserved := j.Net != nil
	defer func() {
		if addrReserved {
			a.releaseJobAddr(j.Net.Addr.Addr())
		}
	}()
	journal, err := a.restoreOutputs(m, j, filepath.Join(work, outputJournalDir))
	var pid int
	start := time.Now()
	if err == nil {
		// CRIU restores the job into this host's cgroup for it (shim.Spec.Cgroup), wherever the old host had
		// it; made here first, so that the capture and the receive tap attach to it before the job runs, as
		// for a new job.
		if !validJobID(j.ID) {
			err = fmt.Errorf("job id %q in snapshot %s is not one an agent makes", j.ID, m.ID)
		} else {
			j.Cgroup = a.layout().cgroup(j.ID)
			if mkErr := os.Mkdir(j.Cgroup, 0o755); mkErr != nil && !errors.Is(mkErr, fs.ErrExist) {
				err = fmt.Errorf("create job cgroup: %w", mkErr)
			} else if mkErr != nil {
				// A cgroup left frozen (an agent killed during a snapshot's freeze of the job's earlier copy on
				// this host) would hold the restored processes frozen, and CRIU with them, for good.
				if tErr := setFrozen(j.Cgroup, false); tErr != nil {
					err = fmt.Errorf("thaw the existing job cgroup before restoring into it: %w", tErr)
				}
			}
		}
	}
	if err == nil && j.Net != nil {
		// The record's name is the old host's namespace; here the job gets this host's, with the same
		// address (a recovery has created it already, under its guard; Create is idempotent).
		n := *j.Net
		n.Name = jobNetName(a.cfg.Name, j.ID)
		n.Kind = a.cfg.JobNetwork.Kind // this host's, as its parent: the record's is the old host's
		j.Net = &n
		err = a.createJobNet(ctx, j.Net)
	}
	protected := err == nil
	if protected {
		a.protect(&j)
		a.det.Watch(j.ID, j.Cgroup, true, m.ID)
		if beforeRun != nil {
			if err = beforeRun(); err != nil {
				err = fmt.Errorf("prepare the replay of the job's receive positions: %w", err)
			}
		}
	}
	launch := func() error {
		gone, err := image.PruneGoneMounts(work, "/")
		if err != nil {
			return fmt.Errorf("drop the mounts gone from this host from the job's mount namespace: %w", err)
		}
		if len(gone) > 0 {
			a.log.Info("mounts of the job's old host are not on this one; restored without them", "job", j.ID, "snapshot", m.ID, "mounts", gone)
		}
		// The shim, and the CRIU it runs, inside the job's network: CRIU restores the sockets into the
		// namespace it runs in.
		return inJobNet(j.Net, func() (err error) {
			superseded, refusal := a.copyMarks(j.ID, j.Incarnation)
			pid, err = shim.Launch(ctx, a.self, shim.Spec{
				JobID: j.ID, Mode: shim.ModeRestore, ImagesDir: work, CRIU: a.criu.Binary, ExitFile: j.ExitPath(), Node: a.cfg.Name,
				// The job's user (checkPeerJob refused an id chown reads as "unchanged"): the shim checks the
				// paths the images name against it and has CRIU bind and open them as that user. Without it
				// the shim reads uid 0, and CRIU opens them all as root, unchecked.
				UID: j.UID, GID: j.GID,
				Cgroup:    j.Cgroup,
				LazyPages: a.cfg.Failover.LazyRestore, Superseded: superseded, Refusal: refusal, Incarnation: &j.Incarnation,
			}, a.shimLog(j.ID))
			return err
		})
	}
	keepExit, dropExit := func() {}, func() {}
	if err == nil {
		keepExit, dropExit, err = a.setAsideExit(j)
	}
	if err == nil {
		err = againIfMountGone(launch, func(err error) {
			a.log.Warn("a mount went from this host while CRIU restored the job: restoring it again without that mount", "job", j.ID, "snapshot", m.ID, "err", err)
		})
	}
	if err != nil {
		keepExit()
		if protected {
			// A restore cut short (its shim killed at the restore's deadline, and its CRIU with it) leaves the
			// part of the job's tree CRIU had made in the job's cgroup, stopped where CRIU left it: killed
			// here, so that nothing of the job stays on this host to hold its network and its files.
			if kerr := a.killCgroup(j.ID); kerr != nil {
				a.log.Warn("could not kill what the failed restore left of the job", "job", j.ID, "err", kerr)
			} else if werr := waitEmpty(context.WithoutCancel(ctx), j.Cgroup); werr != nil {
				a.log.Warn("what the failed restore left of the job was killed but has not all gone yet", "job", j.ID, "err", werr)
			}
			a.releaseResources(&j) // nothing of the job runs here: its cgroup, its log and receive-order watches go
		}
		if j.Net != nil && j.Net.Name == jobNetName(a.cfg.Name, j.ID) {
			// Its address must not stay on the wire without the job; while it may, nobody else gets it (a
			// network that could not be deleted holds it by its name: deleteJobNet).
			a.deleteJobNet(ctx, j.ID, j.Net)
		}
		// Nothing runs: the next attempt, or an older snapshot, finds the files as they were.
		keepWork, err = a.undoOutputs(journal, m, err)
		return nil, err
	}
	dropExit()
	journal.Close()
	j.Node, j.PID, j.State, j.Exit, j.Restored, j.LazyWork = a.cfg.Name, pid, JobRunning, nil, m.ID, ""
	j.RestoredAt = start.UTC() // this host's clock, unlike j.Created once the job came from another host
	if m.Node != a.cfg.Name {
		j.Forget = nil // the former holders of another host's replicas (recordReplica) are that host's to tell
	}
	if a.cfg.Failover.LazyRestore {
		j.LazyWork, keepWork = work, true // the shim removes it once every page is in
	}
	// Under a.mu: forgetJob removes an ended copy's record under it, never this one.
	a.mu.Lock()
	if cur := a.byID[j.ID]; cur != nil && cur.State != JobRunning && !cur.Forgotten {
		// The ended copy this record replaces is never forgotten (forgetJob leaves a replaced record alone):
		// the holders of this host's snapshots it had yet to tell are this copy's to tell.
		for _, h := range cur.holdersHere(a.cfg.Name) {
			if !slices.Contains(j.Forget, h) {
				j.Forget = append(j.Forget, h)
			}
		}
	}
	if err := a.jobs.save(&j); err != nil {
		a.mu.Unlock()
		addrReserved = false // the job runs, unlisted: its address must not be handed out
		return nil, err
	}
	a.byID[j.ID] = &j
	a.notify()
	a.mu.Unlock()
	a.log.Info("job restored", "job", j.ID, "snapshot", m.ID, "from_node", m.Node, "pid", pid, "restore_ms", time.Since(start).Milliseconds(),
		"lazy_pages", a.cfg.Failover.LazyRestore)
	return &j, nil
}

// exitAside is the name an earlier copy's exit record has while its job is restored (setAsideExit).
const exitAside = ".exit-earlier-copy"

// setAsideExit moves the exit record an earlier copy of job j left in its directory out of the way of the
// copy about to be restored: the agents, ftwrap and mpirun take a record there for the job's end (the agent
// finished a job restored on the host its earlier copy had ended on within 200 ms, with that copy's
// status). keep puts the record back (the restore failed: nothing runs), drop removes it (the job runs).
func (a *Agent) setAsideExit(j Job) (keep, drop func(), err error) {
	nothing := func() {}
	dir, err := jobfs.OpenDir(j.Dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nothing, nothing, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("open the job directory to set its earlier copy's exit record aside: %w", err)
	}
	if err := dir.Rename(exitName, exitAside); err != nil {
		dir.Close()
		if errors.Is(err, fs.ErrNotExist) {
			return nothing, nothing, nil
		}
		return nil, nil, fmt.Errorf("set aside the exit record of the job's earlier copy: %w", err)
	}
	keep = func() {
		if err := dir.Rename(exitAside, exitName); err != nil {
			a.log.Warn("could not put back the exit record of the job's earlier copy", "job", j.ID, "err", err)
		}
		dir.Close()
	}
	drop = func() {
		if err := dir.Remove(exitAside); err != nil {
			a.log.Warn("could not remove the exit record of the job's earlier copy", "job", j.ID, "err", err)
		}
		dir.Close()
	}
	return keep, drop, nil
}

// againIfMountGone runs launch, and once more if CRIU failed it on a mount point that went from this host
// after launch pruned the gone mounts from the images, before CRIU rebuilt the job's mount namespace: the
// restore failed before any of the job's processes ran, and launch prunes again.
func againIfMountGone(launch func() error, retrying func(error)) error {
	err := launch()
	if criu.MountpointGone(err) {
		retrying(err)
		err = launch()
	}
	return err
}
