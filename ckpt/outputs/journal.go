package outputs

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/filecopy"
	"github.com/ftkit/ftkit/internal/jobfs"
)

// Journal records what Restore changed, so that a restore that fails afterwards leaves the files as it
// found them. The bytes it cuts off or overwrites are saved (written and fsynced) before the change, in a
// directory of the restore's private work directory (0700, files 0600: they are whatever the job wrote).
// It holds each changed file open, so undo acts on the same inode whatever happened to its name.
type Journal struct {
	dir     string
	entries []*entry
	open    []*jobfs.Dir                               // directories to close with the journal
	saved   int64                                      // bytes its saved files may take, counted against its bound (fits)
	space   *Space                                     // shared with the journals of restores running at once
	statfs  func(path string, st *unix.Statfs_t) error // the free space of dir's file system (tests fake it)
}

// Space is shared by the journals of restores that run at once in one state directory: a save counts the
// bytes the others are still writing, which the file system's free space does not show yet, so that
// restores started together do not each take half of the same free space. The zero value is ready.
type Space struct {
	mu      sync.Mutex
	writing int64 // bytes of saves checked against the free space and not written yet
}

// reserve takes the bytes fit says a save needs, if fit allows them given what the others are writing;
// done gives them back once they are written (or not).
func (s *Space) reserve(fit func(writing int64) (need int64, err error)) (need int64, done func(), err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	need, err = fit(s.writing)
	if err != nil {
		return 0, nil, err
	}
	s.writing += need
	return need, func() {
		s.mu.Lock()
		s.writing -= need
		s.mu.Unlock()
	}, nil
}

type kind string

const (
	truncated   kind = "truncated"         // saved: the bytes from offset to size, cut off
	rewritten   kind = "rewritten"         // saved: the old content, overwritten from the snapshot
	createdFile kind = "created_file"      // undo removes it
	createdDir  kind = "created_directory" // undo removes it (empty by then)
)

// IndexFile is the file of a journal directory that says what each saved file holds and where its bytes
// belong, for an operator: written before each change is made, so that it survives an agent killed
// midway, and kept when Undo could not put everything back.
const IndexFile = "index.json"

// entry is one change; the exported fields are what an operator finds in IndexFile.
type entry struct {
	Kind   kind   `json:"kind"`
	Path   string `json:"path"`
	Offset int64  `json:"offset,omitempty"` // where the saved bytes belong in the file
	Size   int64  `json:"size,omitempty"`   // the file's size before the change
	Saved  string `json:"saved,omitempty"`  // file of the journal directory holding the bytes

	f      *os.File   // the changed file
	parent *jobfs.Dir // for created entries: the directory holding name
	name   string
}

func newJournal(dir string, space *Space) (*Journal, error) {
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, fmt.Errorf("output journal: %w", err)
	}
	// The index's write fsyncs the journal directory, not its entry in the parent: without this, a host
	// that lost power mid-restore could come back without the directory, and the saved bytes with it.
	if err := atomicfile.SyncDir(filepath.Dir(dir)); err != nil {
		os.Remove(dir)
		return nil, fmt.Errorf("output journal: %w", err)
	}
	if space == nil {
		space = &Space{}
	}
	return &Journal{dir: dir, space: space, statfs: unix.Statfs}, nil
}

// Dir is the journal's directory.
func (jr *Journal) Dir() string { return jr.dir }

func (jr *Journal) hold(d *jobfs.Dir) { jr.open = append(jr.open, d) }

func (jr *Journal) add(e *entry) { jr.entries = append(jr.entries, e) }

// save keeps f's bytes [off, size) in the journal before they change; on success the journal owns f.
func (jr *Journal) save(k kind, path string, f *os.File, off, size int64) error {
	e := &entry{Kind: k, Path: path, Offset: off, Size: size, Saved: fmt.Sprintf("%03d.bytes", len(jr.entries)), f: f}
	need, done, err := jr.space.reserve(func(writing int64) (int64, error) {
		return jr.fits(k, path, f, off, size, writing)
	})
	if err != nil {
		return err
	}
	defer done()
	p := filepath.Join(jr.dir, e.Saved)
	out, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("journal %s before changing it: %w", path, err)
	}
	// Only f's data: a user who made the file sparse (truncate -s 10T) before a restore costs root's disk
	// only what the file holds.
	err = filecopy.Range(out, f, off, size-off)
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
	jr.saved += need
	// An agent killed after the change leaves only what is on disk: the index says where the saved bytes
	// belong, and its write fsyncs the directory, so the saved file's own entry is durable too.
	if err := jr.writeIndex(); err != nil {
		jr.entries = jr.entries[:len(jr.entries)-1]
		jr.saved -= need
		os.Remove(p)
		return fmt.Errorf("journal %s before changing it: %w", path, err)
	}
	return nil
}

