package agent

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
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

// TestPrepareDirsRefusesUnsafePath: the agent refuses at start what --check-config refuses (a directory, or
// one on its way, that a user owns or may write to), before it creates or chmods anything there. Before,
// it checked nothing: a state_dir in a user's directory, or not yet made in /tmp, let that user swap what
// root then created, chmod-ed and wrote for a link to anywhere.
func TestPrepareDirsRefusesUnsafePath(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (chown to a user)")
	}
	tests := []struct {
		name  string
		setup func(t *testing.T, root string, cfg *Config) (mustNotExist string)
		want  string
	}{
		{"state_dir in a user's directory", func(t *testing.T, root string, cfg *Config) string {
			home := filepath.Join(root, "home")
			if err := os.Mkdir(home, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(home, 1000, 1000); err != nil {
				t.Fatal(err)
			}
			cfg.StateDir = filepath.Join(home, "state")
			return cfg.StateDir
		}, "uid 1000"},
		{"state_dir not yet made in a sticky world-writable directory", func(t *testing.T, root string, cfg *Config) string {
			tmp := filepath.Join(root, "tmp")
			if err := os.Mkdir(tmp, 0o777); err != nil {
				t.Fatal(err)
			}
			os.Chmod(tmp, 0o777|os.ModeSticky)
			cfg.StateDir = filepath.Join(tmp, "ftkit")
			return cfg.StateDir
		}, "create it first"},
		{"jobs_dir a link to a user's directory", func(t *testing.T, root string, cfg *Config) string {
			shared := filepath.Join(root, "shared")
			if err := os.Mkdir(shared, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(shared, 1000, 1000); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(shared, cfg.JobsDir); err != nil {
				t.Fatal(err)
			}
			return ""
		}, "not a directory"},
		{"socket in a directory others may write to", func(t *testing.T, root string, cfg *Config) string {
			run := filepath.Join(root, "run")
			if err := os.Mkdir(run, 0o777); err != nil {
				t.Fatal(err)
			}
			os.Chmod(run, 0o777)
			cfg.Socket = filepath.Join(run, "ftkit", "agent.sock")
			return filepath.Dir(cfg.Socket)
		}, "not sticky"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			var cfg Config
			cfg.StateDir = filepath.Join(root, "state")
			cfg.JobsDir = filepath.Join(root, "jobs")
			cfg.Socket = filepath.Join(root, "sock", "agent.sock")
			mustNotExist := tc.setup(t, root, &cfg)
			err := prepareDirs(cfg, filepath.Join(cfg.StateDir, "jobs"))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("prepareDirs = %v, want an error saying %q", err, tc.want)
			}
			if mustNotExist != "" {
				if _, err := os.Lstat(mustNotExist); err == nil {
					t.Errorf("%s was created in a directory a user controls", mustNotExist)
				}
			}
		})
	}
}

// TestStateDirTakenOnce: a second agent on a state_dir (one started by hand beside the service's) is
// refused before it touches anything, with the first's pid; once the first is gone, another may start.
// Before, it adopted the first's jobs, deleted their networks and resumed its recoveries, and stopped only
// when its local API found the socket taken.
func TestStateDirTakenOnce(t *testing.T) {
	dir := t.TempDir()
	first, err := lockStateDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if second, err := lockStateDir(dir); err == nil || !strings.Contains(err.Error(), "pid "+strconv.Itoa(os.Getpid())) {
		if second != nil {
			second.Close()
		}
		t.Fatalf("a second agent on a state_dir held by pid %d: %v; want it refused, naming that pid", os.Getpid(), err)
	}
	if fi, err := os.Stat(filepath.Join(dir, stateLockFile)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("lock file: %v, %v; want 0600", fi, err)
	}
	first.Close()
	again, err := lockStateDir(dir)
	if err != nil {
		t.Fatalf("state_dir held by an agent that ended: %v", err)
	}
	again.Close()
}
