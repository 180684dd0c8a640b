package sitecmd

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
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

// TestCheckProgramThroughALinkInAUsersDirectory: a program reached through a link in a directory another
// user owns is refused, wherever the link is on the path. Before, only the directories of the path as
// written and of the program's final location were checked: the user could point the link in the middle
// elsewhere between the check and the run, and run a program of its own as root.
func TestCheckProgramThroughALinkInAUsersDirectory(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIP: needs root to chown a directory to another user")
	}
	base := t.TempDir()
	trusted, user, bin := filepath.Join(base, "trusted"), filepath.Join(base, "user"), filepath.Join(base, "bin")
	for _, d := range []string{trusted, user, bin} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chown(user, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "fence"), []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(bin, filepath.Join(user, "link")); err != nil { // the user's link to root's bin
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(user, "link"), filepath.Join(trusted, "tools")); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(trusted, "tools", "fence")
	if err := CheckProgram("fence command", path); err == nil || !strings.Contains(err.Error(), user) {
		t.Errorf("CheckProgram(%s) = %v; want a refusal naming %s, whose owner can point %s elsewhere", path, err, user, filepath.Join(user, "link"))
	}
	// The same program through root's directories only is fine.
	if err := os.Symlink(bin, filepath.Join(trusted, "rootlink")); err != nil {
		t.Fatal(err)
	}
	if err := CheckProgram("fence command", trusted+"/rootlink/../bin/fence"); err != nil {
		t.Errorf("through root's link: %v", err)
	}
}