// fits returns how many bytes saving f's [off, size) may take in the journal, or refuses when that is more
// than the journal may take: how much a job's user wrote is not root's to bound, and a full state
// directory breaks the agent. The journal as a whole takes at most half of the space its file system had
// free: each save is held to half of what is free now less what the journal already took and what other
// journals are writing (Space).
func (jr *Journal) fits(k kind, path string, f *os.File, off, size, writing int64) (int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, fmt.Errorf("journal %s before changing it: %w", path, err)
	}
	var sfs unix.Statfs_t
	if err := jr.statfs(jr.dir, &sfs); err != nil {
		return 0, fmt.Errorf("journal %s before changing it: free space of %s: %w", path, jr.dir, err)
	}
	// Holes are not copied: the file's allocated bytes bound the copy, whatever its apparent size.
	need := min(size-off, st.Blocks*512)
	free := int64(sfs.Bavail) * int64(sfs.Bsize)
	limit := (free - jr.saved - writing) / 2
	if need <= limit {
		return need, nil
	}
	what, fix := "cut off", fmt.Sprintf("truncate the file to its snapshot size, %d bytes, yourself (the restored job writes what follows again)", off)
	if k == rewritten {
		what, fix = "overwrite", "remove the file yourself (the restore then recreates it from the snapshot)"
	}
	held := ""
	if jr.saved > 0 {
		held = fmt.Sprintf(", less the %d bytes it holds already", jr.saved)
	}
	if writing > 0 {
		held += fmt.Sprintf(", less the %d bytes other restores are saving there", writing)
	}
	return 0, fmt.Errorf("journal %s before changing it: refused: the %d bytes the restore would %s, saved first so that a failed restore can put them back, are more than the %d bytes the journal may take (half of the %d bytes free in %s%s); %s, or free space there, and retry",
		path, need, what, max(limit, 0), free, jr.dir, held, fix)
}

// writeIndex replaces IndexFile with the journal's entries.
func (jr *Journal) writeIndex() error {
	b, err := json.MarshalIndent(jr.entries, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(filepath.Join(jr.dir, IndexFile), b, 0o600)
}

// Undo reverts every change, newest first, and closes the journal. It goes on past a failure and reports
// them all; then the journal's directory also holds IndexFile, and its saved bytes exist nowhere else:
// the caller keeps the directory and tells the operator where it is. A nil journal has nothing to undo.
func (jr *Journal) Undo() error {
	if jr == nil {
		return nil
	}
	var errs []error
	for i := len(jr.entries) - 1; i >= 0; i-- {
		if err := jr.entries[i].undo(jr.dir); err != nil {
			errs = append(errs, fmt.Errorf("put back %s (%s): %w", jr.entries[i].Path, jr.entries[i].Kind, err))
		}
	}
	if len(errs) > 0 {
		jr.writeIndex()
	}
	jr.Close()
	return errors.Join(errs...)
}

func (e *entry) undo(dir string) error {
	switch e.Kind {
	case createdFile:
		return e.parent.RemoveFile(e.name, e.f)
	case createdDir:
		return e.parent.RemoveDir(e.name)
	}
	saved, err := os.Open(filepath.Join(dir, e.Saved))
	if err != nil {
		return err
	}
	defer saved.Close()
	// Cut first, then copy only the saved data: the file's holes come back as holes, never as zeros written
	// into the user's file system.
	if err := e.f.Truncate(e.Offset); err != nil {
		return err
	}
	if err := filecopy.RangeTo(e.f, e.Offset, saved, 0, e.Size-e.Offset); err != nil {
		return err
	}
	return e.f.Sync()
}

// Close releases the files and directories the journal holds: the restore succeeded, or was undone.
func (jr *Journal) Close() {
	if jr == nil {
		return
	}
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
