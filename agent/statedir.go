package agent

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/rootpath"
	"github.com/ftkit/ftkit/internal/statedir"
)

// prepareDirs creates the agent's directories with the modes their contents need, whatever the umask
// (the systemd unit sets UMask=0077), and restricts what an older version left world-readable
// (statedir.Prepare):
//   - state_dir and the job records directory (<state_dir>/jobs) hold memory images, job records,
//     recovery records and views: 0700, or 0711 when jobs_dir or the socket lies below them (the default
//     jobs_dir is <state_dir>/jobs, the records directory itself);
//   - jobs_dir and the socket's directory are public: users must reach their job's output and the socket;
//   - log.spill_dir, if the log may spill, holds the jobs' traffic: 0700 (the log spills into it only if
//     it is a directory of root's that no one else may write to, never through a link);
//   - the agent's own files directly in the private ones (records, shim logs, views, failures) become
//     0600, and its subdirectories of state_dir (recoveries, restore, snapshots) 0700.
//
// The snapshot store restricts its own tree when it opens.
func prepareDirs(cfg Config, recordsDir string) error {
	// What --check-config checks first (rootpath.SafeDir): root creates, chmods and writes these by path,
	// so a user able to swap one, or a directory on its way, would have it do so wherever a link points.
	type dir struct {
		key, path string
		shared    bool // jobs_dir may be sticky and writable by others
	}
	dirs := []dir{{"state_dir", cfg.StateDir, false}, {"jobs_dir", cfg.JobsDir, true}, {"socket directory", filepath.Dir(cfg.Socket), false}}
	private := []string{cfg.StateDir, recordsDir}
	if cfg.Log.Enabled && cfg.Log.SpillDir != "" {
		private = append(private, cfg.Log.SpillDir)
		dirs = append(dirs, dir{"log.spill_dir", cfg.Log.SpillDir, false})
	}
	for _, d := range dirs {
		if err := rootpath.SafeDir(d.path, d.shared); err != nil {
			return fmt.Errorf("%s %s is not safe for root (ftagent --check-config): %w", d.key, d.path, err)
		}
	}
	return statedir.Prepare(private, []string{cfg.JobsDir, filepath.Dir(cfg.Socket)})
}

// stateLockFile, in state_dir, is locked (flock) by the agent that uses the directory, for as long as it runs.
const stateLockFile = "agent.lock"

// lockStateDir takes state directory dir for this agent, or says which agent holds it. A second agent on it
// (started by hand beside the service's) adopted the first's jobs, deleted their job networks and guards, put
// back its route edits and resumed its recoveries before its local API found the socket taken. The lock
// goes with the process (and with the returned file); the file, root's, names the holder's pid.
func lockStateDir(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, stateLockFile), os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("lock state_dir %s: %w", dir, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		holder, _ := io.ReadAll(io.LimitReader(f, 32))
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("another ftagent (pid %s) runs with state_dir %s: stop it first", strings.TrimSpace(string(holder)), dir)
		}
		return nil, fmt.Errorf("lock state_dir %s: %w", dir, err)
	}
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0) // for the message above; the lock is what counts
	}
	return f, nil
}
