package ckpt

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/internal/atomicfile"
)

const (
	tmpPrefix = ".tmp-"
	delPrefix = ".del-"
	// manifestTmp is where AddReplica stages a new manifest before renaming it.
	manifestTmp = ".manifest.json.tmp"
)

// Errors a caller can test with errors.Is.
var (
	ErrNotFound = errors.New("snapshot not found")
	ErrExists   = errors.New("snapshot already exists")
)

// Options configure a Store.
type Options struct {
	// Node is this node's name; it goes into the id of every snapshot begun
	// here and is never listed as a replica of itself. Required.
	Node string
	// Logger receives garbage-collection and retention events; nil discards.
	Logger *slog.Logger
	// Now overrides the clock (tests); nil means time.Now.
	Now func() time.Time
}

// Store keeps snapshots under <root>/<job>/<snapshot-id>/. Several Stores
// (even in different processes) may share a root: temp directories are
// flock'ed by their writer, so garbage collection only removes dead ones.
type Store struct {
	root string
	node string
	log  *slog.Logger
	now  func() time.Time

	mu   sync.Mutex // serialises id allocation and manifest rewrites
	seq  uint64
	last time.Time

	// crashAt, set only by tests, simulates a crash at a named commit step.
	crashAt func(step string) bool
}

// Open opens (creating if needed) the store at root, restricts it to root
// (a store written by an older version had world-readable modes), and
// removes temp and half-deleted directories that no live writer holds.
func Open(root string, opts Options) (*Store, error) {
	if err := ValidName(opts.Node); err != nil {
		return nil, fmt.Errorf("open snapshot store %s: node: %w", root, err)
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("open snapshot store %s: %w", root, err)
	}
	if err := os.MkdirAll(abs, dirPerm); err != nil {
		return nil, fmt.Errorf("open snapshot store: create %s: %w", abs, err)
	}
	if err := os.Chmod(abs, dirPerm); err != nil {
		return nil, fmt.Errorf("open snapshot store: restrict %s to root: %w", abs, err)
	}
	s := &Store{root: abs, node: opts.Node, log: opts.Logger, now: opts.Now}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if s.now == nil {
		s.now = time.Now
	}
	if err := s.collectGarbage(); err != nil {
		return nil, err
	}
	return s, nil
}

// Root is the store's absolute root directory.
func (s *Store) Root() string { return s.root }

// Node is the node name the store was opened with.
func (s *Store) Node() string { return s.node }

// Path is the directory of a committed snapshot (what criu restore -D takes).
func (s *Store) Path(job, id string) string { return filepath.Join(s.root, job, id) }

// collectGarbage removes dead temp and half-deleted directories and gives
// job and snapshot directories left by an older version the store's modes.
func (s *Store) collectGarbage() error {
	jobs, err := os.ReadDir(s.root)
	if err != nil {
		return fmt.Errorf("open snapshot store: list %s: %w", s.root, err)
	}
	for _, j := range jobs {
		if !j.IsDir() || strings.HasPrefix(j.Name(), ".") {
			continue
		}
		jobDir := filepath.Join(s.root, j.Name())
		if _, err := tighten(jobDir, j, dirPerm); err != nil {
			return fmt.Errorf("open snapshot store: %w", err)
		}
		ents, err := os.ReadDir(jobDir)
		if err != nil {
			return fmt.Errorf("open snapshot store: list %s: %w", jobDir, err)
		}
		for _, e := range ents {
			p := filepath.Join(jobDir, e.Name())
			switch {
			case e.IsDir() && !strings.HasPrefix(e.Name(), "."):
				// A snapshot directory. Its files are checked even when it is
				// already dirPerm: the walk tightens a directory before its
				// contents, so an interrupted pass left 0700 over 0644 files.
				changed, err := tightenTree(p)
				if err != nil {
					return fmt.Errorf("open snapshot store: restrict %s to root: %w", p, err)
				}
				if changed {
					s.log.Info("restricted snapshot directory of an older version to root", "dir", p)
				}
			case strings.HasPrefix(e.Name(), tmpPrefix):
				lk, err := lockDir(p, false)
				if err != nil {
					// Held by a live writer (or vanished): leave it.
					continue
				}
				err = os.RemoveAll(p)
				lk.Close()
				if err != nil {
					return fmt.Errorf("open snapshot store: remove stale temp %s: %w", p, err)
				}
				s.log.Info("removed unfinished snapshot", "dir", p)
			case strings.HasPrefix(e.Name(), delPrefix):
				if err := os.RemoveAll(p); err != nil {
					return fmt.Errorf("open snapshot store: finish removing %s: %w", p, err)
				}
				s.log.Info("finished removing snapshot", "dir", p)
			}
		}
	}
	return nil
}

