// Package outputs puts a job's output files back to their sizes at a snapshot before CRIU restores it
// (CRIU refuses a file whose size differs), with an on-disk journal that undoes the changes if the
// restore fails. ckpt/dump copies the job's own outputs into the snapshot; this package is the other
// half, on the restoring host.
//
// Root does this in places the job's user may control, so it never follows a link: the job's outputs are
// reached through its directory (root's; one an older agent handed to the user is taken back first), any
// other file from "/" with no link on the way (internal/jobfs), and only a regular file owned by the
// job's uid is changed. A file outside the job directory is never created.
package outputs

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/filecopy"
	"github.com/ftkit/ftkit/internal/jobfs"
)

// Target is what Restore needs to know of the job being restored.
type Target struct {
	Job      string // the job's id: its directory is JobsDir/Job
	UID, GID uint32 // the job's user: only its regular files are changed, and a recreated output is its
	JobsDir  string // root's directory of job directories (trusted: root's all the way up)
	// Name returns the name inside the job directory of path if path is one of the job's outputs there;
	// inside reports whether path is in the job directory at all (as dump.Outputs.Name).
	Name func(path string) (name string, inside bool)
	// Snapshot is the snapshot's copy of the job's outputs (dump.OutputsDir of the snapshot), read only
	// for a file to rewrite or recreate.
	Snapshot string
	Log      *slog.Logger // nil: slog.Default()
	// Space is shared by the journals of the restores that run at once (nil: this journal's alone).
	Space *Space
}

func (t Target) dir() string { return filepath.Join(t.JobsDir, t.Job) }

// Restore puts each regular file the job had open for writing in m back to its size at the snapshot: a
// longer file is truncated (the restored job writes those bytes again), a shorter or missing one of the
// job's own outputs is rewritten from the copy in the snapshot.
//
// Every change is journaled in journalDir (created 0700; it must not exist yet) first. On error the
// returned journal, if not nil, holds what was done so far: the caller undoes it (Journal.Undo). On
// success the caller closes it once the restore succeeded, or undoes it if the restore failed.
func Restore(m *ckpt.Manifest, t Target, journalDir string) (*Journal, error) {
	if t.Log == nil {
		t.Log = slog.Default()
	}
	jr, err := newJournal(journalDir, t.Space)
	if err != nil {
		return nil, err
	}
	var dir, snap, root *jobfs.Dir
	// The snapshot's copy of the outputs is needed only for a file to rewrite or recreate.
	snapDir := func() (*jobfs.Dir, error) {
		if snap == nil {
			d, err := jobfs.OpenDir(t.Snapshot)
			if err != nil {
				return nil, fmt.Errorf("the snapshot's copy of the job's outputs: %w", err)
			}
			snap = d
			jr.hold(snap)
		}
		return snap, nil
	}
	done := map[string]bool{}
	for _, f := range m.OpenFiles {
		if done[f.Path] { // open more than once
			continue
		}
		done[f.Path] = true
		name, inside := t.Name(f.Path)
		switch {
		case inside && name == "": // the agent refuses such a job record before
			return jr, fmt.Errorf("%s is inside the job directory but not one of the job's outputs there", f.Path)
		case inside:
			if dir == nil {
				if dir, err = openJobDir(jr, t); err != nil {
					return jr, err
				}
			}
			err = restoreOwnOutput(jr, dir, snapDir, name, f, t)
		default:
			if root == nil {
				if root, err = jobfs.OpenRoot(); err != nil {
					return jr, err
				}
				jr.hold(root)
			}
			err = restoreOtherFile(jr, root, f, t)
		}
		if err != nil {
			return jr, err
		}
	}
	return jr, nil
}

// openJobDir opens the job's directory, creating it (root's, 0755) on a host that lacks it (no shared
// file system).
func openJobDir(jr *Journal, t Target) (*jobfs.Dir, error) {
	jobs, err := jobfs.OpenTrusted(t.JobsDir)
	if err != nil {
		return nil, fmt.Errorf("open jobs_dir: %w", err)
	}
	jr.hold(jobs)
	dir, err := jobs.OpenDir(t.Job)
	if errors.Is(err, fs.ErrNotExist) {
		if dir, err = jobs.Mkdir(t.Job, 0o755); err == nil {
			jr.add(&entry{Kind: createdDir, Path: t.dir(), parent: jobs, name: t.Job})
		}
	}
	if err != nil {
		return nil, fmt.Errorf("job directory: %w", err)
	}
	jr.hold(dir)
	st, err := dir.Stat()
	if err != nil {
		return nil, err
	}
	if st.Uid != 0 || st.Mode&0o022 != 0 {
		// An older agent handed job directories to the job's user, who could then swap an output for a link
		// between these checks and CRIU reopening it by path, as root. Take the directory back first.
		t.Log.Warn("job directory is writable by the job's user (made by an older agent); giving it back to root",
			"job", t.Job, "dir", t.dir(), "uid", st.Uid, "mode", fmt.Sprintf("%#o", st.Mode&0o7777))
		if err := dir.Chown(0, 0); err != nil {
			return nil, err
		}
		if err := dir.Chmod(0o755); err != nil {
			return nil, err
		}
	}
	return dir, nil
}

