package sitecmd

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestTailBuffer(t *testing.T) {
	for _, tc := range []struct {
		name   string
		writes []int // sizes; byte i of the whole stream is 'a'+i%26
		want   int   // bytes kept (the stream's last ones)
	}{
		{"empty", nil, 0},
		{"small", []int{10, 20}, 30},
		{"exactly full", []int{MaxOutput}, MaxOutput},
		{"one write too big", []int{MaxOutput + 100}, MaxOutput},
		{"fills over several", []int{MaxOutput - 1, 2, 300}, MaxOutput},
		{"many small", []int{1000, 1000, 1000, 1000, 1000, 1000}, MaxOutput},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var all []byte
			var w tailBuffer
			for _, n := range tc.writes {
				p := make([]byte, n)
				for i := range p {
					p[i] = byte('a' + (len(all)+i)%26)
				}
				all = append(all, p...)
				if got, err := w.Write(p); got != n || err != nil {
					t.Fatalf("Write = %d, %v, want %d", got, err, n)
				}
			}
			if want := string(all[len(all)-tc.want:]); w.String() != want {
				t.Errorf("kept %d bytes, want the last %d", len(w.String()), tc.want)
			}
		})
	}
}

// TestRunExit: the exit status is reported as such (a health check's 1 means something), a command that
// did not exit on its own has none.
func TestRunExit(t *testing.T) {
	dir := t.TempDir()
	prog := filepath.Join(dir, "check")
	if err := os.WriteFile(prog, []byte("#!/bin/sh\necho \"status $1\"\nif [ \"$1\" = hang ]; then exec sleep 60; fi\nexit $1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		arg  string
		exit int
		err  string
	}{
		{"0", 0, ""},
		{"1", 1, "exit status 1"},
		{"7", 7, "exit status 7"},
		{"hang", -1, "timed out"},
	} {
		// Only the hanging one meets its timeout; the others have all the time a loaded machine needs.
		timeout := time.Minute
		if tc.exit == -1 {
			timeout = 2 * time.Second
		}
		r := Command{Name: "health command", Argv: []string{prog, tc.arg}, Timeout: timeout}.Run(context.Background())
		if r.Exit != tc.exit || (tc.err == "") != (r.Err == nil) || (r.Err != nil && !strings.Contains(r.Err.Error(), tc.err)) {
			t.Errorf("%s: exit %d err %v, want %d %q", tc.arg, r.Exit, r.Err, tc.exit, tc.err)
		}
		if !strings.Contains(r.Output, "status "+tc.arg) {
			t.Errorf("%s: output %q", tc.arg, r.Output)
		}
	}
	if r := (Command{Name: "health command"}).Run(context.Background()); r.Exit != -1 || !errors.Is(r.Err, ErrNoCommand) {
		t.Errorf("no command: %+v", r)
	}
}
