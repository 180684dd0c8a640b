package ckpt

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"strings"
)

// Kinds of verification failure, for errors.Is.
var (
	ErrCorrupt   = errors.New("corrupt")
	ErrTruncated = errors.New("truncated")
	ErrMissing   = errors.New("missing")
	ErrExtra     = errors.New("extra file not in the manifest")
)

// VerifyError names the snapshot and the file that failed verification.
type VerifyError struct {
	Job, ID string
	File    string // relative to the snapshot directory
	Err     error  // ErrCorrupt, ErrTruncated, ErrMissing, ErrExtra, or a manifest decode error
	Detail  string
}

func (e *VerifyError) Error() string {
	s := fmt.Sprintf("snapshot %s/%s: file %s: %v", e.Job, e.ID, e.File, e.Err)
	if e.Detail != "" {
		s += " (" + e.Detail + ")"
	}
	return s
}

func (e *VerifyError) Unwrap() error { return e.Err }

// Verify recomputes the size and sha256 of every file of a committed
// snapshot and checks that no file is missing or extra. All problems found
// are returned joined; each is a *VerifyError naming its file.
func (s *Store) Verify(ctx context.Context, job, id string) (*Manifest, error) {
	m, err := s.Manifest(job, id)
	if err != nil {
		return nil, err
	}
	dir := s.Path(job, id)
	var onDisk []FileEntry
	var errs []error
	buf := make([]byte, 1<<20)
	wantDirs := make(map[string]bool)
	for _, f := range m.Files {
		for d := filepath.Dir(filepath.FromSlash(f.Name)); d != "."; d = filepath.Dir(d) {
			wantDirs[filepath.ToSlash(d)] = true
		}
	}
	err = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if path == dir {
			return nil
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if rel == ManifestName || rel == manifestTmp {
			return nil
		}
		if d.IsDir() {
			if !wantDirs[rel] {
				errs = append(errs, &VerifyError{Job: job, ID: id, File: rel, Err: ErrExtra, Detail: "directory"})
				return fs.SkipDir
			}
			return nil
		}
		want, known := m.File(rel)
		if !known {
			errs = append(errs, &VerifyError{Job: job, ID: id, File: rel, Err: ErrExtra})
			return nil
		}
		if !d.Type().IsRegular() {
			errs = append(errs, &VerifyError{Job: job, ID: id, File: rel, Err: ErrCorrupt, Detail: "not a regular file"})
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		// Only hash files whose size is right; a size mismatch says enough.
		if info.Size() != want.Size {
			onDisk = append(onDisk, FileEntry{Name: rel, Size: info.Size()})
			return nil
		}
		size, sum, err := hashFile(ctx, path, buf, false)
		if err != nil {
			return err
		}
		onDisk = append(onDisk, FileEntry{Name: rel, Size: size, SHA256: sum})
		return nil
	})
	if ctx.Err() != nil {
		return nil, fmt.Errorf("verify snapshot %s/%s: %w", job, id, ctx.Err())
	}
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("verify snapshot %s/%s: %w", job, id, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("verify snapshot %s/%s: %w", job, id, err)
	}
	// Extras were reported during the walk; compare only the listed files.
	slices.SortFunc(onDisk, func(a, b FileEntry) int { return strings.Compare(a.Name, b.Name) })
	if cerr := compareFiles(job, id, m.Files, onDisk); cerr != nil {
		errs = append([]error{cerr}, errs...)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return m, nil
}
