package fence

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// Command is a site's fence command: argv with {host} and {address} substituted, run with a timeout.
// Exit status 0 means the host is off (powered down or isolated by the command); anything else means it
// may still run.
type Command struct {
	Argv    []string
	Timeout time.Duration
}

// maxOutput bounds what of the command's output is kept for the log and the failure's timeline.
const maxOutput = 512

// Result is one run of the fence command.
type Result struct {
	Off    bool          // the command confirmed the host is off
	Took   time.Duration // how long the command ran
	Output string        // the command's combined output, cut to maxOutput bytes
	Err    error         // why Off is false: non-zero exit, timeout, or the command could not start
}

// Detail is the result as one line for the failure's timeline.
func (r Result) Detail() string {
	out := strings.Join(strings.Fields(r.Output), " ")
	if out != "" {
		out = ": " + out
	}
	if r.Off {
		return fmt.Sprintf("fence command confirmed the host is off in %s%s", r.Took.Round(time.Millisecond), out)
	}
	return fmt.Sprintf("fence command failed (%v)%s", r.Err, out)
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
	if len(c.Argv) == 0 {
		return Result{Err: ErrNoCommand}
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	argv := Expand(c.Argv, host, address)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	var out boundedBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	// A child that keeps the output pipe open must not hold Run past the timeout.
	cmd.WaitDelay = time.Second
	err := cmd.Run()
	r := Result{Took: time.Since(start), Output: out.String()}
	switch {
	case err == nil:
		r.Off = true
	case ctx.Err() != nil && errors.Is(ctx.Err(), context.DeadlineExceeded):
		r.Err = fmt.Errorf("timed out after %s: %w", c.Timeout, ctx.Err())
	default:
		r.Err = err
	}
	return r
}

// boundedBuffer keeps the first maxOutput bytes written to it and discards the rest.
type boundedBuffer struct{ b bytes.Buffer }

func (w *boundedBuffer) Write(p []byte) (int, error) {
	if room := maxOutput - w.b.Len(); room > 0 {
		w.b.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func (w *boundedBuffer) String() string { return w.b.String() }
