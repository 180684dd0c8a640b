package dump

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/filecopy"
	"github.com/ftkit/ftkit/internal/jobfs"
)

// Outputs is the job directory whose output files travel with a snapshot.
type Outputs struct {
	Dir string // the job's directory
	UID uint32 // the job's user: only regular files it owns are copied
	// Name returns the name inside Dir of path if path is one of the job's outputs. inside reports
	// whether path is in Dir at all: a file there that is not an output (name "") cannot be recreated by
	// a restore, and the snapshot is refused. A path outside Dir is not copied.
	Name func(path string) (name string, inside bool)
	// Own names the job's outputs, for that refusal ("stdout and stderr").
	Own string
}

// copyOutputs copies the first Size bytes of each of the job's outputs in its directory. The job appends
// only, so those bytes no longer change while it keeps running. Root reads them through no link and only
// from the job's own regular files: a job directory an older agent handed to the user may hold anything.
func copyOutputs(job string, o Outputs, files []ckpt.OpenFile, dst string) error {
	var dir *jobfs.Dir
	defer func() {
		if dir != nil {
			dir.Close()
		}
	}()
	copied := map[string]bool{}
	for _, f := range files {
		if o.Name == nil {
			break // no job directory: nothing of the job's own to copy
		}
		name, inside := o.Name(f.Path)
		if !inside {
			continue // not the job's own output: it must exist on the restoring host
		}
		if name == "" {
			return fmt.Errorf("job %s has %s open for writing inside its job directory, where only %s are its own; no restore could recreate it",
				job, f.Path, o.Own)
		}
		if copied[name] { // opened more than once
			continue
		}
		copied[name] = true
		if dir == nil {
			var err error
			if dir, err = jobfs.OpenDir(o.Dir); err != nil {
				return fmt.Errorf("copy job outputs: %w", err)
			}
			if err := os.MkdirAll(dst, 0o700); err != nil {
				return err
			}
		}
		in, err := dir.OpenOwned(name, os.O_RDONLY, o.UID)
		if err != nil {
			return fmt.Errorf("copy job output: %w", err)
		}
		err = filecopy.PrefixToNew(filepath.Join(dst, name), in, f.Size)
		in.Close()
		if err != nil {
			return fmt.Errorf("copy job output %s: %w", f.Path, err)
		}
	}
	return nil
}