// restoreOwnOutput puts one of the job's outputs in its directory back to its size at the snapshot.
func restoreOwnOutput(jr *Journal, dir *jobfs.Dir, snapDir func() (*jobfs.Dir, error), name string, f ckpt.OpenFile, t Target) error {
	out, err := dir.OpenOwned(name, os.O_RDWR, t.UID)
	if errors.Is(err, fs.ErrNotExist) {
		return recreateOutput(jr, dir, snapDir, name, f, t)
	}
	if err != nil {
		return fmt.Errorf("job output: %w; the restore writes only the job's own regular files, through no link: remove it and retry (the restore then recreates it from the snapshot)", err)
	}
	st, err := out.Stat()
	switch {
	case err != nil:
		out.Close()
		return err
	case st.Size() == f.Size:
		out.Close()
		return nil
	case st.Size() > f.Size:
		return truncateTo(jr, out, f, st.Size())
	}
	// Shorter than at the snapshot (a shared file system that lost a write, say): rewrite it from the copy.
	if err := jr.save(rewritten, f.Path, out, 0, st.Size()); err != nil {
		out.Close()
		return err
	}
	snap, err := snapDir()
	if err != nil {
		return err
	}
	src, err := snap.Open(name)
	if err != nil {
		return fmt.Errorf("rewrite %s from the snapshot: %w", f.Path, err)
	}
	defer src.Close()
	// Only the copy's data (the journal holds the file's bytes): a hole the job made stays a hole.
	if err := out.Truncate(0); err != nil {
		return fmt.Errorf("rewrite %s from the snapshot: %w", f.Path, err)
	}
	if err := filecopy.Range(out, src, 0, f.Size); err != nil {
		return fmt.Errorf("rewrite %s from the snapshot: %w", f.Path, err)
	}
	return nil
}

// recreateOutput recreates a missing output of the job from the snapshot's copy, as the job's user's file.
func recreateOutput(jr *Journal, dir *jobfs.Dir, snapDir func() (*jobfs.Dir, error), name string, f ckpt.OpenFile, t Target) error {
	snap, err := snapDir()
	if err != nil {
		return err
	}
	src, err := snap.Open(name)
	if err != nil {
		return fmt.Errorf("recreate %s from the snapshot: %w", f.Path, err)
	}
	defer src.Close()
	out, err := dir.Create(name, 0o600, t.UID, t.GID) // as the shim creates it
	if err != nil {
		return fmt.Errorf("recreate %s from the snapshot: %w", f.Path, err)
	}
	jr.add(&entry{Kind: createdFile, Path: f.Path, f: out, parent: dir, name: name})
	// Only the copy's data, as for a rewrite: a job that seeked far past its output's end must not have
	// root write that many zeros into the job directory's file system.
	if err := filecopy.Range(out, src, 0, f.Size); err != nil {
		return fmt.Errorf("recreate %s from the snapshot: %w", f.Path, err)
	}
	return nil
}

// restoreOtherFile truncates a file the job writes outside its directory back to its snapshot size. It
// must be there already, at least that long, a regular file owned by the job's uid, with no link on its
// path: root does for the job only what the job's user could do itself.
func restoreOtherFile(jr *Journal, root *jobfs.Dir, f ckpt.OpenFile, t Target) error {
	rel, ok := root.Rel(f.Path)
	if !ok { // the agent refuses such a job record before
		return fmt.Errorf("open file %q is not an absolute, clean path", f.Path)
	}
	out, err := root.OpenOwned(rel, os.O_RDWR, t.UID)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s is missing and is not one of the job's outputs in its directory, so the restore does not create it: put it back (at least %d bytes, as at the snapshot) and retry", f.Path, f.Size)
	}
	if err != nil {
		return fmt.Errorf("%w; the restore truncates a file outside the job directory only if it is a regular file owned by the job's uid %d with no symbolic link on its path: make it so, or truncate it to %d bytes yourself, and retry", err, t.UID, f.Size)
	}
	st, err := out.Stat()
	switch {
	case err != nil:
		out.Close()
		return err
	case st.Size() == f.Size:
		out.Close()
		return nil
	case st.Size() < f.Size:
		out.Close()
		return fmt.Errorf("%s is shorter than at the snapshot (%d bytes, not %d) and is not one of the job's outputs in its directory: put its content back and retry", f.Path, st.Size(), f.Size)
	}
	return truncateTo(jr, out, f, st.Size())
}

// truncateTo saves the bytes past f.Size in the journal, then cuts them off.
func truncateTo(jr *Journal, out *os.File, f ckpt.OpenFile, size int64) error {
	if err := jr.save(truncated, f.Path, out, f.Size, size); err != nil {
		out.Close()
		return err
	}
	if err := out.Truncate(f.Size); err != nil {
		return fmt.Errorf("truncate %s to its snapshot size %d: %w", f.Path, f.Size, err)
	}
	return nil
}
