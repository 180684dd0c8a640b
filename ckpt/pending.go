package ckpt

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/ftkit/ftkit/internal/atomicfile"
)

// Pending is a snapshot being written into a hidden temp directory. Exactly
// one of Commit, CommitReceived or Abort ends it.
type Pending struct {
	s       *Store
	job     string
	id      string
	parent  string
	created time.Time
	dir     string
	lock    *os.File  // flock held on dir while the pending lives
	want    *Manifest // set for snapshots received from another node
	// replace lets the commit swap out a committed copy of the same id
	// (BeginReplace); without it, an existing copy makes the commit fail.
	replace bool
	done    bool
	// written holds the files the receiver wrote and hashed as it wrote them (Written), by name.
	written map[string]FileEntry
}

// ID is the id the snapshot will have once committed.
func (p *Pending) ID() string { return p.id }

// Job is the job the snapshot belongs to.
func (p *Pending) Job() string { return p.job }

// Dir is the temp directory to dump into (criu dump -D).
func (p *Pending) Dir() string { return p.dir }

// Created is the snapshot's creation time (also encoded in its id).
func (p *Pending) Created() time.Time { return p.created }

// Parent is the id of the newest committed snapshot of the same job and
// node when Begin ran ("" if none).
func (p *Pending) Parent() string { return p.parent }

// Begin starts a new snapshot of job on this node and returns the temp
// directory to dump into.
func (s *Store) Begin(job string) (*Pending, error) {
	if err := ValidName(job); err != nil {
		return nil, fmt.Errorf("begin snapshot: job: %w", err)
	}
	if err := s.ensureJobDir(job); err != nil {
		return nil, err
	}
	existing, err := s.List(job, s.node)
	if err != nil {
		return nil, fmt.Errorf("begin snapshot of %s: %w", job, err)
	}
	var parent string
	if len(existing) > 0 {
		parent = existing[0]
	}

	s.mu.Lock()
	t := s.now().UTC().Truncate(time.Millisecond)
	if t.Before(s.last) {
		t = s.last // the clock stepped back; ids must still grow
	}
	if parent != "" {
		// After a restart with a clock behind the newest id on disk.
		if pid, err := ParseID(parent); err == nil && !t.After(pid.Time) {
			t = pid.Time.Add(time.Millisecond)
		}
	}
	s.last = t
	s.seq = (s.seq + 1) % 1_000_000
	id := SnapshotID{Time: t, Node: s.node, Seq: s.seq}.String()
	s.mu.Unlock()

	p := &Pending{s: s, job: job, id: id, parent: parent, created: t}
	if err := p.create(); err != nil {
		return nil, err
	}
	return p, nil
}

// BeginReceive starts writing a copy of a snapshot committed on another
// node; m is its (already decoded) manifest. It fails with ErrExists if the
// snapshot is already committed here.
func (s *Store) BeginReceive(m *Manifest) (*Pending, error) {
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("receive snapshot: %w", err)
	}
	if _, err := os.Lstat(s.Path(m.Job, m.ID)); err == nil {
		return nil, fmt.Errorf("receive snapshot %s/%s: %w", m.Job, m.ID, ErrExists)
	}
	return s.beginReceive(m, false)
}

// BeginReplace is BeginReceive for a snapshot that may already be committed
// here in a copy that is damaged or differs from the sender's. That copy
// stays in place, untouched, until CommitReceived has verified the new one;
// the commit then swaps the two atomically and removes the old one, so a
// failed transfer or a crash at any step leaves one complete copy visible.
func (s *Store) BeginReplace(m *Manifest) (*Pending, error) {
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("receive snapshot: %w", err)
	}
	return s.beginReceive(m, true)
}

func (s *Store) beginReceive(m *Manifest, replace bool) (*Pending, error) {
	if err := s.ensureJobDir(m.Job); err != nil {
		return nil, err
	}
	want := *m
	p := &Pending{s: s, job: m.Job, id: m.ID, parent: m.Parent, created: m.Created, want: &want, replace: replace}
	if err := p.create(); err != nil {
		return nil, err
	}
	return p, nil
}

