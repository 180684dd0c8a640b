package agent

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/outputs"
	"github.com/ftkit/ftkit/internal/atomicfile"
)

// restoreOutputs puts job j's output files back to their sizes at snapshot m (ckpt/outputs), journaling
// every change in journalDir first.
func (a *Agent) restoreOutputs(m *ckpt.Manifest, j Job, journalDir string) (*outputs.Journal, error) {
	l := a.layout()
	return outputs.Restore(m, outputs.Target{
		Job: j.ID, UID: j.UID, GID: j.GID, JobsDir: l.jobsDir,
		Name:     func(path string) (string, bool) { return l.outputName(j.ID, path) },
		Snapshot: filepath.Join(a.store.Path(m.Job, m.ID), snapOutputs),
		Log:      a.log,
	}, journalDir)
}

// undoOutputs puts the job's files back as restoreOutputs found them, after the restore failed with err.
// If that fails too, the journal is moved out of the work directory, which is then removed, and the error
// says where it is: the bytes it holds exist nowhere else. keepWork is for a journal that could not move.
func (a *Agent) undoOutputs(jr *outputs.Journal, m *ckpt.Manifest, err error) (keepWork bool, _ error) {
	if jr == nil {
		return false, err
	}
	uerr := jr.Undo()
	if uerr == nil {
		return false, err
	}
	kept := filepath.Join(a.cfg.StateDir, "restore", fmt.Sprintf("%s-%s.journal-%d", m.Job, m.ID, time.Now().Unix()))
	if rerr := os.Rename(jr.Dir(), kept); rerr != nil {
		kept, keepWork = jr.Dir(), true
	} else if serr := atomicfile.SyncDir(filepath.Dir(kept)); serr != nil {
		keepWork = true // the rename may not survive a crash: the work directory is not removed under it
	}
	a.log.Error("a failed restore could not put the job's files back", "job", m.Job, "snapshot", m.ID, "err", uerr, "journal", kept)
	return keepWork, fmt.Errorf("%w; putting the job's files back as they were failed too (%v): what the restore cut off or overwrote is kept in %s (see %s there)", err, uerr, kept, outputs.IndexFile)
}
