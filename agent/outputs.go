package agent

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/outputs"
	"github.com/ftkit/ftkit/criu"
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
		Space:    &a.outputSpace,
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

// settleOutputJournals looks at the output journals that restores left in their work directories when
// their agent was killed between cutting the job's outputs and the restore's outcome. It runs at start,
// after adopt and before any restore. A journal whose job runs here restored from its snapshot has the
// job's output going on from the cut: it goes. Any other is kept and reported: its bytes exist nowhere
// else, and putting them back is not safe from here (the job may run from another restore of it on another
// host, writing where they would go back, the same bytes when it is deterministic).
func (a *Agent) settleOutputJournals() {
	base := filepath.Join(a.cfg.StateDir, "restore")
	ents, err := os.ReadDir(base)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			a.log.Error("cannot list the restores' work directories: an output journal an interrupted restore left there is not looked at", "dir", base, "err", err)
		}
		return
	}
	for _, e := range ents {
		work := filepath.Join(base, e.Name())
		journal := filepath.Join(work, outputJournalDir)
		if st, err := os.Lstat(journal); !e.IsDir() || err != nil || !st.IsDir() {
			continue
		}
		a.settleOutputJournal(work, journal, e.Name())
	}
}

func (a *Agent) settleOutputJournal(work, journal, name string) {
	job, snap, ok := parseWorkName(name)
	a.mu.Lock()
	j := a.byID[job]
	runs := ok && j != nil && j.State == JobRunning && j.Restored == snap
	lazy := runs && j.LazyWork == work
	a.mu.Unlock()
	if !runs {
		a.log.Error("a restore interrupted by this host's previous agent cut the job's files, and no job here runs restored from it: its journal is kept; if the job runs from that snapshot nowhere, put the bytes back as its index says",
			"job", job, "snapshot", snap, "journal", journal, "index", outputs.IndexFile)
		return
	}
	rm := func() error { return criu.RemoveWorkDir(work) }
	if lazy {
		rm = func() error { return os.RemoveAll(journal) } // the lazily restored job's shim removes the rest
	}
	if err := rm(); err != nil {
		a.log.Warn("the output journal of a restore whose job runs was not removed", "job", job, "journal", journal, "err", err)
		return
	}
	a.log.Info("the output journal of an interrupted restore whose job runs was dropped: its output goes on from the cut", "job", job, "snapshot", snap)
}

// parseWorkName splits the name of a restore's work directory (workCopy: <job>-<snapshot>-<8 hex>).
// The dashes both ids hold leave one split that makes a valid job id and snapshot id, or the name says
// nothing for sure.
func parseWorkName(name string) (job, snap string, ok bool) {
	i := strings.LastIndexByte(name, '-')
	if i < 0 || len(name)-i-1 != 8 || strings.Trim(name[i+1:], "0123456789abcdef") != "" {
		return "", "", false
	}
	rest := name[:i]
	n := 0
	for k := range len(rest) {
		if rest[k] != '-' || !validJobID(rest[:k]) {
			continue
		}
		if _, err := ckpt.ParseID(rest[k+1:]); err == nil {
			job, snap, n = rest[:k], rest[k+1:], n+1
		}
	}
	return job, snap, n == 1
}