func (s *Store) ensureJobDir(job string) error {
	dir := filepath.Join(s.root, job)
	err := os.Mkdir(dir, dirPerm)
	if errors.Is(err, fs.ErrExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("create job directory %s: %w", dir, err)
	}
	return atomicfile.SyncDir(s.root)
}

func (p *Pending) create() error {
	p.dir = filepath.Join(p.s.root, p.job, tmpPrefix+p.id)
	err := os.Mkdir(p.dir, dirPerm)
	if errors.Is(err, fs.ErrExist) {
		// Left by a crash, or being written right now by someone else.
		lk, lerr := lockDir(p.dir, false)
		if lerr != nil {
			return fmt.Errorf("begin snapshot %s/%s: temp directory %s is in use by another writer", p.job, p.id, p.dir)
		}
		err = os.RemoveAll(p.dir)
		lk.Close()
		if err != nil {
			return fmt.Errorf("begin snapshot %s/%s: remove stale %s: %w", p.job, p.id, p.dir, err)
		}
		err = os.Mkdir(p.dir, dirPerm)
	}
	if err != nil {
		return fmt.Errorf("begin snapshot %s/%s: %w", p.job, p.id, err)
	}
	p.lock, err = lockDir(p.dir, false)
	if err != nil {
		// Not removed: between the Mkdir and the lock, another writer may have taken the directory for
		// stale, made it again and locked it. A stale one is removed by the next writer that locks it.
		return fmt.Errorf("begin snapshot %s/%s: lock %s (in use by another writer?): %w", p.job, p.id, p.dir, err)
	}
	return nil
}

// Written records that the caller hashed file name (relative, '/'-separated) of the pending snapshot
// itself, every byte as it was written: size bytes whose sha256 is sum (a receiver hashing the stream it
// writes, a dump hashing CRIU's images as CRIU writes them). The commit then takes that entry instead of
// reading the file back to hash it a second time, a pass of 40-60 ms per 100 MiB inside a migration's stop
// (docs/design.md, planned migration). The commit still checks the file's size on disk (a file of another
// size is hashed from disk), and a received snapshot's entries are compared with its manifest as always.
func (p *Pending) Written(name string, size int64, sum string) {
	if p.written == nil {
		p.written = map[string]FileEntry{}
	}
	p.written[name] = FileEntry{Name: name, Size: size, SHA256: sum}
}

// Abort discards the pending snapshot.
func (p *Pending) Abort() error {
	if p.done {
		return nil
	}
	p.done = true
	err := os.RemoveAll(p.dir)
	p.lock.Close()
	if err != nil {
		return fmt.Errorf("abort snapshot %s/%s: remove %s: %w", p.job, p.id, p.dir, err)
	}
	return nil
}

// errSimulatedCrash is returned when a test hook stops a commit midway.
var errSimulatedCrash = errors.New("simulated crash")

// Commit hashes and fsyncs every file in Dir, writes the manifest built from
// info, and atomically moves the snapshot into place. On failure the temp
// directory is removed and nothing becomes visible.
func (p *Pending) Commit(ctx context.Context, info Info) (*Manifest, error) {
	if p.want != nil {
		return nil, fmt.Errorf("commit %s/%s: a received snapshot must be committed with CommitReceived", p.job, p.id)
	}
	return p.commit(ctx, func(files []FileEntry) (*Manifest, error) {
		return &Manifest{
			Job: p.job, Node: p.s.node, ID: p.id, Created: p.created, Parent: p.parent,
			Info: info, Files: files,
		}, nil
	})
}

