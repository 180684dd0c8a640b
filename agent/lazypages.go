package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// pagesInTimeout bounds how long a snapshot waits for a lazily restored job's pages (failover.lazy_restore):
// the lazy-pages daemon pushes them in the background at the speed of a local copy.
const pagesInTimeout = 2 * time.Minute

// waitPagesIn returns once every page of job id is in: at once unless it was restored lazily and its shim
// has not yet removed the images the pages come from. A snapshot before that would dump the missing
// pages as zeros.
func (a *Agent) waitPagesIn(ctx context.Context, id string) error {
	j, _, err := a.Job(id, 0)
	if err != nil || j.LazyWork == "" {
		return nil
	}
	if !a.ownRestoreDir(j.LazyWork) {
		return fmt.Errorf("job %s: its record names %q as its images, which is not this agent's: not snapshotted", id, j.LazyWork)
	}
	ctx, cancel := context.WithTimeout(ctx, pagesInTimeout)
	defer cancel()
	start := time.Now()
	for {
		_, err := os.Lstat(j.LazyWork)
		if errors.Is(err, fs.ErrNotExist) {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("job %s: its pages are still coming in from %s after %s (see lazy-pages.log there): not snapshotted: %w",
				id, j.LazyWork, time.Since(start).Round(time.Millisecond), ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	a.mu.Lock()
	if cur, ok := a.byID[id]; ok && cur.LazyWork == j.LazyWork {
		cur.LazyWork = ""
		if err := a.jobs.save(cur); err != nil {
			a.log.Error("save job record", "job", id, "err", err)
		}
	}
	a.mu.Unlock()
	if d := time.Since(start); d > 10*time.Millisecond {
		a.log.Info("lazily restored job has all its pages; snapshotting it", "job", id, "waited_ms", d.Milliseconds())
	}
	return nil
}

// ownRestoreDir reports whether dir is a working directory of this agent's restores (workCopy), the only
// place a job record's LazyWork may point: records come from snapshots other hosts took.
func (a *Agent) ownRestoreDir(dir string) bool {
	base := filepath.Join(a.cfg.StateDir, "restore") + string(filepath.Separator)
	return strings.HasPrefix(filepath.Clean(dir), base) && !strings.Contains(strings.TrimPrefix(filepath.Clean(dir), base), string(filepath.Separator))
}
