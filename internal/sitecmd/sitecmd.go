// Package sitecmd runs a site's command for the root daemon: a program the site installs (a fence
// command that powers a host off, a health check that predicts a failure) run with a timeout.
//
// The agent runs it as root, so Run trusts only a program that root alone can change (CheckProgram), runs
// it directly (no shell: an argument is never parsed as shell syntax) with a clean environment (PATH only,
// and only its directories that root alone can change: the daemon's secrets and settings are not the
// command's business, and a script finds its tools through PATH), standard input from /dev/null, the
// root directory as its working directory, and its own process group, which the timeout kills whole, and
// so does the command's exit (an ipmitool left behind by a shell script must not outlive it).
package sitecmd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/rootpath"
)

// Command is a site's command: argv as it runs, a timeout, and its name for messages ("fence command").
type Command struct {
	Name    string
	Argv    []string
	Timeout time.Duration
	// KeepStderr also keeps the start of the command's standard error apart (Result.Stderr), where a
	// command whose refusal is shown to a user says why. Its standard output and error then reach the
	// combined Output through two pipes, interleaved as they are read rather than exactly as written.
	KeepStderr bool
}

// MaxOutput bounds what of the command's output is kept: its last bytes, where a failing command says why.
const MaxOutput = 4 << 10

// DefaultPath is the command's PATH when the agent has none (a unit file may clear it), or none of root's.
const DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// waitDelay is how long Run waits, after the command exited or was killed, for whatever it left holding
// its output open.
const waitDelay = time.Second

// ErrNoCommand means no command is configured.
var ErrNoCommand = errors.New("no command configured")

// Result is one run of a command.
type Result struct {
	Exit   int           // its exit status; -1 if it did not exit on its own (not run, killed, timed out)
	Took   time.Duration // how long it ran
	Output string        // the last MaxOutput bytes of its combined output
	Stderr string        // with KeepStderr, the first MaxOutput bytes of its standard error
	Err    error         // nil for exit status 0; else why: non-zero exit, timeout, an untrusted program, not started
}

// Run runs the command.
func (c Command) Run(ctx context.Context) Result {
	if len(c.Argv) == 0 {
		return Result{Exit: -1, Err: ErrNoCommand}
	}
	start := time.Now()
	// CheckProgram resolves a relative path from the working directory, but exec looks a bare name up in
	// the agent's PATH and runs a relative path from cmd.Dir: what ran would not be what was checked.
	if !filepath.IsAbs(c.Argv[0]) {
		return Result{Exit: -1, Err: fmt.Errorf("not run: %s %q: give the program by absolute path", c.Name, c.Argv[0])}
	}
	if err := CheckProgram(c.Name, c.Argv[0]); err != nil {
		return Result{Exit: -1, Err: fmt.Errorf("not run: %w", err)}
	}
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.Argv[0], c.Argv[1:]...)
	cmd.Env = []string{"PATH=" + orDefault(rootPath(os.Getenv("PATH")), rootPath(DefaultPath))}
	cmd.Dir = "/"
	var out tailBuffer
	var errOut headBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if c.KeepStderr {
		// Two pipes, each copied by a goroutine of its own: the combined buffer takes them one at a time.
		var mu sync.Mutex
		cmd.Stdout = lockedWriter{&mu, &out}
		cmd.Stderr = lockedWriter{&mu, io.MultiWriter(&out, &errOut)}
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// On timeout the whole group goes: the leader is not reaped yet, so its pid (the group's id) cannot
	// have been reused.
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	// A child that keeps the output pipe open must not hold Run past the timeout.
	cmd.WaitDelay = waitDelay
	err := cmd.Start()
	if err == nil {
		// What the command left behind in its group when it exited (a script's `ipmitool ... &`) goes too:
		// it would run on as root, one more at every run of a health check, and one that holds the output
		// open would turn an exit status of 0 into exec.ErrWaitDelay. The group is killed while its leader
		// is a zombie, not reaped yet, so that its pid (the group's id) is still its own.
		awaitExit(cmd.Process.Pid)
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		err = cmd.Wait()
	}
	r := Result{Exit: -1, Took: time.Since(start), Output: out.String(), Stderr: string(errOut.b), Err: err}
	var exit *exec.ExitError
	switch {
	case ctx.Err() != nil && errors.Is(ctx.Err(), context.DeadlineExceeded):
		r.Err = fmt.Errorf("timed out after %s: %w", c.Timeout, ctx.Err())
	case err == nil:
		r.Exit = 0
	case errors.As(err, &exit) && exit.Exited():
		r.Exit = exit.ExitCode()
	}
	return r
}