// CommitReceived checks that the files in Dir are exactly those of the
// received manifest (names, sizes, sha256), then commits like Commit. from
// is the node the copy came from (authenticated by the caller); it is
// recorded as the only replica, since it holds a verified copy. Empty from
// records none.
func (p *Pending) CommitReceived(ctx context.Context, from string) (*Manifest, error) {
	if p.want == nil {
		return nil, fmt.Errorf("commit %s/%s: not a received snapshot; use Commit", p.job, p.id)
	}
	if from != "" {
		if err := ValidName(from); err != nil {
			return nil, fmt.Errorf("commit %s/%s: sender: %w", p.job, p.id, err)
		}
	}
	return p.commit(ctx, func(files []FileEntry) (*Manifest, error) {
		if err := compareFiles(p.job, p.id, p.want.Files, files); err != nil {
			return nil, err
		}
		m := *p.want
		m.Replicas = nil
		if from != "" && from != p.s.node {
			m.Replicas = []string{from}
		}
		return &m, nil
	})
}

// compareFiles reports every difference between the manifest's file list and
// what is on disk, each as a *VerifyError naming the file.
func compareFiles(job, id string, want, got []FileEntry) error {
	var errs []error
	gotBy := make(map[string]FileEntry, len(got))
	for _, f := range got {
		gotBy[f.Name] = f
	}
	for _, w := range want {
		g, ok := gotBy[w.Name]
		delete(gotBy, w.Name)
		switch {
		case !ok:
			errs = append(errs, &VerifyError{Job: job, ID: id, File: w.Name, Err: ErrMissing})
		case g.Size < w.Size:
			errs = append(errs, &VerifyError{Job: job, ID: id, File: w.Name, Err: ErrTruncated, Detail: fmt.Sprintf("%d bytes, manifest says %d", g.Size, w.Size)})
		case g.Size > w.Size:
			errs = append(errs, &VerifyError{Job: job, ID: id, File: w.Name, Err: ErrCorrupt, Detail: fmt.Sprintf("%d bytes, manifest says %d", g.Size, w.Size)})
		case g.SHA256 != w.SHA256:
			errs = append(errs, &VerifyError{Job: job, ID: id, File: w.Name, Err: ErrCorrupt, Detail: "sha256 differs from the manifest"})
		}
	}
	extra := make([]string, 0, len(gotBy))
	for n := range gotBy {
		extra = append(extra, n)
	}
	slices.Sort(extra)
	for _, n := range extra {
		errs = append(errs, &VerifyError{Job: job, ID: id, File: n, Err: ErrExtra})
	}
	return errors.Join(errs...)
}