// Jobs lists the jobs that have a directory in the store, sorted.
func (s *Store) Jobs() ([]string, error) {
	ents, err := os.ReadDir(s.root)
	if err != nil {
		return nil, fmt.Errorf("list jobs in %s: %w", s.root, err)
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() && ValidName(e.Name()) == nil {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// List returns the ids of the job's committed snapshots, newest first. A
// non-empty node keeps only snapshots taken on that node (a protector holds
// its own snapshots and its neighbour's under the same job).
func (s *Store) List(job, node string) ([]string, error) {
	if err := ValidName(job); err != nil {
		return nil, fmt.Errorf("list snapshots: job: %w", err)
	}
	dir := filepath.Join(s.root, job)
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list snapshots of %s: %w", job, err)
	}
	var ids []string
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".") || !e.IsDir() {
			continue
		}
		id, err := ParseID(e.Name())
		if err != nil {
			s.log.Warn("ignoring directory that is not a snapshot", "dir", filepath.Join(dir, e.Name()), "err", err)
			continue
		}
		if node == "" || id.Node == node {
			ids = append(ids, e.Name())
		}
	}
	slices.Sort(ids)
	slices.Reverse(ids)
	return ids, nil
}

// Manifest reads and checks the manifest of a committed snapshot without
// hashing its files. A missing or invalid manifest is a *VerifyError.
func (s *Store) Manifest(job, id string) (*Manifest, error) {
	if err := ValidName(job); err != nil {
		return nil, fmt.Errorf("read manifest: job: %w", err)
	}
	if _, err := ParseID(id); err != nil {
		return nil, fmt.Errorf("read manifest: %w", err)
	}
	dir := s.Path(job, id)
	if _, err := os.Stat(dir); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%w: %s/%s", ErrNotFound, job, id)
		}
		return nil, fmt.Errorf("read manifest of %s/%s: %w", job, id, err)
	}
	f, err := os.Open(filepath.Join(dir, ManifestName))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, &VerifyError{Job: job, ID: id, File: ManifestName, Err: ErrMissing}
	}
	if err != nil {
		return nil, fmt.Errorf("read manifest of %s/%s: %w", job, id, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxManifestBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read manifest of %s/%s: %w", job, id, err)
	}
	m, err := DecodeManifest(b)
	if err != nil {
		return nil, &VerifyError{Job: job, ID: id, File: ManifestName, Err: err}
	}
	if m.Job != job || m.ID != id {
		return nil, &VerifyError{Job: job, ID: id, File: ManifestName,
			Err: fmt.Errorf("%w: it describes %s/%s (directory copied or renamed?)", ErrManifestInvalid, m.Job, m.ID)}
	}
	return m, nil
}

// Latest returns the manifest of the newest snapshot of job (taken on node,
// if non-empty) whose manifest reads, without hashing files.
func (s *Store) Latest(job, node string) (*Manifest, error) {
	ids, err := s.List(job, node)
	if err != nil {
		return nil, err
	}
	for _, id := range ids {
		m, err := s.Manifest(job, id)
		if err == nil {
			return m, nil
		}
		s.log.Warn("skipping snapshot with unreadable manifest", "job", job, "id", id, "err", err)
	}
	return nil, fmt.Errorf("%w: no snapshot of job %s with a readable manifest", ErrNotFound, job)
}

