package fence

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/ftkit/ftkit/internal/sitecmd"
)

// Command is a site's fence command: argv with {host} and {address} substituted, run with a timeout
// (package sitecmd: root's program only, no shell, a clean environment, its process group killed on
// timeout). Exit status 0 means the host is off (powered down or isolated by the command, and confirmed);
// anything else means it may still run.
type Command struct {
	Argv    []string
	Timeout time.Duration
}

// maxOutput bounds what of the command's output is kept for the log.
const maxOutput = sitecmd.MaxOutput

// maxDetailOutput bounds what of the output goes into the failure's timeline, whose stage details every
// member keeps (the agent clips a detail to 1 KiB).
const maxDetailOutput = 512

// ErrNoCommand means no fence command is configured.
var ErrNoCommand = sitecmd.ErrNoCommand

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
	r := sitecmd.Command{Name: "fence command", Argv: Expand(c.Argv, host, address), Timeout: c.Timeout}.Run(ctx)
	if errors.Is(r.Err, context.DeadlineExceeded) {
		r.Err = fmt.Errorf("%w (fence_command_timeout)", r.Err)
	}
	return Result{Off: r.Err == nil, Took: r.Took, Output: r.Output, Err: r.Err}
}

// CheckProgram checks that root alone can change the fence command's program (sitecmd.CheckProgram).
func CheckProgram(path string) error { return sitecmd.CheckProgram("fence command", path) }
