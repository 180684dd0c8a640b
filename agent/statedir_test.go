package agent

import (
	"os"
	"path/filepath"
	"testing"
)

// TestPrepareDirsSpillDir: the agent creates log.spill_dir 0700 as it does state_dir, whatever the umask.
// Before, it created nothing there: a spill_dir that did not exist yet made every spill fail (the log
// stayed paused at its cap, its controller asking for a spill every round), and one made by hand kept
// whatever mode it was given.
func TestPrepareDirsSpillDir(t *testing.T) {
	root := t.TempDir()
	var cfg Config
	cfg.StateDir = filepath.Join(root, "state")
	cfg.JobsDir = filepath.Join(root, "jobs")
	cfg.Socket = filepath.Join(root, "run", "agent.sock")
	cfg.Log.Enabled = true
	cfg.Log.SpillDir = filepath.Join(root, "spill", "log")
	if err := prepareDirs(cfg, filepath.Join(cfg.StateDir, "jobs")); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Lstat(cfg.Log.SpillDir)
	if err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		t.Fatalf("spill_dir after prepareDirs: %v, %v; want a directory of mode 0700", fi, err)
	}
}