// LatestVerified returns the newest snapshot of job (from node, if
// non-empty) that passes Verify, and the verification errors of the newer
// ones it skipped, so a restorer can say why it fell back.
func (s *Store) LatestVerified(ctx context.Context, job, node string) (*Manifest, []error, error) {
	ids, err := s.List(job, node)
	if err != nil {
		return nil, nil, err
	}
	var skipped []error
	for _, id := range ids {
		m, err := s.Verify(ctx, job, id)
		if err == nil {
			return m, skipped, nil
		}
		if ctx.Err() != nil {
			return nil, skipped, fmt.Errorf("find latest verified snapshot of %s: %w", job, ctx.Err())
		}
		skipped = append(skipped, err)
	}
	return nil, skipped, fmt.Errorf("%w: none of the %d snapshots of job %s verifies", ErrNotFound, len(ids), job)
}

// Delete removes a committed snapshot. It first renames the directory to a
// hidden name, so a crash mid-way never leaves a visible partial snapshot.
// The name is unique: a fixed one still held by an unfinished earlier removal
// of the same id failed every delete with "file exists" until Open cleaned it.
func (s *Store) Delete(job, id string) error {
	if err := ValidName(job); err != nil {
		return fmt.Errorf("delete snapshot: job: %w", err)
	}
	if _, err := ParseID(id); err != nil {
		return fmt.Errorf("delete snapshot: %w", err)
	}
	err := removeHidden(s.Path(job, id), uniqueDelName(id))
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("delete %s/%s: %w", job, id, ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("delete snapshot %s/%s: %w", job, id, err)
	}
	return nil
}

// AddReplica records, atomically (write, fsync, rename, fsync dir), that node
// holds a verified copy of the snapshot. Adding a known replica is a no-op.
func (s *Store) AddReplica(job, id, node string) (*Manifest, error) {
	if err := ValidName(node); err != nil {
		return nil, fmt.Errorf("add replica to %s/%s: %w", job, id, err)
	}
	if node == s.node {
		return nil, fmt.Errorf("add replica to %s/%s: %q is this node; a replica must live elsewhere", job, id, node)
	}
	// Checked before the path is opened and waited on: a job of ".." or an
	// id with a '/' named a directory outside the store.
	if err := ValidName(job); err != nil {
		return nil, fmt.Errorf("add replica: job: %w", err)
	}
	if _, err := ParseID(id); err != nil {
		return nil, fmt.Errorf("add replica to %s: %w", job, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	dir := s.Path(job, id)
	// The directory lock also serialises writers in other processes.
	lk, err := lockDir(dir, true)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("add replica to %s/%s: %w", job, id, ErrNotFound)
		}
		return nil, fmt.Errorf("add replica to %s/%s: lock: %w", job, id, err)
	}
	defer lk.Close()
	m, err := s.Manifest(job, id)
	if err != nil {
		return nil, fmt.Errorf("add replica to %s/%s: %w", job, id, err)
	}
	i, found := slices.BinarySearch(m.Replicas, node)
	if found {
		return m, nil
	}
	m.Replicas = slices.Insert(m.Replicas, i, node)
	if err := writeManifest(dir, m); err != nil {
		return nil, fmt.Errorf("add replica to %s/%s: %w", job, id, err)
	}
	return m, nil
}

// writeManifest replaces dir's manifest atomically.
func writeManifest(dir string, m *Manifest) error {
	data, err := m.Encode()
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, manifestTmp)
	if err := writeFileSync(tmp, data); err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, ManifestName)); err != nil {
		return fmt.Errorf("replace manifest in %s: %w", dir, err)
	}
	return atomicfile.SyncDir(dir)
}