// awaitExit returns once process pid (a child of this process) has exited or cannot be waited for, without
// reaping it: cmd.Wait does that, and reads its status.
func awaitExit(pid int) {
	for {
		var info unix.Siginfo
		if err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOWAIT, nil); err != unix.EINTR {
			return
		}
	}
}

// CheckProgram checks that root alone can change what path runs: the program (after symbolic links) is a
// regular executable file owned by root and writable by nobody else, and so is every directory the path
// passes through as the kernel resolves it (a link's anywhere on the way, and its target's), unless the directory is sticky and root's (like /tmp: others cannot replace
// root's entries there). Otherwise any user who can write one of them could run code as root. The caller's
// own user counts as root (an agent run by another user, in tests, runs the command as that user). name
// says which command it is, for the error.
func CheckProgram(name, path string) error {
	real, dirs, err := rootpath.Resolve(path)
	if err != nil {
		return fmt.Errorf("%s %s: %w", name, path, err)
	}
	fi, err := os.Stat(real)
	if err != nil {
		return fmt.Errorf("%s %s: %w", name, path, err)
	}
	switch {
	case !fi.Mode().IsRegular():
		return fmt.Errorf("%s %s is not a regular file (mode %v)", name, real, fi.Mode())
	case fi.Mode().Perm()&0o111 == 0:
		return fmt.Errorf("%s %s is not executable: chmod 755 it", name, real)
	}
	if err := rootpath.RootOnly(real, fi, risk); err != nil {
		return fmt.Errorf("%s %s: %w", name, path, err)
	}
	if err := rootpath.OnTheWay(dirs, risk); err != nil {
		return fmt.Errorf("%s %s: %w", name, path, err)
	}
	return nil
}

// rootPath keeps of PATH list the directories root alone can change, as CheckProgram requires of the
// program's: a script run as root finds its tools (ipmitool) through PATH, and an agent started by hand
// with a user's directory, a relative one or an empty entry (the working directory) in its PATH would have
// run that user's ipmitool as root.
func rootPath(list string) string {
	var kept []string
	for _, d := range filepath.SplitList(list) {
		if filepath.IsAbs(d) && rootDir(d) == nil && !slices.Contains(kept, d) {
			kept = append(kept, d)
		}
	}
	return strings.Join(kept, ":")
}

// rootDir checks that root alone can change what directory d holds: d (after symbolic links) is root's
// and writable by root alone, sticky or not (anyone may add a name to a sticky directory), and so is
// every directory on the way but a sticky one of root's.
func rootDir(d string) error {
	return rootpath.CheckOnlyRoot(d, risk, func(real string, fi fs.FileInfo) error {
		if !fi.IsDir() {
			return fmt.Errorf("%s is not a directory", real)
		}
		return nil
	})
}

// risk is what another user could do with a file root's command depends on, for errors.
const risk = "change what runs as root"

// orDefault returns s, or def when s is empty.
func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// tailBuffer keeps the last MaxOutput bytes written to it.
type tailBuffer struct{ b []byte }

func (w *tailBuffer) Write(p []byte) (int, error) {
	n := len(p)
	if len(p) > MaxOutput {
		p = p[len(p)-MaxOutput:]
	}
	if over := len(w.b) + len(p) - MaxOutput; over > 0 {
		w.b = append(w.b[:0], w.b[over:]...)
	}
	w.b = append(w.b, p...)
	return n, nil
}

func (w *tailBuffer) String() string { return string(w.b) }

// headBuffer keeps the first MaxOutput bytes written to it.
type headBuffer struct{ b []byte }

func (w *headBuffer) Write(p []byte) (int, error) {
	if room := MaxOutput - len(w.b); room > 0 {
		w.b = append(w.b, p[:min(len(p), room)]...)
	}
	return len(p), nil
}

// lockedWriter serializes the writes of two goroutines (a command's two pipes) to one writer.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
