package cli

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
)

// --log-level and --log-format take only their documented values, as the command line is parsed: a bad
// one is a usage error (exit 2) even for a command that never logs.
func TestLogFlagsValidated(t *testing.T) {
	for _, tt := range []struct {
		args          []string
		code          int
		level, format string
	}{
		{nil, ExitOK, "info", "text"},
		{[]string{"--log-level", "debug"}, ExitOK, "debug", "text"},
		{[]string{"--log-level", "WARN", "--log-format", "json"}, ExitOK, "warn", "json"},
		{[]string{"--log-level", "loud"}, ExitUsage, "", ""},
		{[]string{"--log-level", ""}, ExitUsage, "", ""},
		{[]string{"--log-format", "xml"}, ExitUsage, "", ""},
	} {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			var f LogFlags
			ran := false
			root := &cobra.Command{Use: "x", RunE: func(*cobra.Command, []string) error { ran = true; return nil }}
			f.Register(root)
			root.SetArgs(tt.args)
			root.SetErr(&bytes.Buffer{})
			if code := Main(root); code != tt.code {
				t.Fatalf("exit %d, want %d", code, tt.code)
			}
			if tt.code != ExitOK {
				if ran {
					t.Error("the command ran despite a bad flag")
				}
				return
			}
			if f.Level != tt.level || f.Format != tt.format {
				t.Errorf("level %q format %q, want %q %q", f.Level, f.Format, tt.level, tt.format)
			}
			if _, err := f.Logger(&bytes.Buffer{}); err != nil {
				t.Errorf("logger: %v", err)
			}
		})
	}
}

// Progress lines go to a terminal only: never into a pipe or file a script reads, never with --json.
func TestProgressOnlyOnTerminal(t *testing.T) {
	var buf bytes.Buffer
	NewProgress(&buf, false).Stage("stage %d", 1)
	if buf.Len() != 0 {
		t.Errorf("progress written to a buffer: %q", buf.String())
	}
	master, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("SKIPPED: no pseudo-terminal: %v", err)
	}
	defer master.Close()
	if err := unix.IoctlSetPointerInt(int(master.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(master.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	tty, err := os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer tty.Close()
	NewProgress(tty, true).Stage("quiet")
	NewProgress(tty, false).Stage("fetching %s", "snap-1")
	master.SetReadDeadline(time.Now().Add(20 * time.Second))
	line, err := bufio.NewReader(master).ReadString('\n')
	if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatal(err)
	}
	if strings.Contains(line, "quiet") || !strings.Contains(line, "fetching snap-1") {
		t.Errorf("terminal got %q, want only the non-quiet stage", line)
	}
}