// TestRunKillsWhatTheCommandLeftBehind: a command that exits while a child it started still runs (a
// script's `ipmitool ... &`, a hung smartctl in a subshell) has its exit status reported as such, and the
// child, in the command's process group, dies with it instead of running on as root, one more at every
// run of a health check. Before, the group was killed on timeout only: the child ran on, and because it
// held the output open, Run waited waitDelay and reported exit 0 as a failure (exec.ErrWaitDelay), so a
// fence command that had powered the host off counted as failed.
func TestRunKillsWhatTheCommandLeftBehind(t *testing.T) {
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "child")
	prog := filepath.Join(dir, "check")
	body := "#!/bin/sh\nsleep 60 &\necho $! > " + pidFile + "\necho \"status $1\"\nexit $1\n"
	if err := os.WriteFile(prog, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, exit := range []int{0, 1} {
		r := Command{Name: "health command", Argv: []string{prog, strconv.Itoa(exit)}, Timeout: time.Minute}.Run(context.Background())
		if r.Exit != exit || (exit == 0) != (r.Err == nil) || !strings.Contains(r.Output, "status "+strconv.Itoa(exit)) {
			t.Errorf("exit %d with a child left behind: Run = exit %d err %v output %q", exit, r.Exit, r.Err, r.Output)
		}
		b, err := os.ReadFile(pidFile)
		if err != nil {
			t.Fatalf("the command did not record its child: %v", err)
		}
		stat := filepath.Join("/proc", strings.TrimSpace(string(b)), "stat")
		deadline := time.Now().Add(10 * time.Second)
		for {
			s, err := os.ReadFile(stat)
			// Gone, or a zombie waiting for its new parent to reap it.
			if err != nil || strings.Contains(string(s), ") Z ") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("exit %d: the command's child still runs after Run returned: %s", exit, s)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// TestRunPathHoldsRootsDirectoriesOnly: a command finds its tools through PATH, so only the agent's PATH
// directories that root alone can change reach it. Before, an agent started with a user's directory (or
// the working directory: an empty entry, ".") in its PATH ran that user's tool of the script's as root.
func TestRunPathHoldsRootsDirectoriesOnly(t *testing.T) {
	open := t.TempDir() // anyone may add a tool here
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	tool := "ftkit-test-tool"
	if err := os.WriteFile(filepath.Join(open, tool), []byte("#!/bin/sh\necho planted\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	rootOwn := t.TempDir() // root's alone, through /tmp (sticky, root's)
	prog := filepath.Join(rootOwn, "check")
	if err := os.WriteFile(prog, []byte("#!/bin/sh\necho \"PATH=$PATH\"\n"+tool+" || echo 'no tool'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", strings.Join([]string{open, "", ".", "relative/bin", "/usr/bin", rootOwn, "/bin", "/usr/bin"}, ":"))
	t.Chdir(open)
	r := Command{Name: "health command", Argv: []string{prog}, Timeout: time.Minute}.Run(context.Background())
	if r.Err != nil {
		t.Fatalf("Run: %v; output %q", r.Err, r.Output)
	}
	if want := "PATH=/usr/bin:" + rootOwn + ":/bin\n"; !strings.HasPrefix(r.Output, want) || strings.Contains(r.Output, "planted") {
		t.Errorf("output %q; want it to start with %q and the planted tool not found", r.Output, want)
	}
}

// TestRunKeepStderr: with KeepStderr the start of the command's standard error is kept apart (where a
// refusal shown to a user says why), bounded, and the combined output still holds both streams; without
// it nothing is kept apart.
func TestRunKeepStderr(t *testing.T) {
	dir := t.TempDir()
	prog := filepath.Join(dir, "check")
	body := "#!/bin/sh\necho 'on stdout'\necho 'why: uid 1000 has no job here' >&2\necho 'second line' >&2\n" +
		"if [ \"$1\" = big ]; then head -c 10000 /dev/zero | tr '\\0' x >&2; fi\nexit 1\n"
	if err := os.WriteFile(prog, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name      string
		keep      bool
		arg       string
		stderr    string // its start
		stderrLen int    // -1: any
	}{
		{"kept", true, "", "why: uid 1000 has no job here\nsecond line\n", -1},
		{"kept, bounded", true, "big", "why: uid 1000 has no job here\nsecond line\nxxx", MaxOutput},
		{"not kept", false, "", "", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := Command{Name: "start-job command", Argv: []string{prog, tc.arg}, Timeout: time.Minute, KeepStderr: tc.keep}.Run(context.Background())
			if r.Exit != 1 {
				t.Fatalf("exit %d err %v, want 1", r.Exit, r.Err)
			}
			if !strings.HasPrefix(r.Stderr, tc.stderr) || tc.stderrLen >= 0 && len(r.Stderr) != tc.stderrLen {
				t.Errorf("Stderr %q (%d bytes), want it to start with %q (%d bytes)", r.Stderr[:min(len(r.Stderr), 80)], len(r.Stderr), tc.stderr, tc.stderrLen)
			}
			if tc.arg == "" && (!strings.Contains(r.Output, "on stdout\n") || !strings.Contains(r.Output, "why: uid 1000")) {
				t.Errorf("combined output %q lacks a stream", r.Output)
			}
		})
	}
}

// TestRunRelativeProgram: a program not given by absolute path is not run. CheckProgram resolves it from
// the agent's working directory, but exec looks a bare name up in the agent's PATH (unfiltered) and runs
// a relative path from "/": the file checked was not the one run, and a user's directory on the agent's
// PATH ran that user's program as root.
func TestRunRelativeProgram(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIP: needs root to chown a directory to another user")
	}
	base := t.TempDir()
	cwd, user := filepath.Join(base, "cwd"), filepath.Join(base, "user")
	for _, d := range []string{cwd, user} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chown(user, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	// Root's program in the working directory passes CheckProgram; the user's, by the same name, is first
	// on the agent's PATH.
	if err := os.WriteFile(filepath.Join(cwd, "health"), []byte("#!/bin/sh\necho root\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(user, "health"), []byte("#!/bin/sh\necho user\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Chdir(cwd)
	t.Setenv("PATH", user+":"+DefaultPath)
	r := Command{Name: "health command", Argv: []string{"health"}, Timeout: time.Minute}.Run(context.Background())
	if r.Err == nil || strings.Contains(r.Output, "user") || !strings.Contains(r.Err.Error(), "absolute path") {
		t.Errorf("Run(health) = exit %d, output %q, err %v; want it not run, for want of an absolute path", r.Exit, r.Output, r.Err)
	}
}