func (p *Pending) commit(ctx context.Context, build func([]FileEntry) (*Manifest, error)) (m *Manifest, err error) {
	if p.done {
		return nil, fmt.Errorf("commit %s/%s: already committed or aborted", p.job, p.id)
	}
	crashed := false
	defer func() {
		if crashed {
			// A real crash runs no cleanup; the kernel drops the lock.
			p.done = true
			p.lock.Close()
			return
		}
		if err != nil {
			if aerr := p.Abort(); aerr != nil {
				p.s.log.Warn("could not clean up failed snapshot", "dir", p.dir, "err", aerr)
			}
		}
	}()
	crash := func(step string) bool {
		crashed = p.s.crashAt != nil && p.s.crashAt(step)
		return crashed
	}

	files, dirs, err := scanAndSync(ctx, p.dir, p.written)
	if err != nil {
		return nil, fmt.Errorf("commit snapshot %s/%s: %w", p.job, p.id, err)
	}
	if crash("files-synced") {
		return nil, errSimulatedCrash
	}
	m, err = build(files)
	if err != nil {
		return nil, fmt.Errorf("commit snapshot %s/%s: %w", p.job, p.id, err)
	}
	data, err := m.Encode()
	if err != nil {
		return nil, fmt.Errorf("commit snapshot %s/%s: %w", p.job, p.id, err)
	}
	if err := writeFileSync(filepath.Join(p.dir, ManifestName), data); err != nil {
		return nil, fmt.Errorf("commit snapshot %s/%s: write manifest: %w", p.job, p.id, err)
	}
	if crash("manifest-written") {
		return nil, errSimulatedCrash
	}
	// Deepest directories first, so every entry is durable before its parent.
	slices.SortFunc(dirs, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
	for _, d := range dirs {
		if err := atomicfile.SyncDir(filepath.Join(p.dir, filepath.FromSlash(d))); err != nil {
			return nil, fmt.Errorf("commit snapshot %s/%s: %w", p.job, p.id, err)
		}
	}
	if err := atomicfile.SyncDir(p.dir); err != nil {
		return nil, fmt.Errorf("commit snapshot %s/%s: %w", p.job, p.id, err)
	}
	if crash("before-rename") {
		return nil, errSimulatedCrash
	}
	final := p.s.Path(p.job, p.id)
	// rename(2) would silently replace an empty directory, so check first.
	if _, err := os.Lstat(final); err == nil {
		if !p.replace {
			return nil, fmt.Errorf("commit snapshot %s/%s: %w", p.job, p.id, ErrExists)
		}
		return p.commitReplace(m, final, crash)
	}
	if err := os.Rename(p.dir, final); err != nil {
		return nil, fmt.Errorf("commit snapshot %s/%s: rename into place: %w", p.job, p.id, err)
	}
	p.done = true
	p.lock.Close()
	if crash("after-rename") {
		return nil, errSimulatedCrash
	}
	if err := atomicfile.SyncDir(filepath.Dir(final)); err != nil {
		// The snapshot is complete and visible; only its durability is in doubt.
		return m, fmt.Errorf("commit snapshot %s/%s: %w (the snapshot is in place but may not survive a power loss)", p.job, p.id, err)
	}
	p.s.log.Info("snapshot committed", "job", p.job, "id", p.id, "files", len(m.Files), "bytes", m.TotalSize())
	return m, nil
}

// commitReplace swaps the complete, synced temp directory with the committed
// copy at final, then removes the old copy. Crash analysis (Open removes
// unlocked .tmp-* and all .del-* directories):
//   - before the exchange, final is the old copy and .tmp-<id> the new one;
//   - after it, final is the new copy and .tmp-<id> the old one;
//   - then the old copy is renamed to .del-<id>.<n> and removed.
//
// At no step is final missing or incomplete, and whatever a restart collects
// is never what final holds.
func (p *Pending) commitReplace(m *Manifest, final string, crash func(string) bool) (*Manifest, error) {
	// Wait for a writer of the old copy (AddReplica) to finish; holding its
	// lock also keeps a new pending of the same id from reusing .tmp-<id>
	// while the old copy is there.
	old, err := lockDir(final, true)
	if err != nil {
		return nil, fmt.Errorf("commit snapshot %s/%s: lock the copy it replaces: %w", p.job, p.id, err)
	}
	defer old.Close()
	if err := exchange(p.dir, final); err != nil {
		return nil, fmt.Errorf("commit snapshot %s/%s: swap with the copy it replaces: %w", p.job, p.id, err)
	}
	p.done = true
	p.lock.Close()
	if crash("after-exchange") {
		return nil, errSimulatedCrash
	}
	jobDir := filepath.Dir(final)
	// The swap must be durable before the old copy goes.
	if err := atomicfile.SyncDir(jobDir); err != nil {
		return m, fmt.Errorf("commit snapshot %s/%s: %w (the new copy is in place; the old one is left in %s for the next start to remove)", p.job, p.id, err, p.dir)
	}
	if crash("exchange-synced") {
		return nil, errSimulatedCrash
	}
	hidden := filepath.Join(jobDir, uniqueDelName(p.id))
	if err := os.Rename(p.dir, hidden); err != nil {
		// The new copy is committed; the old one is hidden and unlocked
		// once we return, so the next Open collects it.
		p.s.log.Warn("could not move replaced snapshot copy out of the way; the next start removes it", "dir", p.dir, "err", err)
		return m, nil
	}
	old.Close()
	if crash("old-hidden") {
		return nil, errSimulatedCrash
	}
	if err := os.RemoveAll(hidden); err != nil {
		p.s.log.Warn("could not remove replaced snapshot copy; the next start removes it", "dir", hidden, "err", err)
	}
	p.s.log.Info("snapshot committed, replacing the previous copy", "job", p.job, "id", p.id, "files", len(m.Files), "bytes", m.TotalSize())
	return m, nil
}

// scanAndSync hashes, restricts to root and fsyncs every regular file under
// root and returns the sorted file list plus every subdirectory (relative,
// '/'-separated). A file in written (by relative name) of the size on disk
// is not read: its entry is taken from there.
func scanAndSync(ctx context.Context, root string, written map[string]FileEntry) ([]FileEntry, []string, error) {
	var files []FileEntry
	var dirs []string
	buf := make([]byte, 1<<20)
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if path == root {
			return nil
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if err := ValidFileName(rel); err != nil {
			return fmt.Errorf("cannot store %s: %w", path, err)
		}
		switch {
		case d.IsDir():
			// Whatever mode the dumper or sender used, the store is root's.
			if err := os.Chmod(path, dirPerm); err != nil {
				return err
			}
			dirs = append(dirs, rel)
			return nil
		case d.Type().IsRegular():
		default:
			return fmt.Errorf("cannot store %s: only regular files and directories are allowed, not %s", path, d.Type())
		}
		if w, ok := written[rel]; ok {
			size, err := syncFile(path)
			if err != nil {
				return err
			}
			if size != w.Size {
				// Changed since it was written: hash what is there, and let the manifest check decide.
				size, sum, err := hashFile(ctx, path, buf, true)
				if err != nil {
					return err
				}
				w = FileEntry{Name: rel, Size: size, SHA256: sum}
			}
			files = append(files, w)
			return nil
		}
		size, sum, err := hashFile(ctx, path, buf, true)
		if err != nil {
			return err
		}
		files = append(files, FileEntry{Name: rel, Size: size, SHA256: sum})
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	if len(files) > MaxFiles {
		return nil, nil, fmt.Errorf("%d files, more than the %d a snapshot may hold", len(files), MaxFiles)
	}
	slices.SortFunc(files, func(a, b FileEntry) int { return strings.Compare(a.Name, b.Name) })
	return files, dirs, nil
}

// hashFile returns the size and hex sha256 of path; when committing (fsync)
// it also gives the file filePerm and fsyncs it.
func hashFile(ctx context.Context, path string, buf []byte, fsync bool) (int64, string, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, "", err
	}
	defer f.Close()
	if fsync {
		// The disk writes the file while it is hashed, so that the fsync below finds little left to do:
		// 100 MiB written back took 45 ms here, as long as hashing them.
		StartWriteback(f)
	}
	h := sha256.New()
	var n int64
	for {
		if err := ctx.Err(); err != nil {
			return 0, "", err
		}
		k, err := f.Read(buf)
		h.Write(buf[:k])
		n += int64(k)
		if err == io.EOF {
			break
		}
		if err != nil {
			return 0, "", fmt.Errorf("read %s: %w", path, err)
		}
	}
	if fsync {
		// Committing: the file gets the store's mode, made durable with it.
		if err := f.Chmod(filePerm); err != nil {
			return 0, "", fmt.Errorf("restrict %s to root: %w", path, err)
		}
		if err := f.Sync(); err != nil {
			return 0, "", fmt.Errorf("fsync %s: %w", path, err)
		}
	}
	return n, hex.EncodeToString(h.Sum(nil)), nil
}

// syncFile gives path filePerm and fsyncs it, and returns its size.
func syncFile(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	if err := f.Chmod(filePerm); err != nil {
		return 0, fmt.Errorf("restrict %s to root: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return 0, fmt.Errorf("fsync %s: %w", path, err)
	}
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	return fi.Size(), nil
}
