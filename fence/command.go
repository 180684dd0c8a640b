package fence

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Command is a site's fence command: argv with {host} and {address} substituted, run with a timeout.
// Exit status 0 means the host is off (powered down or isolated by the command, and confirmed); anything
// else means it may still run.
//
// The agent runs it as root, so Run trusts only a program that root alone can change (CheckProgram), runs
// it directly (no shell: a host name is never parsed as shell syntax) with a clean environment (PATH
// only: the daemon's secrets and settings are not the command's business), standard input from
// /dev/null, the root directory as its working directory, and its own process group, which the timeout
// kills whole (an ipmitool left behind by a shell script must not outlive it).
type Command struct {
	Argv    []string
	Timeout time.Duration
}

// maxOutput bounds what of the command's output is kept for the log: its last bytes, where a failing
// command says why.
const maxOutput = 4 << 10

// maxDetailOutput bounds what of the output goes into the failure's timeline, whose stage details every
// member keeps (the agent clips a detail to 1 KiB).
const maxDetailOutput = 512

// defaultPath is the command's PATH when the agent has none (a unit file may clear it).
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// waitDelay is how long Run waits, after the command exited or was killed, for whatever it left holding
// its output open.
const waitDelay = time.Second

// Result is one run of the fence command.
type Result struct {
	Off    bool          // the command confirmed the host is off
	Took   time.Duration // how long the command ran
	Output string        // the last maxOutput bytes of the command's combined output
	Err    error         // why Off is false: non-zero exit, timeout, an untrusted program, or it could not start
}

// Detail is the result as one line for the failure's timeline: the outcome and the end of the output.
func (r Result) Detail() string {
	out := strings.Join(strings.Fields(r.Output), " ")
	if len(out) > maxDetailOutput {
		out = "..." + out[len(out)-maxDetailOutput:]
	}
	if out != "" {
		out = ": " + out
	}
	if r.Off {
		return fmt.Sprintf("fence command confirmed the host is off in %s%s", r.Took.Round(time.Millisecond), out)
	}
	return fmt.Sprintf("fence command failed (%v) after %s%s", r.Err, r.Took.Round(time.Millisecond), out)
}

// CheckArgv validates a configured argv: a command given by absolute path (a root daemon must not depend
// on its PATH), with only the known placeholders.
func CheckArgv(argv []string) error {
	if len(argv) == 0 {
		return nil
	}
	if !filepath.IsAbs(argv[0]) {
		return fmt.Errorf("fence_command %q: give the program by absolute path", argv[0])
	}
	for _, a := range argv {
		rest := strings.NewReplacer("{host}", "", "{address}", "").Replace(a)
		if strings.ContainsAny(rest, "{}") {
			return fmt.Errorf("fence_command argument %q: the only placeholders are {host} and {address}", a)
		}
	}
	return nil
}

// CheckProgram checks that root alone can change what path runs: the program (after symbolic links) is a
// regular executable file owned by root and writable by nobody else, and so is every directory on the way
// to it and to the link, unless the directory is sticky and root's (like /tmp: others cannot replace
// root's entries there). Otherwise any user who can write one of them could run code as root at the next
// failure. The caller's own user counts as root (an agent run by another user, in tests, runs the
// command as that user).
func CheckProgram(path string) error {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return fmt.Errorf("fence command %s: %w", path, err)
	}
	fi, err := os.Stat(real)
	if err != nil {
		return fmt.Errorf("fence command %s: %w", path, err)
	}
	switch {
	case !fi.Mode().IsRegular():
		return fmt.Errorf("fence command %s is not a regular file (mode %v)", real, fi.Mode())
	case fi.Mode().Perm()&0o111 == 0:
		return fmt.Errorf("fence command %s is not executable: chmod 755 it", real)
	}
	if err := rootOnly(real, fi); err != nil {
		return fmt.Errorf("fence command %s: %w", path, err)
	}
	seen := map[string]bool{}
	for _, p := range []string{filepath.Dir(filepath.Clean(path)), filepath.Dir(real)} {
		for d := p; !seen[d]; d = filepath.Dir(d) {
			seen[d] = true
			di, err := os.Stat(d)
			if err != nil {
				return fmt.Errorf("fence command %s: %w", path, err)
			}
			if di.Mode()&fs.ModeSticky == 0 || !trusted(ownerUID(di)) {
				if err := rootOnly(d, di); err != nil {
					return fmt.Errorf("fence command %s: %w", path, err)
				}
			}
		}
	}
	return nil
}

// rootOnly checks that fi (of path) is root's and writable by root alone.
func rootOnly(path string, fi fs.FileInfo) error {
	if uid := ownerUID(fi); !trusted(uid) {
		return fmt.Errorf("%s is owned by uid %d, who could change what runs as root: chown root:root it", path, uid)
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("%s has mode %04o, so others could change what runs as root: chmod go-w it", path, fi.Mode().Perm())
	}
	return nil
}

// trusted reports whether files of uid may decide what this process runs: root's and its own.
func trusted(uid uint32) bool { return uid == 0 || int64(uid) == int64(os.Geteuid()) }

func ownerUID(fi fs.FileInfo) uint32 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Uid
	}
	return ^uint32(0)
}

// Expand substitutes host and address into argv. Each argument stays one argument: no shell runs.
func Expand(argv []string, host, address string) []string {
	r := strings.NewReplacer("{host}", host, "{address}", address)
	out := make([]string, len(argv))
	for i, a := range argv {
		out[i] = r.Replace(a)
	}
	return out
}

// Run runs the command for host at address and reports whether it confirmed the host is off.
func (c Command) Run(ctx context.Context, host, address string) Result {
	if len(c.Argv) == 0 {
		return Result{Err: ErrNoCommand}
	}
	start := time.Now()
	if err := CheckProgram(c.Argv[0]); err != nil {
		return Result{Err: fmt.Errorf("not run: %w", err)}
	}
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	argv := Expand(c.Argv, host, address)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = []string{"PATH=" + orDefault(os.Getenv("PATH"), defaultPath)}
	cmd.Dir = "/"
	var out tailBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// On timeout the whole group goes: the leader is not reaped yet, so its pid (the group's id) cannot
	// have been reused.
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	// A child that keeps the output pipe open must not hold Run past the timeout.
	cmd.WaitDelay = waitDelay
	err := cmd.Run()
	r := Result{Took: time.Since(start), Output: out.String()}
	switch {
	case err == nil:
		r.Off = true
	case ctx.Err() != nil && errors.Is(ctx.Err(), context.DeadlineExceeded):
		r.Err = fmt.Errorf("timed out after %s (fence_command_timeout): %w", c.Timeout, ctx.Err())
	default:
		r.Err = err
	}
	return r
}

// orDefault returns s, or def when s is empty.
func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// tailBuffer keeps the last maxOutput bytes written to it.
type tailBuffer struct{ b []byte }

func (w *tailBuffer) Write(p []byte) (int, error) {
	n := len(p)
	if len(p) > maxOutput {
		p = p[len(p)-maxOutput:]
	}
	if over := len(w.b) + len(p) - maxOutput; over > 0 {
		w.b = append(w.b[:0], w.b[over:]...)
	}
	w.b = append(w.b, p...)
	return n, nil
}

func (w *tailBuffer) String() string { return string(w.b) }
