// Package cli holds the conventions shared by ftctl, ftwrap and ftagent: exit codes, logging flags,
// JSON output and error reporting.
package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/spf13/cobra"
)

// Exit codes. ftwrap passes its program's own status through instead.
const (
	ExitOK          = 0 // success
	ExitFailure     = 1 // the operation failed; the message says why
	ExitUsage       = 2 // bad command line
	ExitNotFound    = 3 // no such lab, host, job or snapshot
	ExitUnavailable = 4 // a precondition is missing: not root, CRIU too old, agent not running, lab exists
)

// ExitError carries an exit code with an error.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string { return e.Err.Error() }
func (e *ExitError) Unwrap() error { return e.Err }

// WithCode attaches an exit code to err (nil stays nil).
func WithCode(code int, err error) error {
	if err == nil {
		return nil
	}
	return &ExitError{Code: code, Err: err}
}

// Usagef is a command-line error (exit 2).
func Usagef(format string, args ...any) error {
	return &ExitError{Code: ExitUsage, Err: fmt.Errorf(format, args...)}
}

// Args wraps a cobra positional-argument check so that its failures are usage errors.
func Args(check cobra.PositionalArgs) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if err := check(cmd, args); err != nil {
			return &ExitError{Code: ExitUsage, Err: err}
		}
		return nil
	}
}

// LogFlags are the logging flags every binary takes.
type LogFlags struct {
	Level  string
	Format string
}

// Register adds --log-level and --log-format to cmd's persistent flags. Their values are checked as the
// command line is parsed, so a bad one is a usage error even for a command that logs nothing.
func (f *LogFlags) Register(cmd *cobra.Command) {
	f.Level, f.Format = "info", "text"
	cmd.PersistentFlags().Var(choice{&f.Level, []string{"debug", "info", "warn", "error"}}, "log-level", "log level: debug, info, warn or error")
	cmd.PersistentFlags().Var(choice{&f.Format, []string{"text", "json"}}, "log-format", "log format on stderr: text or json")
}

// choice is a string flag that takes one of a fixed set of values.
type choice struct {
	v    *string
	from []string
}

func (c choice) String() string {
	if c.v == nil {
		return ""
	}
	return *c.v
}

func (c choice) Set(s string) error {
	for _, ok := range c.from {
		if strings.EqualFold(s, ok) {
			*c.v = ok
			return nil
		}
	}
	return fmt.Errorf("%q: use %s", s, strings.Join(c.from, ", "))
}

func (c choice) Type() string { return "string" }

// Logger builds the slog logger the flags describe, writing to w.
func (f *LogFlags) Logger(w io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(f.Level)); err != nil {
		return nil, Usagef("--log-level %q: use debug, info, warn or error", f.Level)
	}
	opts := &slog.HandlerOptions{Level: level}
	switch f.Format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	default:
		return nil, Usagef("--log-format %q: use text or json", f.Format)
	}
}

// PrintJSON writes v as indented JSON.
func PrintJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// Main runs the root command and turns its error into a message on stderr and an exit code.
func Main(root *cobra.Command) int {
	root.SilenceUsage = true
	root.SilenceErrors = true
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error {
		return &ExitError{Code: ExitUsage, Err: fmt.Errorf("%w (see `%s --help`)", err, cmd.CommandPath())}
	})
	err := root.Execute()
	if err == nil {
		return ExitOK
	}
	code := ExitFailure
	var ee *ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.Code
	case strings.HasPrefix(err.Error(), "unknown command"):
		code = ExitUsage
	}
	fmt.Fprintf(os.Stderr, "%s: error: %v\n", root.Name(), err)
	return code
}
