package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/jobfs"
)

// restoreOutputs puts each regular file the job had open for writing back to its size at the snapshot: a
// longer file is truncated (the restored job writes those bytes again), a shorter or missing one of the
// job's own outputs is rewritten from the copy in the snapshot. CRIU refuses a file whose size differs.
//
// Root does this in places the job's user may control, so it never follows a link: the job's outputs are
// reached through its directory (root's; one an older agent handed to the user is taken back first), any
// other file from "/" with no link on the way, and only a regular file owned by the job's uid is changed.
// A file outside the job directory is never created. Every change is journaled in journalDir first; on
// error the journal holds what was done so far, for the caller to undo.
func (a *Agent) restoreOutputs(m *ckpt.Manifest, j Job, journalDir string) (*outputJournal, error) {
	jr, err := newOutputJournal(journalDir)
	if err != nil {
		return nil, err
	}
	l := a.layout()
	var dir, snap, root *jobfs.Dir
	// The snapshot's copy of the outputs is needed only for a file to rewrite or recreate.
	snapDir := func() (*jobfs.Dir, error) {
		if snap == nil {
			d, err := jobfs.OpenDir(filepath.Join(a.store.Path(m.Job, m.ID), snapOutputs))
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
		name, inside := l.outputName(j.ID, f.Path)
		switch {
		case inside && name == "": // checkPeerJob refuses these
			return jr, fmt.Errorf("%s is inside the job directory but not one of the job's outputs there", f.Path)
		case inside:
			if dir == nil {
				if dir, err = a.openJobDir(jr, l, j); err != nil {
					return jr, err
				}
			}
			err = restoreOwnOutput(jr, dir, snapDir, name, f, j)
		default:
			if root == nil {
				if root, err = jobfs.OpenRoot(); err != nil {
					return jr, err
				}
				jr.hold(root)
			}
			err = restoreOtherFile(jr, root, f, j)
		}
		if err != nil {
			return jr, err
		}
	}
	return jr, nil
}

// openJobDir opens the job's directory, creating it (root's, 0755) on a host that lacks it (no shared
// file system).
func (a *Agent) openJobDir(jr *outputJournal, l jobLayout, j Job) (*jobfs.Dir, error) {
	jobs, err := jobfs.OpenTrusted(l.jobsDir)
	if err != nil {
		return nil, fmt.Errorf("open jobs_dir: %w", err)
	}
	jr.hold(jobs)
	dir, err := jobs.OpenDir(j.ID)
	if errors.Is(err, fs.ErrNotExist) {
		if dir, err = jobs.Mkdir(j.ID, 0o755); err == nil {
			jr.add(&journalEntry{Kind: journalCreatedDir, Path: l.dir(j.ID), parent: jobs, name: j.ID})
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
		a.log.Warn("job directory is writable by the job's user (made by an older agent); giving it back to root",
			"job", j.ID, "dir", l.dir(j.ID), "uid", st.Uid, "mode", fmt.Sprintf("%#o", st.Mode&0o7777))
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
func restoreOwnOutput(jr *outputJournal, dir *jobfs.Dir, snapDir func() (*jobfs.Dir, error), name string, f ckpt.OpenFile, j Job) error {
	out, err := dir.OpenOwned(name, os.O_RDWR, j.UID)
	if errors.Is(err, fs.ErrNotExist) {
		return recreateOutput(jr, dir, snapDir, name, f, j)
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
	if err := jr.save(journalRewritten, f.Path, out, 0, st.Size()); err != nil {
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
	if err := copyPrefix(io.NewOffsetWriter(out, 0), src, f.Size); err != nil {
		return fmt.Errorf("rewrite %s from the snapshot: %w", f.Path, err)
	}
	return out.Truncate(f.Size)
}

// recreateOutput recreates a missing output of the job from the snapshot's copy, as the job's user's file.
func recreateOutput(jr *outputJournal, dir *jobfs.Dir, snapDir func() (*jobfs.Dir, error), name string, f ckpt.OpenFile, j Job) error {
	snap, err := snapDir()
	if err != nil {
		return err
	}
	src, err := snap.Open(name)
	if err != nil {
		return fmt.Errorf("recreate %s from the snapshot: %w", f.Path, err)
	}
	defer src.Close()
	out, err := dir.Create(name, 0o600, j.UID, j.GID) // as the shim creates it
	if err != nil {
		return fmt.Errorf("recreate %s from the snapshot: %w", f.Path, err)
	}
	jr.add(&journalEntry{Kind: journalCreatedFile, Path: f.Path, f: out, parent: dir, name: name})
	if err := copyPrefix(out, src, f.Size); err != nil {
		return fmt.Errorf("recreate %s from the snapshot: %w", f.Path, err)
	}
	return nil
}

// restoreOtherFile truncates a file the job writes outside its directory back to its snapshot size. It
// must be there already, at least that long, a regular file owned by the job's uid, with no link on its
// path: root does for the job only what the job's user could do itself.
func restoreOtherFile(jr *outputJournal, root *jobfs.Dir, f ckpt.OpenFile, j Job) error {
	rel, ok := root.Rel(f.Path)
	if !ok { // checkPeerJob refuses these
		return fmt.Errorf("open file %q is not an absolute, clean path", f.Path)
	}
	out, err := root.OpenOwned(rel, os.O_RDWR, j.UID)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s is missing and is not one of the job's outputs in its directory, so the restore does not create it: put it back (at least %d bytes, as at the snapshot) and retry", f.Path, f.Size)
	}
	if err != nil {
		return fmt.Errorf("%w; the restore truncates a file outside the job directory only if it is a regular file owned by the job's uid %d with no symbolic link on its path: make it so, or truncate it to %d bytes yourself, and retry", err, j.UID, f.Size)
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
func truncateTo(jr *outputJournal, out *os.File, f ckpt.OpenFile, size int64) error {
	if err := jr.save(journalTruncated, f.Path, out, f.Size, size); err != nil {
		out.Close()
		return err
	}
	if err := out.Truncate(f.Size); err != nil {
		return fmt.Errorf("truncate %s to its snapshot size %d: %w", f.Path, f.Size, err)
	}
	return nil
}

// outputJournal records what restoreOutputs changed, so that a restore that fails afterwards leaves the
// files as it found them. The bytes it cuts off or overwrites are saved (written and fsynced) before the
// change, in a directory of the restore's private work directory (0700, files 0600: they are whatever
// the job wrote). It holds each changed file open, so undo acts on the same inode whatever happened to
// its name.
type outputJournal struct {
	dir     string
	entries []*journalEntry
	open    []*jobfs.Dir // directories to close with the journal
}

type journalKind string

const (
	journalTruncated   journalKind = "truncated"         // saved: the bytes from offset to size, cut off
	journalRewritten   journalKind = "rewritten"         // saved: the old content, overwritten from the snapshot
	journalCreatedFile journalKind = "created_file"      // undo removes it
	journalCreatedDir  journalKind = "created_directory" // undo removes it (empty by then)
)

// journalEntry is one change; the exported fields are what an operator finds in index.json of a journal
// that could not be undone.
type journalEntry struct {
	Kind   journalKind `json:"kind"`
	Path   string      `json:"path"`
	Offset int64       `json:"offset,omitempty"` // where the saved bytes belong in the file
	Size   int64       `json:"size,omitempty"`   // the file's size before the change
	Saved  string      `json:"saved,omitempty"`  // file of the journal directory holding the bytes

	f      *os.File   // the changed file
	parent *jobfs.Dir // for created entries: the directory holding name
	name   string
}

func newOutputJournal(dir string) (*outputJournal, error) {
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, fmt.Errorf("output journal: %w", err)
	}
	return &outputJournal{dir: dir}, nil
}

func (jr *outputJournal) hold(d *jobfs.Dir) { jr.open = append(jr.open, d) }

func (jr *outputJournal) add(e *journalEntry) { jr.entries = append(jr.entries, e) }

// save keeps f's bytes [off, size) in the journal before they change; on success the journal owns f.
func (jr *outputJournal) save(kind journalKind, path string, f *os.File, off, size int64) error {
	e := &journalEntry{Kind: kind, Path: path, Offset: off, Size: size, Saved: fmt.Sprintf("%03d.bytes", len(jr.entries)), f: f}
	p := filepath.Join(jr.dir, e.Saved)
	out, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("journal %s before changing it: %w", path, err)
	}
	_, err = io.Copy(out, io.NewSectionReader(f, off, size-off))
	if err == nil {
		err = out.Sync()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(p)
		return fmt.Errorf("journal %s before changing it: %w", path, err)
	}
	jr.add(e)
	return nil
}

// undo reverts every change, newest first, and closes the journal. It goes on past a failure and reports
// them all.
func (jr *outputJournal) undo() error {
	var errs []error
	for i := len(jr.entries) - 1; i >= 0; i-- {
		if err := jr.entries[i].undo(jr.dir); err != nil {
			errs = append(errs, fmt.Errorf("put back %s (%s): %w", jr.entries[i].Path, jr.entries[i].Kind, err))
		}
	}
	jr.close()
	return errors.Join(errs...)
}

func (e *journalEntry) undo(dir string) error {
	switch e.Kind {
	case journalCreatedFile:
		return e.parent.RemoveFile(e.name, e.f)
	case journalCreatedDir:
		return e.parent.RemoveDir(e.name)
	}
	saved, err := os.Open(filepath.Join(dir, e.Saved))
	if err != nil {
		return err
	}
	defer saved.Close()
	if _, err := io.Copy(io.NewOffsetWriter(e.f, e.Offset), saved); err != nil {
		return err
	}
	if err := e.f.Truncate(e.Size); err != nil {
		return err
	}
	return e.f.Sync()
}

// close releases the files and directories the journal holds; the restore succeeded or was undone.
func (jr *outputJournal) close() {
	for _, e := range jr.entries {
		if e.f != nil {
			e.f.Close()
		}
	}
	for _, d := range jr.open {
		d.Close()
	}
	jr.entries, jr.open = nil, nil
}

// undoOutputs puts the job's files back as restoreOutputs found them, after the restore failed with err.
// If that fails too, the journal is moved out of the work directory, which is then removed, and the error
// says where it is: the bytes it holds exist nowhere else. keepWork is for a journal that could not move.
func (a *Agent) undoOutputs(jr *outputJournal, m *ckpt.Manifest, err error) (keepWork bool, _ error) {
	if jr == nil {
		return false, err
	}
	entries := jr.entries
	uerr := jr.undo()
	if uerr == nil {
		return false, err
	}
	if b, merr := json.MarshalIndent(entries, "", "  "); merr == nil {
		atomicfile.WriteFile(filepath.Join(jr.dir, "index.json"), b, 0o600)
	}
	kept := filepath.Join(a.cfg.StateDir, "restore", fmt.Sprintf("%s-%s.journal-%d", m.Job, m.ID, time.Now().Unix()))
	if rerr := os.Rename(jr.dir, kept); rerr != nil {
		kept, keepWork = jr.dir, true
	}
	a.log.Error("a failed restore could not put the job's files back", "job", m.Job, "snapshot", m.ID, "err", uerr, "journal", kept)
	return keepWork, fmt.Errorf("%w; putting the job's files back as they were failed too (%v): what the restore cut off or overwrote is kept in %s (see index.json there)", err, uerr, kept)
}
